"""Never lose work: real processes killed (SIGKILL) or stopped (SIGTERM) at random moments, then resumed with the
same command; the result must equal a run that never stopped, bit for bit on the CPU."""

import contextlib
import json
import math
import random
import signal
import time

import fsspec
import pytest
import torch
from conftest import assert_same_run, invoke, pointer, run_job, scalars, sets, start_job

from job.storage.run_folder import RunDir


@pytest.fixture(params=["local", "gcs"])
def output_url(request, tmp_path):
    """Where runs are written: a local folder, or a bucket on the GCS emulator (staged, uploaded in the background)."""
    if request.param == "gcs":
        bucket = request.getfixturevalue("bucket")
        return lambda name: bucket.url(name)
    return lambda name: str(tmp_path / name)


def exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return fs.exists(path)


def listdir(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]


def committed_step(url: str) -> int:
    """The step of the run's newest commit, -1 before the first. A remote run commits to its staging folder first
    (the store gets it from the uploader, or from the next attempt), so the newer of the two counts."""
    steps = [-1]
    fsspec.core.url_to_fs(url)[0].invalidate_cache()
    with contextlib.suppress(FileNotFoundError, ValueError), fsspec.open(f"{url}/checkpoints/latest.json") as f:
        steps.append(json.load(f)["step"])
    staged = RunDir(url).local / "checkpoints/latest.json"
    if "://" in url:
        with contextlib.suppress(FileNotFoundError, ValueError):
            steps.append(json.loads(staged.read_text())["step"])
    return max(steps)


# A run that no machine finishes while a test interrupts it: the interrupted run is set to train this long, and the
# attempt that completes it sets train.epochs (which a resumed run may change) to the length of the comparison run,
# chosen once the interruptions are over so that it ends after the last commit. How fast the machine is then
# decides how far the run got, never whether the interruptions landed.
FOREVER = "train.epochs=100000000"


