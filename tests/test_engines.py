"""The real engines: a single-host Slurm of the tests' own (tests/slurm.py: munged, slurmctld and slurmd started and
ended by pid) runs the job as `srun -n 2` and as a requeueable batch job sent Slurm's warning signal; a local Ray
cluster (ray.init(num_cpus=2) in a process of its own, shut down at its end) runs it in a TorchTrainer's 2 workers.
Each is one group of 2 equal to the job's own `--nproc-per-node 2` run, weights and metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm
import torch
from conftest import ROOT, assert_same_run, job_env, metrics, run_job, sets

IRIS = ["--device", "cpu", *sets("train.epochs=3000", "data.val_split=0.2", "train.checkpoint_every_epochs=1000")]
IRIS += sets("train.eval_every_epochs=1000")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    done = run_job("train", *IRIS, "--nproc-per-node", "2", "--output", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if why := slurm.available():
        pytest.skip(why)
    with slurm.cluster(tmp_path_factory.mktemp("slurm")) as s:
        yield s


def attempts(out: Path) -> list[dict]:
    return json.loads((out / "run.json").read_text())["attempts"]


def job_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "job", "train", *IRIS, "--output", str(out)]


def test_srun_n_2_is_one_group_of_two_equal_to_nproc_per_node_2(cluster, reference, tmp_path):
    out = tmp_path / "run"
    done = cluster.run("srun", "-n", "2", *job_command(out), env={**cluster.env, **job_env()}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_run(str(reference), str(out))
    (attempt,) = attempts(out)
    assert attempt["world_size"] == 2 and attempt["platform"]["name"].startswith("Slurm job ")
    assert attempt["platform"]["group"] == {"nnodes": 1, "node_rank": 0, "rank": 0, "world_size": 2}
    assert "Slurm job" in done.stderr and ": process 0 of 2 (meeting at " in done.stderr


def docs_block(language: str, needle: str) -> str:
    """The fenced code block of docs/distributed.md in `language` that holds `needle`."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    (block,) = [b for b in re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M) if needle in b]
    return block


