import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_job

from job.errors import ConfigError
from job.group.env import GIB, cpu_quotas, cpu_share, cpus, format_info, info, pick_device

CUDA = torch.cuda.is_available()
MPS = torch.backends.mps.is_available()


def expected_auto() -> torch.device:
    """The rule, from what this machine has: CUDA (the current device), then MPS, then the CPU."""
    if CUDA:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("mps") if MPS else torch.device("cpu")


def refused(name: str, phrase: str) -> None:
    """pick_device(name) is a ConfigError: one line that names the --device value and says why."""
    with pytest.raises(ConfigError) as caught:
        pick_device(name)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--device {name}: ") and phrase in message, message


def test_pick_device_follows_what_this_machine_has():
    assert pick_device("auto") == expected_auto()
    assert pick_device("cpu") == torch.device("cpu")
    if CUDA:
        count = torch.cuda.device_count()
        assert pick_device("cuda") == torch.device("cuda", torch.cuda.current_device())
        assert pick_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
        assert torch.cuda.current_device() == count - 1  # an explicit device becomes the current one
        refused(f"cuda:{count}", f"only {count} CUDA device(s) here")
    else:
        for name in ("cuda", "cuda:0", "cuda:7"):
            refused(name, "CUDA is not available here")
    if MPS:
        assert pick_device("mps") == torch.device("mps")
    else:
        refused("mps", "MPS is not available here")
    for name in ("tpu", "gpu", "meta", "cuda:x"):  # not a device name, or one torch knows but training cannot use
        refused(name, "expected auto, cpu, cuda, cuda:N or mps")


def shm_gib() -> float | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return round(st.f_blocks * st.f_frsize / GIB, 2)


