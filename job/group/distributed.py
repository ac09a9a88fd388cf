"""Data-parallel training under torchrun: joining the process group, what only rank 0 does, and what the processes
exchange (loss sums, evaluation sums, the stop flag, rank 0's checkpoint and its errors).

`torchrun --nproc_per_node N -m job train ...` starts N copies of the job. Each joins the group (nccl on GPUs, gloo
on CPUs), trains a DistributedDataParallel copy of the model on its contiguous slice of every global batch, and
evaluates its slice of the test split. Rank 0 alone reads and writes the run folder; the others wait for its
commits and learn its errors, so every process ends with the same exit code. Without torchrun nothing here does
anything. Everything lives in torch.distributed's default group, so the loop needs no handle to pass around.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from job import errors
from job.errors import ConfigError, Interrupted, JobError, one_line
from job.group.env import pick_device, process_seed, seed_everything, set_rng_state
from job.group.stop import StopRequest

T = TypeVar("T")

# How long a process waits for the others at a collective: long enough for rank 0 to read a checkpoint from a
# bucket or commit one, short enough that a process whose peer vanished without a word does not hang for good.
TIMEOUT = timedelta(minutes=10)

# A second group over gloo for host-side exchanges (stop flag, rank 0's outcome) when the main group is nccl:
# reading them never waits for the GPU. None when the main group is gloo already.
_control: Any = None
_owned = True  # this process made the default group (not a platform before it), and so ends it


def launched() -> bool:
    """Started by torchrun (which sets these for each worker; Vertex AI alone sets RANK and WORLD_SIZE per machine)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def is_writer() -> bool:
    """Whether this process writes the run's files (rank 0, or the only process)."""
    return rank() == 0


def start(device_name: str, stop: StopRequest) -> None:
    """Under torchrun: take this worker's device (cuda:LOCAL_RANK) and join the group; otherwise nothing."""
    global _control, _owned
    size = os.environ.get("WORLD_SIZE", "1").strip()
    if not launched() and size.isdigit() and int(size) > 1:
        raise ConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but this process was not started as a worker of a group (Vertex AI "
            "sets it to the number of machines): run `python -m job train`, which starts the group itself, or torchrun "
            "(docs/distributed.md); otherwise every machine would train alone"
        )
    if not launched():
        return
    joined = active()  # a platform made the group in this process already (Ray Train): join it, make none
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device_name}: in a group each process takes cuda:LOCAL_RANK; use cuda or cpu")
    if device_name != "cpu" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if joined and count == 1:  # the platform gave this process its own GPU (Ray: CUDA_VISIBLE_DEVICES)
            local_rank = 0
        if local_rank >= count:
            raise ConfigError(
                f"more processes on this machine than it has GPUs ({count}): use --nproc-per-node {count} (or auto), "
                "or --device cpu"
            )
        torch.cuda.set_device(local_rank)  # pick_device then gives cuda:LOCAL_RANK
    device = pick_device(device_name)
    if device.type == "mps":
        raise ConfigError("--device mps: a group of processes needs cuda or cpu (no collective backend for MPS)")
    try:
        if not joined:
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                timeout=TIMEOUT,
                device_id=device if device.type == "cuda" else None,
            )
        if dist.get_backend() != "gloo":
            _control = dist.new_group(backend="gloo", timeout=TIMEOUT)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"cannot join the process group: {one_line(e)}") from None
    _owned = not joined
    stop.share(combined_signal)


def finish(together: bool = False) -> None:
    """Leave the group (at the end of a run, whatever its outcome). `together` (a run that ended well, or a stop the
    processes agreed on): wait for every process first, since one that tears its group down while a peer is still
    finishing (rank 0 commits, uploads and writes the results last) can make the peer's transport threads abort it
    at exit ("terminate called without an active exception", exit -6 in place of 75). Not after a failure: a peer
    may be gone."""
    global _control, _owned
    if active():
        if together:
            with contextlib.suppress(Exception):  # a peer that is gone already: nothing to wait for
                dist.monitored_barrier(group=_control, timeout=timedelta(seconds=120))
        if _owned:
            dist.destroy_process_group()
        elif _control is not None:  # the platform's group stays, for the platform (Ray Train) to end
            dist.destroy_process_group(_control)
    _control, _owned = None, True


