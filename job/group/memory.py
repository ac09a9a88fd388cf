"""Out of memory: recognising it on any device, the one line that names it, and a cap on what a process may take
so that a batch that does not fit fails as an allocation error instead of waking the kernel's OOM killer."""

from __future__ import annotations

import contextlib
import resource
import subprocess
import time
from collections.abc import Iterator

import psutil
import torch

from job.errors import ConfigError
from job.group.env import GIB


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure on any device (CPU allocations fail as a RuntimeError with errno 12)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def out_of_memory_error(setting: str, device: torch.device) -> ConfigError:
    """The one line for an out-of-memory: `setting` names the batch size in use (key=value), or where it happened."""
    if "=" not in setting:
        return ConfigError(f"out of memory on {device} {setting}: the data set or the model does not fit here")
    return ConfigError(
        f"out of memory on {device} at {setting}: use a smaller batch; `python -m job "
        "find-batch-size` with the same --config and --set finds the largest training batch that fits"
    )


@contextlib.contextmanager
def memory_guard(setting: str, device: torch.device) -> Iterator[None]:
    """Turn an out-of-memory inside the block into the one line naming the batch size in use."""
    try:
        yield
    except Exception as e:
        if is_out_of_memory(e):
            raise out_of_memory_error(setting, device) from None
        raise


@contextlib.contextmanager
def memory_limit(device: torch.device, gib: float | None) -> Iterator[str]:
    """Cap what this process may allocate on the device while the block runs: `gib`, or (CPU, by default) 80% of
    what the host has free, so that a batch that does not fit fails as an allocation error rather than waking
    the kernel's out-of-memory killer. Yields a description of the cap; the previous limit is put back after."""
    if device.type == "cuda":
        if gib is None:
            yield "the whole GPU"
            return
        total = torch.cuda.get_device_properties(device).total_memory
        # (an older torch has no getter: 1.0, the default, is put back there)
        before = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), device)
        try:
            yield f"{gib:g} GiB of the GPU"
        finally:
            torch.cuda.set_per_process_memory_fraction(before, device)
        return
    if device.type != "cpu":
        yield f"all of {device}"
        return
    budget = gib * GIB if gib is not None else 0.8 * available_host_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = int(virtual_size() + budget)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield f"{budget / GIB:.2f} GiB of host memory" + (" (80% of what is free)" if gib is None else "")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def available_host_memory() -> float:
    """Bytes the host can give without swapping (Linux's MemAvailable; psutil reads it on macOS and Windows too)."""
    return float(psutil.virtual_memory().available)


def virtual_size() -> int:
    """This process's address space now: the cap is set this far above it."""
    return int(psutil.Process().memory_info().vms)


def peak_tree_rss(proc: subprocess.Popen, every_s: float = 0.02) -> int:
    """The largest sum of resident memory over a process and its descendants (a run and its decoding processes),
    sampled every `every_s` until the process ends: what the benchmark and the tests of streaming measure."""
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []  # it ended between the poll and the listing
        for p in tree:
            with contextlib.suppress(psutil.Error):  # it ended between the listing and the read
                total += p.memory_info().rss
        peak = max(peak, total)
        time.sleep(every_s)
    return peak