def test_info_reports_this_machine():
    report = info()
    assert report["python"] == platform.python_version()
    assert report["torch"] == torch.__version__
    assert report["cuda_version"] == torch.version.cuda
    assert report["cpu_count"] == os.cpu_count()
    assert report["torch_threads"] == torch.get_num_threads()
    assert report["shm_gib"] == shm_gib()
    assert report["cuda_available"] is CUDA and report["mps_available"] is MPS
    assert report["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert report["default_device"] == str(expected_auto())
    if CUDA:
        assert report["device_count"] == torch.cuda.device_count() == len(report["devices"])
        assert [d["name"] for d in report["devices"]] == [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
        assert report["cudnn_version"] == torch.backends.cudnn.version()
    else:
        assert report["devices"] == [] and report["device_count"] == 0
        assert report["current_device"] is None and report["cudnn_version"] is None

    text = format_info(report)
    assert f"torch {torch.__version__}" in text
    assert f"CPU: {os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads" in text
    assert f"/dev/shm {shm_gib() if shm_gib() is not None else '?'} GiB" in text
    if CUDA:
        assert f"CUDA available: {torch.cuda.device_count()} device(s)" in text
        assert all(f"cuda:{d['index']} {d['name']}" in text for d in report["devices"])
    else:
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU or no NVIDIA driver found"
        assert f"CUDA not available: {why}" in text and "cuda:0" not in text
    assert text.splitlines()[-1] == f"training would use: {expected_auto()}"


def steady(report: dict) -> dict:
    """The report less what may differ between two processes: free GPU memory, and torch's thread count (which a
    test in this process may have set)."""
    devices = [{k: v for k, v in d.items() if k != "memory_free_gib"} for d in report["devices"]]
    return {**{k: v for k, v in report.items() if k != "torch_threads"}, "devices": devices}


def test_info_command_plain_and_json_agree_with_this_machine():
    here = info()
    result = run_job("info", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert steady(data) == steady(here)
    plain = run_job("info", timeout=120)
    assert plain.returncode == 0, plain.stderr
    same = [line for line in format_info(data).splitlines() if not line.startswith("  cuda:")]
    assert [line for line in plain.stdout.strip().splitlines() if not line.startswith("  cuda:")] == same


def cgroup_tree(tmp_path, v2: bool, quotas: dict[str, str]) -> tuple[str, str]:
    """A cgroup mount in the kernel's own file format: this process in /job/run, quotas at the levels given."""
    root = tmp_path / "cgroup"
    mount = root if v2 else root / "cpu,cpuacct"
    for level, quota in quotas.items():
        folder = mount / level.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        if v2:
            (folder / "cpu.max").write_text(f"{quota} 100000\n")
        else:
            (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (folder / "cpu.cfs_period_us").write_text("100000\n")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/job/run\n" if v2 else "12:memory:/job/run\n4:cpu,cpuacct:/job/run\n1:name=systemd:/\n\n")
    return str(root), str(own)


@pytest.mark.parametrize("v2", [True, False])
def test_cpu_quotas_are_read_from_this_process_cgroup_and_those_above_it(tmp_path, v2):
    none = "max" if v2 else "-1"
    root, own = cgroup_tree(tmp_path, v2, {"/": none, "/job": "150000", "/job/run": none})
    assert cpu_quotas(Path(root), own) == [1.5]  # docker --cpus 1.5 on the level above
    assert cpus(root, own) == min(2, len(os.sched_getaffinity(0)))  # 1.5 CPUs: a second one part of the time
    root, own = cgroup_tree(tmp_path / "b", v2, {"/": "50000", "/job/run": none})
    assert cpus(root, own) == 1  # half a CPU: still one to run on
    root, own = cgroup_tree(tmp_path / "c", v2, {"/": none})
    assert cpus(root, own) == len(os.sched_getaffinity(0))  # no quota: the CPUs it may run on
    assert cpus(str(tmp_path / "nothing"), str(tmp_path / "nothing")) == len(os.sched_getaffinity(0))


def test_usable_cpus_follow_the_affinity_and_the_group_share():
    """taskset (or a cpuset) limits a process to fewer CPUs than the machine has: the decoding workers count those,
    split between the group's processes on the machine (os.cpu_count() counted the machine's for every process)."""
    code = (
        "from job.group.env import cpus; from job.data.decode import auto_workers; print(cpus(), auto_workers('auto'))"
    )
    one = sorted(os.sched_getaffinity(0))[:1]
    done = subprocess.run(  # as `taskset -c 0` starts it
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, one)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1"]
    assert cpu_share(2) == max(1, cpus() // 2) and cpu_share(10_000) == 1
    env = {**os.environ, "LOCAL_WORLD_SIZE": "10000"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.split() == [str(cpus()), "1"], done.stderr[-2000:]


BROKEN_TORCHVISION = 'raise RuntimeError("operator torchvision::nms does not exist")\n'  # what a mismatched build says


@pytest.mark.parametrize("stub", [BROKEN_TORCHVISION, '__version__ = "0.20.0+cu124"\n'])
def test_a_torchvision_that_does_not_match_torch_is_named_by_info_and_before_a_run_starts(tmp_path, stub):
    """A torchvision built for another torch (here a package in its place on PYTHONPATH: one that fails at import
    as a mismatched build does, and one of another release): `info` names it and what to install, and `train` stops
    in one line (exit 2) before the run folder is made."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(stub)
    env = {"PYTHONPATH": str(tmp_path)}
    minor = int(torch.__version__.split(".")[1])
    shown = run_job("info", env=env)
    assert shown.returncode == 0 and f"torchvision==0.{minor + 15}." in shown.stdout, shown.stdout + shown.stderr
    out = tmp_path / "run"
    ran = run_job("train", "--output", str(out), env=env)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert f"torchvision==0.{minor + 15}." in ran.stderr.strip().splitlines()[-1] and not out.exists()


def test_the_torchvision_beside_this_torch_matches_it():
    from job.group.env import torchvision_problem

    assert torchvision_problem() == ""
    assert info()["torchvision"] == __import__("torchvision").__version__


def test_a_process_that_has_ended_is_not_alive_while_its_parent_has_not_reaped_it():
    """A worker that watches its launcher without a pidfd looks at it once a second (env.end_with): a killed launcher
    whose own parent has not yet reaped it (a zombie) has ended, and the worker must end with it."""
    import time

    from job.group.env import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # ended, not reaped
        time.sleep(0.01)
    try:
        assert not pid_alive(child.pid)
        assert pid_alive(os.getpid())
    finally:
        child.wait()
    assert not pid_alive(child.pid)


def test_a_runs_device_record_names_the_cpu_without_starting_a_process():
    """run.json's CPU is named from /proc/cpuinfo where there is one, in this process: `uname -p` (Python's
    platform.processor) forks the run in mid-setup, a copy as large as the run in the process tree's memory."""
    code = (
        "import subprocess, torch\n"
        "def refuse(*a, **k): raise AssertionError(f'a process started: {a[0] if a else k}')\n"
        "subprocess.Popen.__init__ = refuse\n"
        "from job.run.attempts import devices\n"
        "print(devices(torch.device('cpu'))[0]['name'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]
    names = [
        line.partition(":")[2].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    assert done.stdout.strip() == (names[0] if names else platform.machine())