def test_the_docs_sbatch_script_commits_on_slurms_warning_requeues_itself_and_resumes_exactly(
    cluster, reference, tmp_path
):
    """docs/distributed.md's batch script, submitted as it is (the tests' python, and the reference's settings after
    its own): USR1 to every task (`#SBATCH --signal=USR1@90` sends it so) stops the group, which commits and exits 75;
    rank 0 asks Slurm to requeue the job (`scontrol requeue`; the test never does), and the requeued job continues."""
    script = docs_block("bash", "#SBATCH")
    line = next(x for x in script.splitlines() if x.startswith("srun python -m job train"))
    extra = " ".join(IRIS[2:])  # the reference's settings but --device cpu, which the script has
    script = script.replace(line, line.replace("srun python ", f"srun {sys.executable} ") + " " + extra)
    (tmp_path / "train.sbatch").write_text(script)
    out = tmp_path / "runs" / "iris-slurm"
    env = {**cluster.env, **job_env()}
    job_id = cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", str(tmp_path / "train.sbatch"), env=env)
    job_id = job_id.stdout.strip()
    assert job_id.isdigit(), job_id
    log = tmp_path / f"train-{job_id}.log"
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        state = cluster.job(job_id).get("JobState")
        assert state in ("PENDING", "CONFIGURING", "RUNNING", None), f"{state}: {tail(log)}"
        assert time.time() < deadline, "no first evaluation within 300 s"
        time.sleep(0.1)
    assert cluster.run("scancel", "--signal=USR1", job_id).returncode == 0
    deadline = time.time() + 300
    while (fields := cluster.job(job_id)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.time() < deadline, f"the job did not end: {fields.get('JobState')}"
        time.sleep(0.5)
    said = tail(log, 5000)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, (fields, said)
    # said before Slurm is asked: the requeue can end the job's processes before the last line is written
    assert f"asking Slurm to requeue job {job_id}" in said and "SIGUSR1: stopping" in said
    assert [(a["exit_code"], a["world_size"]) for a in attempts(out)] == [(75, 2), (0, 2)]
    assert attempts(out)[-1]["platform"]["variables"]["SLURM_RESTART_COUNT"] == "1"
    assert_same_run(str(reference), str(out))


def tail(path: Path, n: int = 2000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log yet)"


RAY_DRIVER = """
import json, os, sys
import ray
from ray.train import RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer

def worker(config):
    from job.cli import app
    code = app(["train", *config["args"]], standalone_mode=False)
    assert code in (None, 0), code

class Reports(UserCallback):  # run in Ray's controller, a process of its own: the file named here
    def __init__(self, path):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as f:
            f.write(json.dumps({"metrics": metrics[0], "checkpoint": checkpoint and checkpoint.path}) + "\\n")

ray.init(address="local", num_cpus=2, include_dashboard=False)
try:
    trainer = TorchTrainer(worker, train_loop_config={"args": sys.argv[3:]},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name="job", storage_path=sys.argv[2], callbacks=[Reports(sys.argv[1])]))
    result = trainer.fit()
    print("RESULT", result.error is None, result.checkpoint.path if result.checkpoint else None)
finally:
    ray.shutdown()
"""


def test_a_ray_torchtrainer_runs_the_job_in_rays_group_and_gets_its_reports(reference, tmp_path):
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (requirements-test.txt has it)")
    out, reports, storage = tmp_path / "run", tmp_path / "reports.jsonl", tmp_path / "ray"
    env = {k: v for k, v in job_env().items() if not k.startswith("RAY_")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = [*IRIS, "--output", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", RAY_DRIVER, str(reports), str(storage), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "RESULT True" in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
    assert_same_run(str(reference), str(out))
    (attempt,) = attempts(out)
    assert attempt["platform"]["name"] == "Ray Train" and attempt["world_size"] == 2
    got = [json.loads(line) for line in reports.read_text().splitlines()]
    evaluations = [m for m in metrics(str(out)) if "train_loss" in m]
    assert [r["metrics"]["step"] for r in got] == [m["step"] for m in evaluations]
    assert [r["metrics"]["val_accuracy"] for r in got] == [m["val_accuracy"] for m in evaluations]
    assert all(r["checkpoint"] for r in got)  # a checkpoint is committed at every evaluation here
    kept = Path(done.stdout.split("RESULT True ")[1].split()[0])
    model = torch.load(kept / "model.pt", weights_only=True)  # the weights at the last commit: training's end
    step = evaluations[-1]["step"]
    last = torch.load(out / "checkpoints" / f"e{step:05d}-s{step:010d}.pt", weights_only=True)["model"]
    assert model.keys() == last.keys() and all(torch.equal(model[k], last[k]) for k in model)
    assert json.loads((kept / "checkpoint.json").read_text())["step"] == evaluations[-1]["step"]


def test_the_docs_ray_snippet_runs_the_job_in_two_workers(tmp_path):
    """docs/distributed.md's TorchTrainer as it is, in a local Ray cluster of 2 CPUs (shorter: 2000 epochs), its
    paths made this test's."""
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (requirements-test.txt has it)")
    snippet = docs_block("python", "TorchTrainer").replace("/shared/", f"{tmp_path}/")
    snippet = snippet.replace('"--device", "cpu",', '"--device", "cpu", "--set", "train.epochs=2000",')
    assert "train.epochs=2000" in snippet
    program = f"import ray\nray.init(address='local', num_cpus=2, include_dashboard=False)\n{snippet}\nray.shutdown()\n"
    env = {k: v for k, v in job_env().items() if not k.startswith("RAY_")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "runs" / "iris-ray"
    (attempt,) = attempts(out)
    assert attempt["platform"]["name"] == "Ray Train" and attempt["world_size"] == 2 and attempt["exit_code"] == 0
    folder = Path(done.stdout.strip().splitlines()[-1])
    last = [m for m in metrics(str(out)) if "train_loss" in m][-1]
    assert f"'test_accuracy': {last['test_accuracy']}" in done.stdout and last["step"] == 2000
    assert (folder / "model.pt").exists() and json.loads((folder / "checkpoint.json").read_text())["step"] == 2000


def test_one_task_per_machine_starts_the_machines_processes_itself(cluster, reference, tmp_path):
    out = tmp_path / "run"
    command = [*job_command(out), "--nproc-per-node", "2"]
    done = cluster.run("srun", "-n", "1", *command, env={**cluster.env, **job_env()}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "launching 2 processes" in done.stderr
    (attempt,) = attempts(out)
    assert attempt["world_size"] == 2 and attempt["platform"]["name"].startswith("Slurm job ")
    assert_same_run(str(reference), str(out))


def test_scancel_commits_and_stays_a_cancel_and_the_same_command_continues(cluster, reference, tmp_path):
    """SIGTERM from scancel (as a preemption sends it): the group commits within the grace period and exits 75, and
    the job is not requeued; srun again continues the run to the reference's end."""
    out, log = tmp_path / "run", tmp_path / "job.log"
    script = tmp_path / "train.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output={log}\nsrun {' '.join(job_command(out))}\n")
    env = {**cluster.env, **job_env()}
    job_id = cluster.run("sbatch", "--parsable", "--requeue", str(script), env=env).stdout.strip()
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        assert time.time() < deadline, f"no first evaluation within 300 s: {tail(log)}"
        time.sleep(0.1)
    assert cluster.run("scancel", job_id).returncode == 0
    while (fields := cluster.job(job_id)).get("JobState") not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.time() < deadline + 120, fields.get("JobState")
        time.sleep(0.5)
    assert fields["JobState"] == "CANCELLED" and fields.get("Restarts") == "0", fields
    assert [a["exit_code"] for a in attempts(out)] == [75]
    assert "requeue" not in tail(log, 5000)
    done = cluster.run("srun", "-n", "2", *job_command(out), env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [a["exit_code"] for a in attempts(out)] == [75, 0]
    assert_same_run(str(reference), str(out))
