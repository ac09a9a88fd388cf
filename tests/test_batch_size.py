"""find-batch-size: the largest training batch that fits, found by doubling then bisecting against a real memory
limit; and an out-of-memory while training, which names the batch size and the command that finds one that fits."""

import json
import subprocess
import sys

from conftest import ROOT, job_env, run_job, sets


def test_find_batch_size_is_the_training_split_when_memory_is_plenty():
    r = run_job("find-batch-size", "--config", "iris", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["batch_size"] == 120 and result["limited_by"] == "the training split"
    assert [t["batch_size"] for t in result["trials"]] == [1, 2, 4, 8, 16, 32, 64, 120]


def test_find_batch_size_doubles_then_bisects_against_a_real_memory_limit():
    # A 4-2^20-3 MLP holds ~20 MB of activations and gradients per sample: 0.6 GiB fits a few dozen.
    r = run_job(
        "find-batch-size", "--config", "iris", "--device", "cpu", "--memory-gib", "0.6", "--json",
        *sets("model.hidden=[1048576]"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    found, trials = result["batch_size"], result["trials"]
    assert result["limited_by"] == "memory" and 2 <= found < 120
    assert any(t["batch_size"] == found and t["fits"] for t in trials)
    failed = [t["batch_size"] for t in trials if not t["fits"]]
    assert failed and min(failed) > found and min(failed) - found <= max(1, found // 32)
    sizes = [t["batch_size"] for t in trials]
    assert sizes[:3] == [1, 2, 4]  # doubling first


def test_out_of_memory_while_training_is_one_line_naming_the_batch_size(tmp_path):
    # A real allocation failure: the address space is capped 1 GiB above what the process has mapped.
    code = (
        "import resource, sys; from job.group.memory import virtual_size; "
        "resource.setrlimit(resource.RLIMIT_AS, (virtual_size() + 2**30, resource.RLIM_INFINITY)); "
        "from job.cli import main; sys.argv[0] = 'job'; main()"
    )
    out = tmp_path / "run"
    args = ["train", "--config", "iris", "--device", "cpu", "--output", str(out)]
    args += sets("model.hidden=[4194304]", "train.epochs=3")
    r = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=job_env(), cwd=ROOT, timeout=300
    )
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory on cpu at data.batch_size=full")
    assert "find-batch-size" in last and "Traceback" not in r.stderr
