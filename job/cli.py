"""The command line: parse, call, and turn the user's faults into one line and their exit code (each error class
in errors.py carries its own). Exit codes: 0 done, 1 a bug, 2 command line or config, 3 data, 4 storage or credentials
(or the run folder being written by another run), 5 checkpoint unusable, 75 interrupted with a checkpoint committed
(run the same command again), 130 stopped by the user (Ctrl-C) with nothing to continue."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import typer

from job.errors import ConfigError, Interrupted, JobError

if TYPE_CHECKING:
    from job.config import Config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="A PyTorch batch training job: config in; TensorBoard logs, checkpoints and metrics out.",
)

CONFIG_HELP = (
    "Preset name (iris, cifar10, cifar10-fast, finetune, photos), or a YAML file at any URL (local, gs://, ...)."
)
SET_HELP = "Override a config key, e.g. --set train.epochs=5 (repeatable)."


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Faults the user can fix become one line on stderr and their exit code; bugs keep their traceback."""
    try:
        yield
    except JobError as e:
        code = e.exit_code
        prefix = "" if code in (75, 130) else "error: "
        if code not in (75, 130) or os.environ.get("RANK", "0") == "0":  # a group's stop is told once, by rank 0
            print(f"{prefix}{e}", file=sys.stderr)
        raise typer.Exit(code) from None
    except BrokenPipeError:  # the reader of standard output has left (`| head`): no fault, and nothing more to say
        quiet_stdout()
        raise typer.Exit(0) from None
    except KeyboardInterrupt:  # a second Ctrl-C while a run stops (job/group/stop.py), or one where nothing watches
        print("stopped at once by Ctrl-C; the last committed checkpoint, if any, is kept", file=sys.stderr)
        raise typer.Exit(130) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: str = typer.Option("iris", "--config", "-c", help=CONFIG_HELP),
    output: str = typer.Option(
        "", "--output", "-o", help="Run folder URL; default output.dir, else $AIP_CHECKPOINT_DIR, else ./runs/<name>."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    device: str = typer.Option("auto", "--device", "-d", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N."),
    resume: str = typer.Option(
        "auto",
        "--resume",
        help="auto: continue the run in the output folder if there is one; never; or a URL.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Start the output folder afresh, replacing a run in it (implies --resume never)."
    ),
    time_limit: str = typer.Option(
        "",
        "--time-limit",
        help="Stop after this long (seconds, or e.g. 45m, 11h30m), commit a checkpoint and exit 75; the same command "
        "continues. Sets train.time_limit.",
    ),
    nproc_per_node: str = typer.Option(
        "",
        "--nproc-per-node",
        help="Start this many worker processes on this machine (auto: one per GPU, 1 without) and train with "
        "DistributedDataParallel; the job exits with their exit code. Implied (auto) where SkyPilot, Cloud Batch or "
        "Vertex AI say there are several machines.",
    ),
    nnodes: int | None = typer.Option(
        None, "--nnodes", help="Machines in the group, each running this command; default: 1, or the platform's."
    ),
    node_rank: int | None = typer.Option(None, "--node-rank", help="With --nnodes: this machine's place, 0 to N-1."),
    master_addr: str | None = typer.Option(None, "--master-addr", help="With --nnodes: the first machine's address."),
    master_port: int | None = typer.Option(
        None, "--master-port", help="With --nnodes: a free port on the first machine, the same on all (default 29500)."
    ),
) -> None:
    """Train a model as the config says; continue the run when the output folder holds one.

    Vertex AI tuning's appended --<parameterId>=<value> (or --<parameterId> <value>) sets that config key after --set:
    --optim.lr=0.05, --optim__lr 0.05."""
    from job.group.stop import StopRequest

    with user_errors():
        overrides = [*overrides, *tuning_overrides(ctx)]
        from job.group.env import torchvision_problem
        from job.group.launch import LAUNCHER, end_with_launcher, launch_plan

        if problem := torchvision_problem():  # before anything is made: a mismatched build fails mid-run otherwise
            raise ConfigError(problem)
        limit = [f"train.time_limit={seconds(time_limit)}"] if time_limit else []
        from job.group import platforms, slurm

        place = platforms.settle()  # the platform and this process's place in its group, read once
        group = launch_plan(nproc_per_node, nnodes, node_rank, master_addr, master_port, device, place)
        if group is None:
            platforms.adopt(place)  # one process of a group the platform started (srun -n N): torch's variables
    if group:  # this process starts the workers and waits for them (under torchrun it is a worker, and trains)
        with user_errors():
            from job.config import load_config
            from job.group.launch import launch
            from job.storage.lease import check

            cfg = load_config(config, [*overrides, *limit])  # a bad config: one line here, not one per worker
            if group.node_rank == 0:  # a busy folder too; the other machines' workers never hold it
                check(run_url(cfg, output)[0])
            args = {"--config": config, "--output": output, "--device": device, "--resume": resume}
            args |= {"--time-limit": time_limit, "--overwrite": overwrite}
            code = launch(group, args, overrides)
        if code:
            raise typer.Exit(code)
        return
    end_with_launcher()  # a worker of this job's launcher: not a moment longer than it
    # Watch for SIGTERM from the start: a preemption during the slow imports and data loading still exits 75.
    with user_errors(), StopRequest(grace_seconds=20.0, exits_after=True) as stop:
        from job.config import load_config
        from job.console import follower, say
        from job.run.train import run

        cfg = load_config(config, [*overrides, *limit])
        target, routes = run_url(cfg, output)
        if not (output or cfg.output.dir) and target != f"runs/{cfg.name}":
            places = "".join(f", {k} to {v}" for k, v in routes.items())
            say(f"Vertex AI (AIP_* variables): the run goes to {target}{places}")
        if place.name and not os.environ.get(LAUNCHER) and (place.process is not None or place.nnodes != 1):
            say(place.describe())  # a group the platform started, on the console (a launcher's says its own)
        import psutil

        began = time.time() if place.joined else psutil.Process().create_time()  # called in a process of Ray's
        try:
            run(cfg, target, device, resume, overwrite, stop, routes, began)
        except Interrupted as e:
            usr1 = stop.signal == getattr(signal, "SIGUSR1", None) and not os.environ.get(LAUNCHER)  # not a worker
            if usr1 and not follower() and (said := slurm.requeue(say=say)):  # Slurm's warning: requeue
                raise Interrupted(f"{e}; {said}") from None
            raise


def tuning_overrides(ctx: typer.Context) -> list[str]:
    """The extra arguments Vertex AI appends to a tuning trial's command, --<parameterId>=<value> or --<parameterId>
    <value>, as key=value overrides: an id with a dot or a double underscore (written for a dot) names a config key.
    Any other extra argument is refused as the command line refuses it."""
    import difflib

    from job.config import check_setting

    args, out = list(ctx.args), []
    while args:
        arg = args.pop(0)
        name, sep, value = arg.partition("=")
        key = name[2:].replace("__", ".")
        if not arg.startswith("--") or "." not in key:
            # in the parser's own words, as before extra arguments were let through
            if not arg.startswith("-"):
                ctx.fail(f"Got unexpected extra argument(s) ({' '.join([arg, *args])})")
            options = [opt for param in ctx.command.params for opt in param.opts if opt.startswith("--")]
            close = sorted(difflib.get_close_matches(name, options))
            ctx.fail(f"No such option: {name}" + (f" (Possible options: {', '.join(close)})" if close else ""))
        if not sep:
            if not args or args[0].startswith("--"):
                raise ConfigError(f"{name}: expected a value ({name}=VALUE or {name} VALUE)")
            value = args.pop(0)
        check_setting(key, arg if sep else f"{name} {value}")
        out.append(f"{key}={value}")
    return out


@app.command()
def sweep(
    space: str = typer.Argument(
        ...,
        help="The space file (YAML at any URL): metric, direction, trials, sampler, "
        "pruner, space {config.key: {low, high, log} or a list of values}.",
    ),
    study: str = typer.Option(
        "",
        "--study",
        help="The study's storage, shared by its workers: sqlite:///PATH (one machine; default: <output>/study.db) or "
        "postgresql://USER@HOST:PORT/DB (several machines).",
    ),
    trials: int | None = typer.Option(
        None, "--trials", help="Finished trials the study ends with; default: the space file's trials."
    ),
    config: str = typer.Option("iris", "--config", "-c", help=CONFIG_HELP),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    output: str = typer.Option(
        "",
        "--output",
        "-o",
        help="The sweep's folder (trials/<n>/, best/, best.json, trials.csv); default ./runs/<name>-sweep.",
    ),
    device: str = typer.Option("auto", "--device", "-d", help="auto, cpu, cuda, cuda:N."),
    nproc_per_node: int = typer.Option(
        1,
        "--nproc-per-node",
        help="Run each trial on this many processes (job train --nproc-per-node), its parameters drawn once for all.",
    ),
) -> None:
    """One worker of a hyperparameter sweep (an Optuna study): it runs trials, each an ordinary run in
    <output>/trials/<n>/, until the study's N trials have ended, then writes the results. Start several against one
    --study; a worker stopped (SIGTERM: exit 75) or killed leaves its trial to the next, which continues it from its
    last checkpoint with the same parameters; a trial that fails is tried once more, and the worker goes on."""
    from job.group.stop import StopRequest

    with user_errors(), StopRequest(grace_seconds=20.0, exits_after=True) as stop:
        from job.run.train import run as train
        from job.study.sweep import sweep as run_sweep

        run_sweep(space, study, trials, config, overrides, output, device, nproc_per_node, stop, train)


def run_url(cfg: Config, output: str) -> tuple[str, dict[str, str]]:
    """Where a run goes: --output, else output.dir, else Vertex AI's folders (with the places its other files go),
    else runs/<name>."""
    from job.storage.cloud import vertex_outputs

    routes = {} if output or cfg.output.dir else vertex_outputs()
    return output or cfg.output.dir or routes.pop("run", "") or f"runs/{cfg.name}", routes


def seconds(duration: str) -> float:
    """--time-limit's text in seconds, read as a duration (never as YAML, which takes 11:30 for 690)."""
    from job.duration import parse_duration

    try:
        return parse_duration(duration)
    except ValueError as e:
        raise ConfigError(f"--time-limit: {e}, got {duration!r}") from None


@app.command()
def evaluate(
    checkpoint: str = typer.Option("", "--checkpoint", help="A run folder (its newest checkpoint), or a .pt file."),
    model: str = typer.Option("", "--model", "-m", help="As predict takes it: a run folder (model.pt), or a .pt."),
    data: str = typer.Option(
        "",
        "--data",
        help="Labelled images to score instead of the run's split: class folders, an archive, or a data format's.",
    ),
    config: str = typer.Option("", "--config", "-c", help="Config to evaluate with; default: the checkpoint's."),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    device: str = typer.Option("auto", "--device", "-d", help="auto, cpu, cuda, cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    report: str = typer.Option(
        "",
        "--report",
        help="Write the report (confusion, classes, worst) of each held-out split, or of --data, to DIR/<split>/.",
    ),
) -> None:
    """Loss and accuracy of a saved run, model or checkpoint: on its test split (val when it has none), or on any
    labelled images (--data) preprocessed as its evaluation was."""
    with user_errors():
        from job.use.evaluate import evaluate_checkpoint, evaluate_on

        if not (checkpoint or model):
            raise ConfigError("evaluate: name the model: --model URL (or --checkpoint URL)")
        if data:
            result = evaluate_on(model or checkpoint, data, device, report or None)
            result["checkpoint"], result["epoch"] = model or checkpoint, None
        else:
            url = checkpoint or chosen_weights(model)
            result = evaluate_checkpoint(url, config or None, overrides, device, report or None)
        if as_json:
            print(json.dumps(result))
        else:
            where = f": epoch {result['epoch']}, step {result['step']}" if result["epoch"] is not None else ""
            s = result["split"]
            metric = "map" if f"{s}_map" in result else "accuracy"  # multi-label: mean average precision
            print(
                f"{result['checkpoint']}{where}: {s}_loss {result[f'{s}_loss']:.4f}  "
                f"{s}_{metric} {result[f'{s}_{metric}']:.4f} ({result['samples']} {s} samples)"
            )


@app.command()
def predict(
    inputs: list[str] = typer.Argument(
        ...,
        metavar="INPUT",
        help="Images: files, folders (recursive), glob patterns, .tar/.tar.gz archives, folders of shards, "
        "the files of data formats that name or hold images (each row's image), at any URL; "
        "for a model of a table, tables.",
    ),
    model: str = typer.Option(..., "--model", "-m", help="A run folder, its model.pt, or a checkpoint, at any URL."),
    output: str = typer.Option("", "--output", "-o", help="A .csv or .jsonl file at any URL; default: CSV on stdout."),
    top_k: int = typer.Option(1, "--top-k", min=1, help="Labels and probabilities per image."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Images per batch."),
    device: str = typer.Option("auto", "--device", "-d", help="auto, cpu, cuda, cuda:N, mps."),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1, help="Processes on this machine, each predicting its part (<output>.part-i-of-n)."
    ),
    decode: str = typer.Option(
        "auto",
        "--decode",
        metavar="auto|host|device",
        help="Where images are decoded: host (processes), or device: JPEG images by the CUDA device's nvJPEG, other "
        "formats on the host; auto: host.",
    ),
) -> None:
    """Labels and probabilities for new images from a trained model, preprocessed as its evaluation was; a file that
    cannot be read gets a row with its error (exit 3 when none could be read). In a Cloud Batch task array each task
    predicts its part (BATCH_TASK_INDEX of BATCH_TASK_COUNT) into <output>.part-<i>-of-<n>."""
    with user_errors():
        from job.use.parts import PART, part_device, spread

        if nproc_per_node > 1 and PART not in os.environ:
            if not output:  # said once here, not by each process
                raise ConfigError(
                    "--nproc-per-node: each process writes a part, <output>.part-<i>-of-<n>: give --output"
                )
            raise typer.Exit(spread(sys.argv[1:], nproc_per_node))
        from job.console import say
        from job.use.predict import predict as run_predict

        if decode not in ("auto", "host", "device"):
            raise ConfigError(f"--decode {decode}: expected auto, host or device")
        run_predict(model, inputs, output or None, top_k, batch_size, part_device(device), log=say, decode=decode)


@app.command()
def export(
    model: str = typer.Option(..., "--model", "-m", help="A run folder, its model.pt, or a checkpoint, at any URL."),
    fmt: str = typer.Option(..., "--format", "-f", help="onnx or pt2."),
    output: str = typer.Option("", "--output", "-o", help="The file to write; default: model.<format> in the run."),
    check_images: list[str] = typer.Option(
        [], "--check-images", help="Images to check the export on; default: the run's val (or test) images."
    ),
    track: bool = typer.Option(False, "--track", help="Send the export to the run's MLflow run (export/)."),
) -> None:
    """The model as an ONNX or torch.export (pt2) file, with its class names and preprocessing, run with its own
    runtime on real images and compared with the model before it is called done (<output>.check.json)."""
    with user_errors():
        from job.console import say
        from job.use.export import export as run_export

        check = run_export(model, fmt, output or None, check_images, log=say)
        if track:
            from job.errors import StorageError
            from job.sinks.track import send_export

            line, sent = send_export(model, [check["output"], f"{check['output']}.check.json"])
            if not sent:
                raise StorageError(f"{line}; python -m job track RUN sends it later")
            say(line)


@app.command()
def track(
    run: str = typer.Argument(..., help="The run folder, at any URL."),
    mlflow: str = typer.Option("", "--mlflow", help="The tracking server; default: the one the run was tracked in."),
) -> None:
    """Send what a tracked run's MLflow server lacks (points, params, files, status, model version), kept in the
    run's track.jsonl while the server could not take it. As often as you like: nothing is sent twice."""
    with user_errors():
        from job.console import say
        from job.errors import StorageError
        from job.sinks.track import send_run
        from job.storage.run_folder import RunDir

        line, sent = send_run(RunDir(run), mlflow or None)
        if not sent:
            raise StorageError(line)
        say(line)


def chosen_weights(url: str) -> str:
    """--model's run folder is its model.pt (the weights it chose), as predict reads it; anything else as given."""
    from job.storage.cloud import filesystem

    fs, path = filesystem(url)
    beside = f"{path.rstrip('/')}/model.pt"
    return f"{url.rstrip('/')}/model.pt" if fs.isdir(path) and fs.exists(beside) else url


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")) -> None:
    """The machine as training sees it: torch, CUDA, cuDNN, GPUs and their memory, CPU cores, /dev/shm, and the
    platform and group its variables describe (Slurm, Kubeflow, Vertex AI, ...)."""
    from job.group.env import format_info
    from job.group.env import info as gather

    report = gather()
    print(json.dumps(report, indent=1) if as_json else format_info(report))


@app.command()
def bench(
    config: str = typer.Option("iris", "--config", "-c", help=CONFIG_HELP),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    devices: str = typer.Option("", "--devices", help="Comma list, e.g. cpu,cuda; default: cpu, and cuda if present."),
    epochs: int = typer.Option(0, "--epochs", min=0, help="Train this many epochs in both loops; 0: the config's."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """The recipe trained by the tutorials' naive loop and by this job, on each device: s/epoch, samples/s,
    test accuracy and the speed-ups."""
    with user_errors():
        from job.bench.compare import bench as measure
        from job.bench.compare import format_table, parse_devices
        from job.config import load_config

        cfg = load_config(config, [*overrides, *([f"train.epochs={epochs}"] if epochs else [])])
        result = measure(cfg, parse_devices(devices))
        print(json.dumps(result, indent=1) if as_json else format_table(result))


@app.command()
def shard(
    src: str = typer.Argument(
        ...,
        help="An image folder (class folders, or train/ val/ test/ folders of them), a .tar/.tar.gz of one, or a "
        "manifest (.csv, .jsonl: a column of image paths and one of labels), at any URL.",
    ),
    dst: str = typer.Argument(
        ..., help="The shard folder to write, at any URL (train/*.tar, val/*.tar, test/*.tar, classes.txt)."
    ),
    shard_size: str = typer.Option("256MB", "--shard-size", help="Largest shard, e.g. 256MB or 1GB."),
    samples_per_shard: int = typer.Option(1000, "--samples-per-shard", help="Most samples in one shard."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shuffle across shards."),
    val_split: float = typer.Option(
        0.1, "--val-split", min=0, max=0.99, help="Share of each class held out for val where SRC has no val/."
    ),
    test_split: float = typer.Option(
        0.0, "--test-split", min=0, max=0.99, help="Share of each class held out for test where SRC has no test/."
    ),
    split_seed: int = typer.Option(42, "--split-seed", help="Seed of the held-out files (a hash of each path)."),
    path_column: str = typer.Option("path", "--path-column", help="A manifest's column of image paths."),
    label_column: str = typer.Option("label", "--label-column", help="A manifest's column of labels."),
    split_column: str = typer.Option(
        "split", "--split-column", help="A manifest's column of splits (train, val, test), where it has one."
    ),
) -> None:
    """Pack an image folder or a manifest's images into WebDataset-style tar shards, shuffled, for streaming
    (data.kind=shards); files that cannot be decoded or are not there are skipped and listed in index.json."""
    with user_errors():
        from job.console import say
        from job.data.items import Columns
        from job.data.pack import pack, parse_size
        from job.data.split import HoldOut

        hold = HoldOut(val_split, test_split, split_seed)
        columns = Columns(path_column, label_column, split_column)
        size = parse_size(shard_size)
        pack(src, dst, say, shard_bytes=size, shard_samples=samples_per_shard, seed=seed, hold=hold, columns=columns)


@app.command("find-batch-size")
def find_batch_size(
    config: str = typer.Option("iris", "--config", "-c", help=CONFIG_HELP),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    device: str = typer.Option("auto", "--device", "-d", help="auto, cpu, cuda, cuda:N."),
    memory_gib: float = typer.Option(
        None,
        "--memory-gib",
        min=0.01,
        help="Memory the run may use; default: the whole GPU, or 80% of free host memory.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """The largest training batch that fits on the device, found by training on doubling, then bisected, batches."""
    with user_errors():
        from job.config import load_config
        from job.run.batch_size import find_batch_size as search

        result = search(load_config(config, overrides), device, memory_gib)
        if as_json:
            print(json.dumps(result))
        else:
            print(
                f"largest batch that fits on {result['device']} ({result['memory']}): {result['batch_size']}"
                f"{' (the whole training split)' if result['limited_by'] != 'memory' else ''}; "
                f"train with --set data.batch_size={result['batch_size']} or less"
            )


def main() -> None:
    """Run the command line; a usage error (unknown option, missing value) is one line and exit 2 as well."""
    try:
        code = app(prog_name="python -m job", standalone_mode=False)
    except Exception as e:
        # typer raises its command-line errors as exceptions carrying their exit code; anything else is a bug.
        if not (hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int)):
            raise
        if e.format_message():  # empty after the help that a bare `python -m job` prints
            print(f"error: {e.format_message()} (see python -m job --help)", file=sys.stderr)
        code = e.exit_code
    from job.group.launch import is_worker

    if is_worker():  # a worker of a group, its files written and its group left
        # Past this point only the interpreter's teardown remains, where the group's transport threads can abort a
        # process that has finished ("terminate called without an active exception": exit -6 in place of 75).
        end_process(code or 0, exit_handlers=False)
    sys.exit(code or 0)


def end_process(code: int, exit_handlers: bool = True) -> NoReturn:
    """End this process now, without the interpreter's teardown, having done what of it matters: stop the decoding
    processes (they hold this one's stderr), run the exit handlers (unless told not to), flush the streams."""
    import atexit

    if decoders := sys.modules.get("job.data.decode"):
        decoders.close_pools()
    if exit_handlers:
        atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader has left: what it did not read is not wanted
        quiet_stdout()
    sys.stderr.flush()
    os._exit(code)


def quiet_stdout() -> None:
    """Standard output to /dev/null: its reader has gone, and a later write or flush would fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
