"""The command line: parse, call, and turn the user's faults into one line and their exit code (each error class
in errors.py carries its own). Exit codes: 0 done, 1 a bug, 2 command line or config, 3 data, 4 storage or credentials
(or the run folder being written by another run), 5 checkpoint unusable, 75 interrupted with a checkpoint committed
(run the same command again), 130 stopped by the user (Ctrl-C) with nothing to continue.

The commands, in the order --help lists them: those that train are here (train, sweep, find-batch-size: the
command line's package is the one place that imports the loop, job/run/train.py); the others each in a module named
for what it calls: model.py (evaluate, predict, export), track.py, machine.py (info, bench), shard.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, NoReturn

import typer

from job.cli import machine, model, shard, track
from job.cli.faults import quiet_stdout, user_errors
from job.cli.options import CONFIG_HELP, SET_HELP
from job.errors import ConfigError, Interrupted

if TYPE_CHECKING:
    from job.config import Config

__all__ = ["app", "end_process", "main"]


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


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="A PyTorch batch training job: config in; TensorBoard logs, checkpoints and metrics out.",
)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(train)
app.command()(sweep)
app.command()(model.evaluate)
app.command()(model.predict)
app.command()(model.export)
app.command()(track.track)
app.command()(machine.info)
app.command()(machine.bench)
app.command()(shard.shard)
app.command("find-batch-size")(find_batch_size)


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
