"""The machine: which device to train on, seeding, and the `info` report of GPU, CUDA, cuDNN, memory and shm."""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from job.errors import ConfigError, one_line

GIB = 1024**3


def pick_device(name: str) -> torch.device:
    """`auto` takes CUDA, then Apple's MPS, then the CPU; an explicit device must exist. A CUDA device becomes
    the current one, which streams, events and graph captures use."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: expected auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {name}: CUDA is not available here (no GPU, or no driver); see `python -m job info`"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device {name}: expected auto, cpu, cuda, cuda:N or mps")
    return device


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / GIB:.0f} GiB)"
    if device.type == "cpu":
        n = torch.get_num_threads()
        return f"cpu ({n} thread{'s' if n != 1 else ''})"
    return str(device)


def cpus(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int:
    """CPUs this process may use: those it may run on (taskset, a cpuset), or fewer when a CPU quota of its cgroup
    or one above it allows less (docker --cpus, a Kubernetes CPU limit); os.cpu_count() counts the machine's."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity to ask (macOS)
        n = os.cpu_count() or 1
    return max(1, min([n, *(math.ceil(q) for q in cpu_quotas(Path(root), own))]))


CPU_INFO = Path("/proc/cpuinfo")  # Linux's description of the CPU: its name, and what it has that programs may use


