"""The training loop: set a run up from its config, then epochs of steps, evaluations and checkpoints.

Inside an epoch nothing waits for the device: losses are summed on the device and copied to the host
N steps at a time without blocking; the host reads numbers only at evaluations and checkpoints.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from job import checkpoint, cloud, distributed
from job.batch_size import is_out_of_memory, memory_guard, out_of_memory_error
from job.config import Config, flat_items, to_yaml
from job.data import Dataset, load_data
from job.data.loader import BatchLoader, channel_stats, choose_storage
from job.env import describe_device, pick_device, resolve_precision, seed_everything
from job.errors import ConfigError, Interrupted, StorageError
from job.models import build_model
from job.report import Report, say
from job.step import SMALL_STEP_FLOPS, build_step, forward_flops
from job.stop import TIME_LIMIT, StopRequest
from job.storage import RunDir

# Keys a resumed run may change: they do not alter what the checkpoint's state means.
RESUME_SAFE = {
    "name",
    "output.dir",
    "output.staged",
    "output.sync_every_seconds",
    "output.upload_timeout_seconds",
    "data.cache",
    "data.path",
    "data.placement",
    "data.device_share",
    "data.eval_batch_size",
    "train.epochs",
    "train.log_every_steps",
    "train.eval_every_epochs",
    "train.checkpoint_every_epochs",
    "train.keep_last",
    "train.precision",
    "train.channels_last",
    "train.step_capture",
    "train.compile",
    "train.cpu_threads",
    "train.time_limit",
}


@dataclass
class Progress:
    """Where a run is: saved in every checkpoint, so a resumed run carries on from exactly here."""

    epoch: int = 0  # epochs finished
    epoch_step: int = 0  # steps done in the current epoch (0 at an epoch boundary)
    step: int = 0  # optimizer steps in the whole run
    steps_since_eval: int = 0
    samples_since_eval: int = 0
    best_accuracy: float = -1.0
    best_epoch: int = 0
    run_id: str = ""  # one per run, kept across resumes: tells this run's checkpoints from another's


class TrainClock:
    """Seconds spent in training epochs, excluding evaluations and checkpoints, without waiting for the device:
    on a GPU, CUDA events mark each stretch of epochs and are read only after the device has caught up."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.open = False

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        if not self.open:
            self.marks.append(self.mark())
            self.open = True

    def stop(self) -> None:
        if self.open:
            self.marks.append(self.mark())
            self.open = False

    def seconds(self) -> float:
        self.stop()
        pairs = zip(self.marks[::2], self.marks[1::2])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in pairs) / 1000
        return sum(b - a for a, b in pairs)