def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(output_url):
    args = [
        "--device",
        "cpu",
        *sets("train.checkpoint_every_epochs=200", "train.eval_every_epochs=500", "train.keep_last=2"),
    ]
    out = output_url("killed")
    rng = random.Random(1234)
    resumed_from, last_step = set(), -1
    for attempt in range(7):
        proc = start_job("train", *args, "--set", FOREVER, "--output", out)
        if attempt % 3 == 0:  # somewhere in start-up, data loading or the first steps
            time.sleep(rng.uniform(0.2, 3.0))
        else:  # once the run has committed something new, at a random moment after: mid-step or mid-commit
            deadline = time.time() + 300
            while committed_step(out) <= last_step and proc.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            assert committed_step(out) > last_step, "no new commit within 300 s"
            time.sleep(rng.uniform(0.0, 0.4))
        assert proc.poll() is None, "the run ended by itself"
        proc.kill()
        _, err = proc.communicate()
        resumed_from |= {line for line in err.splitlines() if line.startswith("resuming")}
        last_step = committed_step(out)
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert len(resumed_from) >= 2, resumed_from
    end = f"train.epochs={last_step + 600}"  # Iris is one full batch: epochs and steps count alike
    final = run_job("train", *args, "--set", end, "--output", out)
    assert final.returncode == 0, final.stderr[-2000:]
    reference = run_job("train", *args, "--set", end, "--output", output_url("reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert_same_run(output_url("reference"), out)
    leftovers = [n for n in listdir(f"{out}/checkpoints") if n.startswith(".")]
    assert not leftovers


def test_sigterm_mid_epoch_commits_and_resumes_exactly(output_url):
    """An outside SIGTERM at a moment after the first commit; batches of 4 make 30 steps an epoch, so it lands
    mid-epoch unless it comes between two (then the test tries another moment). tests/test_stop.py stops at a
    chosen step instead."""
    args = [
        "--device",
        "cpu",
        *sets(
            "data.batch_size=4",
            "train.eval_every_epochs=50",
            "train.checkpoint_every_epochs=100",
            "train.log_every_steps=50",
        ),
    ]
    for attempt in range(4):
        out = output_url(f"stopped-{attempt}")
        proc = start_job("train", *args, "--set", FOREVER, "--output", out)
        deadline = time.time() + 300
        while time.time() < deadline and committed_step(out) < 0 and proc.poll() is None:
            time.sleep(0.05)
        assert committed_step(out) > 0 and proc.poll() is None, "no first commit within 300 s"
        time.sleep(0.1 + 0.2 * attempt)
        proc.send_signal(signal.SIGTERM)
        sent = time.time()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 75, err[-2000:]
        assert time.time() - sent < 20  # the default grace period
        assert "Traceback" not in err and "run the same command again" in err
        stopped = pointer(out)
        with fsspec.open(f"{out}/checkpoints/{stopped['file']}", "rb") as f:
            payload = torch.load(f, weights_only=True)
        if 0 < payload["progress"]["epoch_step"] < 30:
            break
    assert 0 < payload["progress"]["epoch_step"] < 30, f"no checkpoint in the middle of an epoch: {err[-1500:]}"
    end = f"train.epochs={stopped['epoch'] + 60}"
    again = run_job("train", *args, "--set", end, "--output", out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"from epoch {stopped['epoch']}, step {stopped['step']}" in again.stderr
    reference = run_job("train", *args, "--set", end, "--output", output_url("reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert_same_run(output_url("reference"), out)


def test_damaged_newest_checkpoint_falls_back_end_to_end(output_url):
    out = output_url("run")
    args = ["--device", "cpu", "--set", "train.eval_every_epochs=100", "--set", "train.checkpoint_every_epochs=100"]
    first = run_job("train", *args, "--set", "train.epochs=300", "--output", out)
    assert first.returncode == 0, first.stderr[-2000:]
    with fsspec.open(f"{out}/checkpoints/e00300-s0000000300.pt", "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 3] ^= 0x55
    with fsspec.open(f"{out}/checkpoints/e00300-s0000000300.pt", "wb") as f:
        f.write(bytes(data))
    resumed = run_job("train", *args, "--set", "train.epochs=400", "--output", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "sha256 differs from its manifest" in resumed.stderr
    assert "resuming iris from epoch 200, step 200" in resumed.stderr
    reference = run_job("train", *args, "--set", "train.epochs=400", "--output", output_url("reference"))
    assert reference.returncode == 0
    assert_same_run(output_url("reference"), out)


def test_settings_that_do_not_change_the_state_may_change_on_resume_and_others_name_the_ways_out(tmp_path):
    """grace_seconds, keep_best and deterministic change how a run is kept or timed, not what its checkpoint means:
    a resume may change them. A setting that does change it is refused in one line that names the key and the ways
    out, without telling the user to throw the run away first."""
    out = str(tmp_path / "run")
    base = ["train", "--device", "cpu", "--output", out]
    code, err = invoke([*base, *sets("train.epochs=200", "train.eval_every_epochs=100")])
    assert code == 0, err
    code, err = invoke([*base, *sets("train.epochs=300", "train.eval_every_epochs=100", "train.grace_seconds=5")])
    assert code == 0 and "resuming iris from epoch 200" in err, err
    code, err = invoke([*base, *sets("train.epochs=400", "train.keep_best=true", "train.deterministic=true")])
    assert code == 0 and "resuming iris from epoch 300" in err, err
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    code, err = invoke([*base, *sets("train.epochs=500", "optim.lr=0.5")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "optim.lr: 0.01 -> 0.5" in err and "another --output" in err and "--overwrite" in err
    assert "--resume never" not in err
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_overwrite_alone_starts_the_folder_afresh(tmp_path):
    """--overwrite means "this folder, from scratch": it implies --resume never, and the settings may then differ."""
    out = str(tmp_path / "run")
    base = ["train", "--device", "cpu", "--output", out]
    code, err = invoke([*base, *sets("train.epochs=200", "train.eval_every_epochs=100")])
    assert code == 0, err
    code, err = invoke([*base, "--overwrite", *sets("train.epochs=100", "optim.lr=0.05")])
    assert code == 0 and "resuming" not in err, err
    assert [json.loads(line)["epoch"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()] == [100]
    assert pointer(out)["epoch"] == 100


@pytest.mark.parametrize("schedule", ["cosine", "onecycle"])
def test_training_longer_replans_the_schedule_over_the_new_length(tmp_path, schedule):
    """Resuming with more epochs is the commonest resume: the schedule is a function of the step and the run's
    length, so the run continues on the curve re-planned over the new length and ends at the schedule's end."""
    out = str(tmp_path / "run")
    base = ["train", "--device", "cpu", "--output", out, *sets(f"optim.schedule={schedule}", "data.batch_size=120")]
    code, err = invoke([*base, *sets("train.epochs=100", "train.eval_every_epochs=50", "train.log_every_steps=10")])
    assert code == 0, err
    code, err = invoke([*base, *sets("train.epochs=300", "train.eval_every_epochs=50", "train.log_every_steps=10")])
    assert code == 0, err
    assert f"the {schedule} schedule re-planned over 300 epochs" in err
    lrs = dict(scalars(out, "train/lr"))
    assert max(lrs) == 300 and lrs[300] < 1e-4 * 0.01  # at the schedule's end (Iris: lr 0.01, one step per epoch)
    if schedule == "cosine":  # after the resume, never above the re-planned curve nor rising
        after = [lrs[s] for s in sorted(lrs) if s > 100]
        assert all(a >= b for a, b in zip(after, after[1:]))
        assert abs(lrs[200] - 0.01 * (1 + math.cos(math.pi * 200 / 300)) / 2) < 1e-6


def test_running_a_finished_run_again_changes_nothing_and_says_it_is_complete(tmp_path):
    out = tmp_path / "run"
    base = ["train", "--device", "cpu", "--output", str(out), *sets("train.eval_every_epochs=100")]
    code, err = invoke([*base, *sets("train.epochs=200")])
    assert code == 0, err

    def files() -> dict:
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    before = files()
    for epochs, why in ((200, "200 of 200 epochs done"), (100, "200 epochs done, more than train.epochs=100")):
        code, err = invoke([*base, *sets(f"train.epochs={epochs}")])
        assert code == 0 and len(err.strip().splitlines()) == 1, err
        assert f"iris in {out} is complete: {why}" in err
        assert files() == before  # byte for byte: no config, weights, event file or metrics written


def test_resuming_a_checkpoint_into_another_runs_folder_is_refused_unless_overwritten(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ["train", "--device", "cpu", *sets("train.eval_every_epochs=100")]
    for out, epochs in ((a, 200), (b, 100)):
        code, err = invoke([*common, "--output", out, *sets(f"train.epochs={epochs}")])
        assert code == 0, err
    before = {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    into_b = [*common, "--resume", a, "--output", b, *sets("train.epochs=300")]
    code, err = invoke(into_b)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{b} holds another run" in err and "--overwrite" in err
    assert {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()} == before
    code, err = invoke([*into_b, "--overwrite"])
    assert code == 0 and "resuming iris from epoch 200" in err, err
    runs = {json.loads(m.read_text())["run"] for m in (tmp_path / "b/checkpoints").glob("e*.json")}
    assert runs == {pointer(a)["run"]} == {pointer(b)["run"]}  # only run a's checkpoints, continued
    assert [json.loads(line)["epoch"] for line in (tmp_path / "b/metrics.jsonl").read_text().splitlines()] == [300]


def test_a_run_stopped_after_its_last_checkpoint_writes_its_results_when_run_again(tmp_path):
    out = tmp_path / "run"
    base = ["train", "--device", "cpu", "--output", str(out), *sets("train.epochs=200", "train.eval_every_epochs=100")]
    code, err = invoke(base)
    assert code == 0, err
    weights = (out / "model.pt").read_bytes()
    (out / "model.pt").unlink()  # as if the machine went away between the last commit and the results
    code, err = invoke(base)
    assert code == 0 and "is complete" not in err and "done: 200 epochs" in err, err
    assert (out / "model.pt").read_bytes() == weights


def test_overwriting_a_finished_run_from_its_own_checkpoint_writes_its_results_again(tmp_path):
    """--overwrite --resume URL on a finished run clears the folder for that checkpoint: the run then writes its
    results again, never leaves the folder empty as if it were complete."""
    out = tmp_path / "run"
    base = ["train", "--device", "cpu", "--output", str(out), *sets("train.eval_every_epochs=100", "train.epochs=200")]
    code, err = invoke(base)
    assert code == 0, err
    kept = tmp_path / "kept.pt"
    kept.write_bytes(max((out / "checkpoints").glob("e*.pt")).read_bytes())
    code, err = invoke([*base, "--resume", str(kept), "--overwrite"])
    assert code == 0, err
    assert (out / "model.pt").is_file() and (out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file()


def test_a_recipe_run_killed_and_resumed_equals_uninterrupted(tmp_path):
    """EMA, TrivialAugment with random erasing, MixUp and CutMix, label smoothing and a warm-up, killed (SIGKILL)
    after commits and resumed: the EMA's weights in model.pt, every evaluation and the training loss are those of a
    run that never stopped."""
    from conftest import write_image_folder

    images = write_image_folder(tmp_path / "images", size=16)
    recipe = sets(
        f"data.path={images}",
        "data.kind=folder",
        "model.name=mlp",
        "data.batch_size=12",  # 3 steps an epoch
        "train.ema=0.99",
        "data.augment=[trivial_augment, random_erasing]",
        "data.random_hflip=true",
        "train.mixup=0.4",
        "train.cutmix=1.0",
        "train.label_smoothing=0.1",
        "optim.warmup='30 steps'",
        "optim.momentum=0.9",
        "train.checkpoint_every_epochs=20",
        "train.eval_every_epochs=30",
        "train.log_every_steps=10",
        "train.keep_last=2",
    )
    args = ["--device", "cpu", *recipe]
    out = str(tmp_path / "killed")
    rng = random.Random(45)
    last_step, resumed_from = -1, set()
    for _ in range(3):
        proc = start_job("train", *args, "--set", FOREVER, "--output", out)
        deadline = time.time() + 300
        while committed_step(out) <= last_step and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert committed_step(out) > last_step, "no new commit within 300 s"
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the run ended by itself"
        proc.kill()
        _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
        resumed_from |= {line for line in err.splitlines() if line.startswith("resuming")}
        last_step = committed_step(out)
    assert len(resumed_from) >= 2, resumed_from
    end = f"train.epochs={pointer(out)['epoch'] + 25}"
    final = run_job("train", *args, "--set", end, "--output", out)
    assert final.returncode == 0, final.stderr[-2000:]
    reference = run_job("train", *args, "--set", end, "--output", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert_same_run(str(tmp_path / "reference"), out)
    with fsspec.open(f"{out}/checkpoints/{pointer(out)['file']}", "rb") as f:
        payload = torch.load(f, weights_only=True)
    assert payload["ema"]["updates"] == payload["progress"]["step"]  # the average went on across the kills