def cpu_field(name: str, info: Path = CPU_INFO) -> str | None:
    """The first CPU's `name` line of /proc/cpuinfo (model name, flags), read in this process; None where there is no
    such file (not Linux) or line."""
    try:
        text = info.read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith(name)), None)
    return line.partition(":")[2].strip() if line is not None else None


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo's model name where there is one (platform.processor runs `uname -p`, a fork of
    the whole process, and says only the architecture on Linux)."""
    return cpu_field("model name") or platform.processor() or platform.machine()


def cpu_share(local_processes: int | None = None) -> int:
    """This process's share of the CPUs: cpus() over the group's processes on this machine (LOCAL_WORLD_SIZE, which
    torchrun and the job's launcher set)."""
    given = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = local_processes or (int(given) if given.isdigit() else 1)
    return max(1, cpus() // max(1, local))


def cpu_quotas(root: Path, own: str) -> list[float]:
    """The CPU quotas, in CPUs, of this process's cgroup and those above it: cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us over cpu.cfs_period_us. Inside a container the path it names may not be mounted (only the
    container's own cgroup is): the levels that are there are read."""
    try:
        lines = Path(own).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        if line.count(":") < 2:  # not hierarchy:controllers:path
            continue
        _, controllers, path = line.split(":", 2)
        if controllers and "cpu" not in controllers.split(","):
            continue
        base = root if not controllers else next((root / d for d in (controllers, "cpu") if (root / d).is_dir()), None)
        if base is None:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            found += cpu_quota(base.joinpath(*parts[:depth]), v2=not controllers)
    return found


def cpu_quota(folder: Path, v2: bool) -> list[float]:
    """One cgroup's CPU quota in CPUs: [] when it sets none or cannot be read."""
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((folder / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))
        return [int(quota) / int(period)] if quota not in ("max", "-1") and int(period) > 0 else []
    except (OSError, ValueError):
        return []


PR_SET_PDEATHSIG = 1  # prctl(2)'s option: the signal this process gets when the thread that made it ends


def die_with_parent() -> bool:
    """On Linux, have the kernel SIGKILL this process when its parent ends (whatever ends it: kill -9, the
    out-of-memory killer); whether it could. Elsewhere nothing, and False."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0


def end_with(pid: int) -> None:
    """End this process (SIGKILL) the moment process `pid` ends, whichever process started this one: a thread waits
    on the process's pidfd (Linux 5.3 and newer), else looks every second. For a forkserver's children, whose
    parent outlives the process that asked for them (it waits for its children)."""
    import select
    import signal
    import threading
    import time

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # ended already
            fd = None
        except (AttributeError, OSError):  # no pidfds here
            while pid_alive(pid):
                time.sleep(1.0)
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="job-end-with", daemon=True).start()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: an ended one its parent has not reaped yet (a zombie) has not."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's: it exists
        return True


def process_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of process `rank`'s own random stream in a group (dropout masks differ from process to process),
    from `step` on: independent of the run's seed's own stream and of the data order's."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0]) % 2**63


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # An operation with no deterministic kernel on this device (adaptive pooling's backward on CUDA) warns
        # rather than ending the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict:
    """This process's random streams (Python's, NumPy's, torch's, each GPU's), as plain values a checkpoint
    keeps."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """The streams rng_state() saved, back; a GPU's only where as many GPUs are seen as were saved."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def torchvision_problem() -> str:
    """'' when torchvision is installed and is the release made for this torch; else one line naming what to install.
    torchvision 0.N+15 is built for torch 2.N (0.19 for 2.4, 0.29 for 2.14); another release fails at import
    ("operator torchvision::nms does not exist") or in the middle of a run. Read from torchvision's version file where
    it has one, not imported: a run of the job's own models has no use for its hundred-odd model modules."""
    made = torch.__version__.split("+")[0]
    major, minor = (int(p) for p in made.split(".")[:2])
    wanted = f"0.{minor + 15}" if major == 2 else ""
    fix = f": pip install torchvision=={wanted}.* (the release for torch {made})" if wanted else ""
    if importlib.util.find_spec("torchvision") is None:
        return f"torchvision is not installed{fix}"
    if (found := written_torchvision_version()) is None:
        try:
            import torchvision
        except Exception as e:  # a build for another torch fails in its native operators' registration
            return f"torchvision does not load beside torch {made} ({one_line(e)}){fix}"
        found = getattr(torchvision, "__version__", "")
    found = str(found).split("+")[0]
    if wanted and not found.startswith(f"{wanted}."):
        return f"torchvision {found or '(no version)'} is not the release for torch {made}{fix}"
    return ""


def info() -> dict[str, Any]:
    """The tutorials' GPU check done properly: versions, devices with memory and capability, CPU and shm."""
    cuda = torch.cuda.is_available()
    devices = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_total_gib": round(total / GIB, 2),
                "memory_free_gib": round(free / GIB, 2),
                "multiprocessors": props.multi_processor_count,
            }
        )
    shm = None
    try:
        st = os.statvfs("/dev/shm")
        shm = round(st.f_blocks * st.f_frsize / GIB, 2)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version(),
        "torchvision_problem": torchvision_problem(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "device_count": len(devices),
        "current_device": torch.cuda.current_device() if cuda else None,
        "devices": devices,
        "mps_available": torch.backends.mps.is_available(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": cpus(),
        "torch_threads": torch.get_num_threads(),
        "shm_gib": shm,
        "default_device": str(pick_device("auto")),
        "platform": platform_report(),
    }


def platform_report() -> dict[str, Any]:
    """The platform and group the environment's variables describe (group/platforms.py), or why they cannot be read."""
    from job.group import platforms

    try:
        place = platforms.read()
    except ConfigError as e:  # what train would refuse, said here too
        return {"error": str(e)}
    return {**place.record(), "describe": place.describe() if place.name else ""}


def torchvision_version() -> str | None:
    """The installed torchvision's __version__ (0.29.1+cu130); None when it is not installed or does not load."""
    if (found := written_torchvision_version()) is not None:
        return found
    try:
        import torchvision
    except Exception:  # torchvision_problem() says why
        return None
    return getattr(torchvision, "__version__", None)


def written_torchvision_version() -> str | None:
    """torchvision's __version__ as the version.py of its releases states it, beside the package Python would import,
    read without importing it; None where there is no such file (not installed, or a build without one)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^__version__ = ['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def format_info(report: dict[str, Any]) -> str:
    usable = f" ({report['cpus_usable']} usable here)" if report["cpus_usable"] != report["cpu_count"] else ""
    lines = [
        f"python {report['python']}, torch {report['torch']}, built for CUDA {report['cuda_version'] or '-'}, "
        f"torchvision {report['torchvision'] or '-'}",
        f"CPU: {report['cpu_count']} cores{usable}, torch uses {report['torch_threads']} "
        f"thread{'s' if report['torch_threads'] != 1 else ''}; "
        f"/dev/shm {report['shm_gib'] if report['shm_gib'] is not None else '?'} GiB",
    ]
    if report["cuda_available"]:
        lines.append(
            f"CUDA available: {report['device_count']} device(s), cuDNN {report['cudnn_version']}, "
            f"current device {report['current_device']}"
        )
        for d in report["devices"]:
            lines.append(
                f"  cuda:{d['index']} {d['name']}  capability {d['capability']}  "
                f"{d['memory_total_gib']} GiB ({d['memory_free_gib']} free)  {d['multiprocessors']} SMs"
            )
    else:
        why = (
            "torch was built without CUDA"
            if report["cuda_version"] is None
            else "no GPU or no NVIDIA driver found (on a machine with a GPU: the driver is missing or not visible)"
        )
        lines.append(f"CUDA not available: {why}")
    if report["cuda_visible_devices"] is not None:
        lines.append(f"CUDA_VISIBLE_DEVICES={report['cuda_visible_devices']}")
    if report["mps_available"]:
        lines.append("Apple MPS available")
    if report["torchvision_problem"]:
        lines.append(f"warning: {report['torchvision_problem']}")
    lines.append(f"training would use: {report['default_device']}")
    platform = report.get("platform") or {}
    if platform.get("error"):
        lines.append(f"platform: error: {platform['error']}")
    elif platform.get("describe"):
        lines.append(f"platform: {platform['describe']}")
    return "\n".join(lines)