class LossLog:
    """Training loss summed on the device: [sum over the current log window, sum since the last evaluation].

    Every `every` steps the window sum is copied to pinned host memory without blocking; the value is
    handed out once the copy has landed, so logging costs no host sync.
    """

    def __init__(self, device: torch.device, every: int) -> None:
        self.device, self.every = device, every
        self.sums = torch.zeros(2, device=device)
        self.pending: deque = deque()

    def close_window(self, step: int, lr: float) -> None:
        host = torch.empty(1, pin_memory=self.device.type == "cuda")
        distributed.mean_(self.sums[:1])  # under torchrun: the group's window (nccl: queued, no host sync)
        host.copy_(self.sums[:1], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.sums[:1].zero_()  # in place: assigning a Python number would copy from the host and sync
        self.pending.append((step, lr, host, event))

    def ready(self, wait: bool = False):
        """(step, mean loss, lr) of each window whose copy has landed (all of them with wait=True)."""
        while self.pending:
            step, lr, host, event = self.pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self.pending.popleft()
            yield step, host.item() / self.every, lr


def run(
    cfg: Config,
    output: str,
    device_name: str = "auto",
    resume: str = "auto",
    overwrite: bool = False,
    stop: StopRequest | None = None,
    routes: dict[str, str] | None = None,
) -> dict:
    """Train as the config says, writing the run to `output`; returns the final summary. `stop` is the caller's
    signal watch when it installed one early (the command line does, before the slow imports)."""
    with contextlib.nullcontext(stop) if stop is not None else StopRequest(cfg.train.grace_seconds) as stop:
        stop.grace_seconds = cfg.train.grace_seconds
        stop.limit(cfg.train.time_limit)
        return train_run(cfg, output, device_name, resume, overwrite, stop, routes)


def train_run(
    cfg: Config,
    output: str,
    device_name: str,
    resume: str,
    overwrite: bool,
    stop: StopRequest,
    routes: dict[str, str] | None = None,
) -> dict:
    t_start, threads = time.perf_counter(), torch.get_num_threads()
    distributed.start(device_name, stop)  # under torchrun: join the process group; otherwise nothing
    together = False
    try:
        summary = train_rank(cfg, output, device_name, resume, overwrite, stop, routes, t_start)
        together = True
        return summary
    finally:
        distributed.finish(together)
        torch.set_num_threads(threads)  # train.cpu_threads holds for the run, not for a notebook's kernel after it


def train_rank(
    cfg: Config,
    output: str,
    device_name: str,
    resume: str,
    overwrite: bool,
    stop: StopRequest,
    routes: dict[str, str] | None,
    t_start: float,
) -> dict:
    # Rank 0 checks and opens the run folder; the other processes of a group only name it and never write to it.
    run_dir = distributed.on_writer(lambda: preflight(cfg, output, resume, overwrite, routes)) or RunDir(output)
    try:
        summary = train_loop(cfg, run_dir, device_name, resume, overwrite, stop, t_start)
    except Interrupted as e:
        try:
            run_dir.finish()  # the grace period's timer ends the process if this takes too long
        except StorageError as failed:  # still exit 75: a retry continues from what the store holds
            raise Interrupted(f"{e}; but {failed}") from None
        raise
    except BaseException as e:
        with contextlib.suppress(Exception):  # send what was committed before the failure, for a retry elsewhere
            run_dir.finish(timeout=30)
        run_dir.abandon()
        if is_out_of_memory(e):  # the loop names its batch sizes itself: this is setting up (data, model)
            raise out_of_memory_error("while setting up the run", pick_device(device_name)) from None
        raise
    return summary


def preflight(cfg: Config, output: str, resume: str, overwrite: bool, routes: dict[str, str] | None) -> RunDir:
    """Before any work: the credentials in use, the inputs there, every output location writable."""
    urls = [u for u in (cfg.data.path, cfg.data.test_path, output, *(routes or {}).values()) if u]
    if resume not in ("auto", "never"):
        urls.append(resume)
    if any(cloud.is_gcs(u) for u in urls):
        say(f"storage: gs:// as {cloud.gcs_credentials()[1]}")
    for url in (cfg.data.path, cfg.data.test_path):
        if url:
            cloud.check_input(url)
    o = cfg.output
    run_dir = RunDir(output, routes, o.upload_timeout_seconds, o.sync_every_seconds, staged=o.staged)
    run_dir.prepare()
    if resume == "never" and run_dir.staged_files() and not overwrite:
        raise ConfigError(
            f"{run_dir.url}: an earlier attempt left files on this machine ({run_dir.local}): --resume auto "
            "uploads them and continues, --overwrite discards them"
        )
    if resume == "never":
        run_dir.clear_staging()
    else:
        checkpoint.recover(run_dir)
    if run_dir.remote:  # the store's checkpoints and their manifests, read now rather than from the loop
        for name in run_dir.list(checkpoint.FOLDER):
            if checkpoint.is_manifest(name):
                run_dir.read(f"{checkpoint.FOLDER}/{name}")
    return run_dir


def train_loop(
    cfg: Config, run_dir: RunDir, device_name: str, resume: str, overwrite: bool, stop: StopRequest, t_start: float
) -> dict:
    device = pick_device(device_name)
    seed_everything(cfg.seed, cfg.train.deterministic)
    data = load_data(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.input_shape, len(data.classes))
    t = cfg.train
    precision = resolve_precision(t.precision, device)
    channels_last = use_channels_last(t.channels_last, model, device, precision)
    found = distributed.share_checkpoint(lambda: open_run(run_dir, resume, overwrite, cfg))
    train_loader, test_loader, where = make_loaders(cfg, data, device, channels_last)
    step_flops = float("inf")  # what a step costs matters on a CPU only (threads, tracing)
    if device.type == "cpu":
        step_flops = forward_flops(model, data.input_shape) * train_loader.batch_size
        small = step_flops < SMALL_STEP_FLOPS
        torch.set_num_threads(t.cpu_threads if t.cpu_threads != "auto" else 1 if small else torch.get_num_threads())
    say(f"device {describe_device(device)}; data {data.describe()}, held on {where}")
    say(f"model {cfg.model.name}: {sum(p.numel() for p in model.parameters()):,} parameters; output {run_dir.url}")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not cfg.train.deterministic
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    model.train()
    optimizer = make_optimizer(cfg, model, fuse_optimizer(device, precision))
    scheduler = make_scheduler(cfg, optimizer, cfg.train.epochs * len(train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    state, log = Progress(run_id=uuid.uuid4().hex[:12]), LossLog(device, cfg.train.log_every_steps)
    if found is not None:
        payload, manifest = found
        checkpoint.restore(payload, model, optimizer, scheduler, scaler)
        saved = dict(payload["progress"])
        sums = torch.tensor(saved.pop("loss_sums"))
        log.sums.copy_(distributed.own(sums) if sums.dim() == 2 else sums)  # one row per process saved it
        state = Progress(**{"run_id": state.run_id, **saved})
        say(f"resuming {cfg.name} from epoch {state.epoch}, step {state.step} ({manifest['file']})")
    prime_momentum(optimizer)
    stop.sync()
    if stop.signal is not None:  # stopped while setting up: nothing new to save, nothing written yet
        if stop.signal == TIME_LIMIT:  # the next attempt would set up as long: a setting to change, not a retry
            raise ConfigError(f"{stop.describe()} ran out before training began: allow more with train.time_limit")
        raise Interrupted(f"stopped by {stop.describe()} before training began: run the same command again to continue")
    if not distributed.is_writer():
        report = distributed.FollowerReport()
    else:
        run_dir.write("config.yaml", to_yaml(cfg).encode())
        report = Report(run_dir, flat_items(cfg), cfg.train.epochs, len(train_loader), state.step + 1 if found else 0)
    step_model = distributed.wrap(model, device)
    step_model = torch.compile(step_model) if t.compile else step_model  # checkpoints keep the plain module's names
    capture = "off" if t.compile or step_model is not model else t.step_capture
    amp = autocast(cfg, device)
    step_fn = build_step(step_model, optimizer, scheduler, scaler, amp, log.sums, device, capture, step_flops)
    if t.compile:
        step_fn.description = "the compiled model in eager steps (step capture is off with torch.compile)"
    elif step_model is not model:
        step_fn.description = "eager (DistributedDataParallel reduces gradients from autograd hooks: no capture)"
    layout = ", channels-last" if channels_last else ""
    compiled = ", torch.compile" if t.compile else ""
    say(f"step: {precision}{layout}{compiled}; {step_fn.description}")
    t_eval, clock, first_epoch, described = time.perf_counter(), TrainClock(device), state.epoch, step_fn.description
    for epoch in range(state.epoch, cfg.train.epochs):
        report.start_epoch(epoch, state.epoch_step)
        clock.start()
        with memory_guard(f"data.batch_size={cfg.data.batch_size}", device):
            finished = train_epoch(step_fn, optimizer, train_loader, epoch, state, log, report, stop)
        if step_fn.description != described:  # a fallback found on the first batch: say so once
            described = step_fn.description
            say(f"step: {described}")
        if finished:
            state.epoch, state.epoch_step = epoch + 1, 0
        last = state.epoch == cfg.train.epochs
        report.end_epoch()
        if finished and (state.epoch % cfg.train.eval_every_epochs == 0 or last):
            clock.stop()
            with memory_guard(f"data.eval_batch_size={test_loader.batch_size}", device):
                t_eval = evaluation(model, test_loader, autocast(cfg, device), state, log, report, t_start, t_eval)
        stopping = stop.signal is not None and not last
        if stopping:
            say(f"{stop.describe()}: stopping at epoch {state.epoch}, step {state.step}; committing a checkpoint")
        if stopping or last or (finished and state.epoch % cfg.train.checkpoint_every_epochs == 0):
            clock.stop()
            # Each process's own loss sums, so that every one of them resumes with exactly what it had.
            sums = distributed.gather(log.sums).tolist()
            distributed.on_writer(
                partial(save, run_dir, cfg, model, optimizer, scheduler, scaler, state, log, report, sums)
            )
        if stopping:
            raise Interrupted(
                f"stopped by {stop.describe()} at epoch {state.epoch}, step {state.step}; "
                f"checkpoint committed to {run_dir.url}: run the same command again to continue"
            )
    stop.finishing()
    final = distributed.on_writer(lambda: write_results(run_dir, model, state, report))
    if not distributed.is_writer():  # rank 0 has written the results and uploads them
        return {"rank": distributed.rank(), "epochs": state.epoch, "steps": state.step}
    if run_dir.remote:
        say(f"uploading the run's last files to {run_dir.url}")
    run_dir.finish()
    summary = {
        **final,
        "best_epoch": state.best_epoch,
        "epochs": state.epoch,
        "steps": state.step,
        "seconds": round(time.perf_counter() - t_start, 2),
        "train_seconds": round(clock.seconds(), 4),  # in this process's training epochs only
        "epochs_run": state.epoch - first_epoch,
        "output": run_dir.url,
    }
    if stop.signal or stop.received:  # it came during the last step or while the results were written
        reason = stop.describe(stop.signal or stop.received)
        say(f"{reason} came as the run was ending: it finished, there is nothing to continue")
    say(
        f"done: {state.epoch} epochs, {state.step} steps in {summary['seconds']:.1f} s; best test accuracy "
        f"{state.best_accuracy:.4f} (epoch {state.best_epoch}), final {final['final_accuracy']:.4f}; "
        f"outputs in {run_dir.url}"
    )
    return summary


def write_results(run_dir: RunDir, model, state: Progress, report: Report) -> dict:
    """The final weights, hparams and curves; returns the final metrics."""
    final = {
        "best_accuracy": state.best_accuracy,
        "final_accuracy": report.records[-1]["test_accuracy"],
        "final_test_loss": report.records[-1]["test_loss"],
    }
    run_dir.write("model.pt", state_dict_bytes(model))
    report.close(final)
    return final


def train_epoch(
    step_fn,
    optimizer,
    loader: BatchLoader,
    epoch: int,
    state: Progress,
    log: LossLog,
    report: Report,
    stop: StopRequest,
) -> bool:
    """One epoch from where the state says it stands; False when a stop was requested before its end."""
    every = log.every
    for x, y in loader.batches(epoch, state.epoch_step):
        step_fn(x, y, loader.loss_weight(state.epoch_step))
        state.step += 1
        state.epoch_step += 1
        state.steps_since_eval += 1
        state.samples_since_eval += y.shape[0]
        if state.step % every == 0:
            log.close_window(state.step, optimizer.param_groups[0]["lr"])
            for step, loss, lr in log.ready():
                report.loss(step, loss, lr)
            report.advance(every)
            stop.sync()  # under torchrun the processes agree here whether to stop, every `every` steps
        if stop.signal is not None:
            break
    return state.epoch_step == len(loader)


@torch.no_grad()
def evaluate(model, loader: BatchLoader, amp) -> torch.Tensor:
    """[summed loss, correct predictions] over the split, left on the device."""
    model.eval()
    sums = torch.zeros(2, device=loader.device)
    for x, y in loader.batches():
        with amp():
            out = model(x)
        sums[0] += F.cross_entropy(out.float(), y, reduction="sum")
        sums[1] += (out.argmax(1) == y).sum()
    model.train()
    return sums


def evaluation(
    model,
    loader: BatchLoader,
    amp,
    state: Progress,
    log: LossLog,
    report: Report,
    t_start: float,
    t_eval: float,
) -> float:
    """Test the model and report it with the training loss and throughput since the previous evaluation
    (which ended at t_eval); returns when this one ended."""
    sums = distributed.totals(evaluate(model, loader, amp), log.sums[1:]).tolist()  # the evaluation's one host sync
    now = time.perf_counter()
    for step, loss, lr in log.ready(wait=True):
        report.loss(step, loss, lr)
    log.sums[1:].zero_()
    test_loss, correct, train_sum = sums
    record = {
        "epoch": state.epoch,
        "step": state.step,
        "train_loss": train_sum / max(state.steps_since_eval, 1),
        "test_loss": test_loss / loader.n,
        "test_accuracy": correct / loader.n,
        "samples_per_s": state.samples_since_eval / max(now - t_eval, 1e-9),
        "wall_s": round(now - t_start, 3),
    }
    if record["test_accuracy"] > state.best_accuracy:
        state.best_accuracy, state.best_epoch = record["test_accuracy"], state.epoch
    state.steps_since_eval = state.samples_since_eval = 0
    report.evaluation(record)
    return now


def save(
    run_dir: RunDir,
    cfg: Config,
    model,
    optimizer,
    scheduler,
    scaler,
    state: Progress,
    log: LossLog,
    report: Report,
    loss_sums: list[list[float]],
) -> None:
    """Flush the logs, then commit a checkpoint of the state as it stands (`loss_sums`: one row per process)."""
    for step, loss, lr in log.ready(wait=True):
        report.loss(step, loss, lr)
    report.flush()
    progress = {**asdict(state), "loss_sums": loss_sums}
    metrics = report.records[-1] if report.records and report.records[-1]["step"] == state.step else {}
    payload = checkpoint.capture(model, optimizer, scheduler, scaler, progress, cfg.model_dump())
    checkpoint.commit(
        run_dir, payload, state.epoch, state.step, metrics, cfg.train.keep_last, cfg.train.keep_best, state.run_id
    )
    run_dir.check()  # the store gave up: stop here, the checkpoint just committed kept locally


def autocast(cfg: Config, device: torch.device):
    """A context factory for the configured precision (fp32: none). Without autocast's weight cache, which a
    captured CUDA graph cannot hold across replays."""
    precision = resolve_precision(cfg.train.precision, device)
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def use_channels_last(setting: str, model, device: torch.device, precision: str) -> bool:
    """channels_last for a model with 2-d convolutions: when asked, or (auto) where convolutions run faster in it:
    on a CPU (oneDNN's kernels; the tutorials' CIFAR-10 CNN trains about 15% faster on this project's CPU), and on a
    GPU computing in bf16 or fp16 (tensor cores)."""
    if setting == "off" or not any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
        return False
    return setting == "on" or device.type == "cpu" or (device.type == "cuda" and precision in ("bf16", "fp16"))


def make_optimizer(cfg: Config, model, fused: bool = False) -> torch.optim.Optimizer:
    """`fused`: one kernel per step, which also takes fp16's loss scale and overflow flag on the device, so
    GradScaler never waits for the GPU (with the other kernels it reads the flag on the host every step)."""
    o = cfg.optim
    how = {"fused": True} if fused else {}
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, **how)
    if o.nesterov and o.momentum == 0:
        raise ConfigError("optim.nesterov: needs optim.momentum > 0")
    return torch.optim.SGD(
        model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay, **how
    )


def prime_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero momentum buffers for fused SGD before its first step. Its first step otherwise makes them uninitialised
    and fills them in the kernel, which fp16's loss scaler skips on an overflow, leaving them uninitialised. With
    no dampening, a zero buffer's first update is the gradient itself, as SGD's first step is."""
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group["momentum"]:
            for p in group["params"]:
                optimizer.state[p].setdefault(
                    "momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format)
                )


def fuse_optimizer(device: torch.device, precision: str) -> bool:
    """Fused optimizer kernels where fp16's loss scaler would otherwise sync every step: CUDA with fp16."""
    return device.type == "cuda" and precision == "fp16"


def make_scheduler(cfg: Config, optimizer, total_steps: int):
    """A per-step schedule over the whole run, or None."""
    o = cfg.optim
    if o.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if o.schedule == "onecycle":
        cycle_momentum = o.name == "adamw" or o.momentum > 0  # never add momentum a recipe did not ask for
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=o.lr, total_steps=total_steps, cycle_momentum=cycle_momentum
        )
    return None


def make_loaders(
    cfg: Config, data: Dataset, device: torch.device, channels_last: bool = False
) -> tuple[BatchLoader, BatchLoader, str]:
    d = cfg.data
    storage = choose_storage(data.train.x.nbytes + data.test.x.nbytes, device, d.placement, d.device_share)
    mean = std = None
    if data.is_image and d.normalize:
        mean, std = channel_stats(data.train.x)
    batch = len(data.train) if d.batch_size == "full" else d.batch_size
    rank, world = distributed.shard()
    size = min(batch, len(data.train))
    smallest = len(data.train) % size if len(data.train) % size and not d.drop_last else size
    if smallest < world:
        raise ConfigError(
            f"data.batch_size: a training batch of {smallest} samples cannot be split over {world} processes; "
            "use a larger batch, fewer processes, or data.drop_last=true"
        )
    image_aug = {"crop_padding": d.random_crop_padding, "hflip": d.random_hflip} if data.is_image else {}
    train = BatchLoader(
        data.train,
        batch,
        device,
        storage,
        seed=cfg.seed,
        shuffle=d.shuffle,
        drop_last=d.drop_last,
        mean=mean,
        std=std,
        shard=(rank, world),
        channels_last=channels_last,
        **image_aug,
    )
    if len(train) == 0:
        raise ConfigError(f"data.drop_last: the training split ({len(data.train)}) is smaller than one batch")
    test = BatchLoader(
        data.test,
        d.eval_batch_size or batch,
        device,
        storage,
        mean=mean,
        std=std,
        shard=(rank, world),
        channels_last=channels_last,
    )
    where = "the device" if storage.type == device.type and device.type != "cpu" else "the host"
    return train, test, where


def open_run(run_dir: RunDir, resume: str, overwrite: bool, cfg: Config) -> tuple[dict, dict] | None:
    """Rank 0's part of setting up: the checkpoint to continue from, an overwritten run cleared, uploads started."""
    found = find_checkpoint(run_dir, resume, overwrite, cfg)
    if overwrite and found is None:
        clear_run(run_dir)
    run_dir.start_sync()
    return found


def find_checkpoint(run_dir: RunDir, resume: str, overwrite: bool, cfg: Config) -> tuple[dict, dict] | None:
    """The checkpoint to continue from, per --resume: auto (the run's newest), never, or a URL."""
    if resume == "never":
        if run_dir.has_run() and not overwrite:
            raise ConfigError(f"{run_dir.url} already holds a run: --resume auto continues it, --overwrite replaces it")
        return None
    found = checkpoint.load_latest(run_dir) if resume == "auto" else checkpoint.load_url(resume)
    if found is not None:
        check_compatible(found[0]["config"], cfg)
    return found


def check_compatible(saved: dict, cfg: Config) -> None:
    """Refuse to resume when a setting that changes what the checkpoint means differs."""
    old = flat_items(Config.model_validate(saved))
    new = flat_items(cfg)
    changed = sorted(k for k in new if k not in RESUME_SAFE and old.get(k) != new[k])
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in changed[:4])
        raise ConfigError(
            f"cannot resume: the checkpoint was trained with other settings ({detail}); "
            "use another --output, or --resume never --overwrite to start over"
        )


def clear_run(run_dir: RunDir) -> None:
    """--overwrite: remove an earlier run's checkpoints, logs and results from the folder."""
    for rel in run_dir.list("checkpoints"):
        run_dir.delete(f"checkpoints/{rel}")
    for rel in run_dir.list("tensorboard"):
        run_dir.delete(f"tensorboard/{rel}")
    for rel in ("metrics.jsonl", "model.pt", "curves.png", "config.yaml"):
        run_dir.delete(rel)


def state_dict_bytes(model) -> bytes:
    return checkpoint.to_bytes({k: v.detach().cpu() for k, v in model.state_dict().items()})