def seed_own(seed: int, deterministic: bool, step: int = 0, saved: list | None = None) -> None:
    """Each process's own random stream from here on (dropout masks differ from process to process): its state in
    `saved` (a checkpoint's, by rank) when a group of this size saved it; else, for ranks but 0, a stream seeded from
    (seed, rank, step), not one that process 0 draws from already. Rank 0, or a process alone, keeps its stream."""
    if saved and len(saved) == world():
        set_rng_state(saved[rank()])
    elif rank():
        seed_everything(process_seed(seed, rank(), step), deterministic)


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model as the training step should call it: a DistributedDataParallel copy in a group, else itself.

    DDP averages the gradients over the processes, which is why each process's loss carries its share of the
    global batch (BatchLoader.loss_weight). On GPUs BatchNorm becomes SyncBatchNorm, so its statistics are those of
    the global batch as in one process; on CPUs (no SyncBatchNorm there) each process normalises its own slice.
    """
    if not active():
        return model
    # gradient_as_bucket_view: each gradient is a view into DDP's all-reduce bucket, not a copy of it (one
    # model's worth of memory less, and one copy less per step).
    if device.type == "cuda":
        model = sync_batchnorm(model)
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index], gradient_as_bucket_view=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, rank_ordered_mean)
    return ddp


def same_buffers(module: torch.nn.Module) -> None:
    """Every process's buffers of `module` (batch-norm statistics) made rank 0's."""
    if active() and world() > 1:
        for b in module.buffers():
            peer_call(dist.broadcast, b, src=0)


def rank_ordered_mean(_, bucket):  # no return annotation: DDP checks it, and a string (postponed) fails
    """A DDP communication hook: a gradient bucket's mean over the processes, summed in rank order. gloo's ring
    all-reduce sums each element in an order set by its offset in the bucket, and DDP lays its buckets out anew
    after its first step (in the order gradients became ready); a resumed run's first step would then round
    differently from the same step of a run that never stopped, with three processes or more. Gathering every
    process's bucket and adding them in rank order gives the same bits whatever the layout; it moves world times
    the bytes of an all-reduce, which CPU groups (the only ones that take it) can afford."""
    t = bucket.buffer()
    parts = [torch.empty_like(t) for _ in range(world())]
    gathered = dist.all_gather(parts, t, async_op=True).get_future()

    def add(_) -> torch.Tensor:
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total.div_(world())

    return gathered.then(add)


def sync_batchnorm(model: torch.nn.Module) -> torch.nn.Module:
    """BatchNorm layers made SyncBatchNorm (the same parameters and statistics), each keeping the forward pre-hooks it
    had: PyTorch's conversion builds new modules without them, and a frozen backbone's batch norms are held in
    evaluation by one (model.freeze_backbone), which would otherwise start updating their statistics."""
    norm = torch.nn.modules.batchnorm._BatchNorm
    hooks = {name: list(m._forward_pre_hooks.values()) for name, m in model.named_modules() if isinstance(m, norm)}
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, m in model.named_modules():
        for hook in hooks.get(name, []) if isinstance(m, torch.nn.SyncBatchNorm) else []:
            m.register_forward_pre_hook(hook)
    return model


def mean_(t: torch.Tensor) -> torch.Tensor:
    """Replace a tensor by its mean over the processes, in place. With nccl this is queued on the device like a
    kernel (no host sync); with gloo on the CPU it waits for the others, as DDP's own reductions do."""
    if active() and world() > 1:
        peer_call(dist.all_reduce, t)
        t.div_(world())
    return t


def gather(t: torch.Tensor) -> torch.Tensor:
    """Every process's copy of `t`, stacked in rank order (alone: `t` with a leading dimension of one)."""
    if not active() or world() == 1:
        return t.unsqueeze(0)
    rows = [torch.empty_like(t) for _ in range(world())]
    peer_call(dist.all_gather, rows, t)  # the list form: gloo and nccl, and every torch this job supports
    return torch.stack(rows)


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (plain values: lists, dicts, numbers), in rank order."""
    if not active() or world() == 1:
        return [obj]
    rows: list[Any] = [None] * world()
    peer_call(dist.all_gather_object, rows, obj)
    return rows


def own(saved: list) -> torch.Tensor:
    """This process's loss sums from a checkpoint: its row of a gather() saved by a group of the same size; the rows'
    mean for a group of another size, where no process has a row of its own (what the group's reductions would make
    of them); a flat list (a checkpoint from before sums were kept per process) as it is."""
    sums = torch.tensor(saved)
    if sums.dim() == 1:
        return sums
    return sums[rank()] if sums.shape[0] == world() else sums.mean(0)


def totals(sums: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Evaluation sums added up over the processes, followed by the loss sums averaged over them: one reduction."""
    both = torch.cat([sums, means / world()])
    if active() and world() > 1:
        peer_call(dist.all_reduce, both)
    return both


def combined_signal(received: int) -> Callable[[], int]:
    """Start finding the highest reason any process has to stop (0: none; job/group/stop.py's precedence), a gloo
    reduction of one integer on the host; returns what waits for it. Every process starts these in the same order, so
    they pair up."""
    flag = torch.tensor([received], dtype=torch.int64)
    work = peer_call(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=_control, async_op=True)

    def result() -> int:
        peer_call(work.wait)
        return int(flag[0])

    return result


def on_writer(work: Callable[[], T], share: Callable[[T], tuple[dict, bytes]] | None = None) -> T | None:
    """Rank 0 does `work`; the others wait until it is done. A fault on rank 0 is raised on every process, as the
    same error (so all exit with the same code). `share` turns rank 0's result into a header and bytes that the
    others receive as (header, bytes); without it they get None. Alone, this is `work()`."""
    if not active() or world() == 1:
        return work()
    if not is_writer():
        got = writer_done()
        return got if share is not None else None
    with faults_to_group():
        result = work()
        header, blob = share(result) if share is not None else ({}, b"")
    send(header, blob)
    return result


def shared_line(decide: Callable[[], str]) -> str:
    """Rank 0's answer (a line; empty: none), which every process of a group takes."""
    said = on_writer(decide, lambda line: ({"line": line}, b""))
    return said[0]["line"] if isinstance(said, tuple) else said


@contextlib.contextmanager
def writer_first() -> Iterator[bool]:
    """`with writer_first() as writer:` rank 0 does the block's work (writer is True) while the others wait until it
    is done (False), as on_writer does for work written in place: a fault on rank 0 is raised on every process, as
    the same error. Alone, writer is True."""
    if not active() or world() == 1:
        yield True
    elif not is_writer():
        writer_done()
        yield False
    else:
        with faults_to_group():
            yield True
        send({}, b"")


def writer_done() -> tuple[dict, bytes]:
    """What rank 0 sent when its work ended: its header and bytes, or its fault, raised here."""
    header, blob = receive()
    if "error" in header:
        raise rebuild(header)
    return header, blob


@contextlib.contextmanager
def faults_to_group() -> Iterator[None]:
    """Rank 0's fault in the block sent to the others (who wait in writer_done) before it is raised here."""
    try:
        yield
    except JobError as e:
        send({"error": type(e).__name__, "message": str(e)}, b"")
        raise
    except BaseException as e:
        send({"error": "", "message": f"{type(e).__name__}: {one_line(e)}"}, b"")
        raise


def gather_to_writer(obj: T) -> list[T] | None:
    """Every process's `obj` on rank 0, by rank (None on the others; [obj] alone), over the host group: what a
    report needs of each process's part of a split (a few numbers a sample)."""
    if not active() or world() == 1:
        return [obj]
    out: list | None = [None] * world() if is_writer() else None
    peer_call(dist.gather_object, obj, out, dst=0, group=_control)
    return out


def send(header: dict, blob: bytes) -> None:
    data = json.dumps(header).encode()
    sizes = torch.tensor([len(data), len(blob)], dtype=torch.int64)
    peer_call(dist.broadcast, sizes, src=0, group=_control)
    peer_call(dist.broadcast, torch.frombuffer(bytearray(data + blob), dtype=torch.uint8), src=0, group=_control)


def receive() -> tuple[dict, bytes]:
    sizes = torch.zeros(2, dtype=torch.int64)
    peer_call(dist.broadcast, sizes, src=0, group=_control)
    n_header, n_blob = sizes.tolist()
    buf = torch.empty(n_header + n_blob, dtype=torch.uint8)
    peer_call(dist.broadcast, buf, src=0, group=_control)
    data = buf.numpy().tobytes()
    return json.loads(data[:n_header]), data[n_header:]


def rebuild(header: dict) -> BaseException:
    """Rank 0's error as this process raises it: the same class and line for the user's faults."""
    cls = getattr(errors, header["error"], None) if header["error"] else None
    if isinstance(cls, type) and issubclass(cls, JobError):
        return cls(header["message"])
    return Interrupted(
        f"rank 0 failed ({header['message']}); the last committed checkpoint stands: "
        "run the same command again to continue once that is fixed"
    )


def peer_call(fn: Callable[..., T], *args, **kwargs) -> T:
    """A collective whose failure means another process is gone: one line and exit 75 here, no traceback (the
    process that failed reports its own fault; torchrun names it). Returns what `fn` does (an async op's work)."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # DistBackendError and gloo's connection errors are RuntimeErrors
        raise Interrupted(
            f"rank {rank()}: another process of the run is gone ({one_line(e)[:160]}); the last committed "
            "checkpoint stands: run the same command again to continue"
        ) from None


# What gloo and NCCL say when another process of the group went away in the middle of a collective.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "communicator was aborted")


def peer_lost(e: BaseException) -> JobError | None:
    """A collective that failed because another process of the group died: one line saying so (exit 1), in place of
    a traceback that points at this process's code; None for any other error."""
    said = next((p for p in PEER_LOST if p in str(e)), None) if isinstance(e, RuntimeError) and active() else None
    return JobError(f"another process of the group went away ({said}); this one stopped too") if said else None
