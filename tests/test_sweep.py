"""job sweep: real Optuna storages (SQLite, a private PostgreSQL cluster), real worker processes killed mid-trial and
started again, trials continued from their checkpoints, the results, and bad input refused before any work."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import assert_same_run, free_port, invoke, job_env, run_job, sets

optuna = pytest.importorskip("optuna")

IRIS = ["--device", "cpu", "--config", "iris", *sets("data.val_split=0.2")]


def space_file(tmp_path: Path, trials: int = 3, **extra) -> Path:
    doc = {
        "metric": "val_accuracy",
        "direction": "maximize",
        "trials": trials,
        "sampler": {"name": "tpe", "seed": 0},
        "pruner": "none",
        "space": {"optim.lr": {"low": 0.01, "high": 1.0, "log": True}, "optim.momentum": {"low": 0.0, "high": 0.9}},
    } | extra
    path = tmp_path / f"space-{len(list(tmp_path.glob('space-*')))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def worker(space: Path, out: Path, epochs: int, *more: str) -> subprocess.Popen:
    """A sweep worker in a session of its own (killed with its process group, as the acceptance check does)."""
    argv = [sys.executable, "-m", "job", "sweep", str(space), "--output", str(out), *IRIS]
    argv += [*sets(f"train.epochs={epochs}"), *more]
    log = open(out.parent / f"worker-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(argv, env=job_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def evaluations(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in out.glob("trials/*/metrics.jsonl"))


def wait_for(predicate, timeout: float = 240, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"waited {timeout} s for {what}"
        time.sleep(0.1)


def study_of(storage: str):
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def complete(study) -> list:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def attempts(run: Path) -> list[dict]:
    return json.loads((run / "run.json").read_text())["attempts"]


def mid_trial(out: Path, pid: int) -> bool:
    """Whether the worker `pid` is running a trial that has committed a checkpoint (a state, not a moment: a kill now
    lands inside the trial, wherever the machine's load has put it)."""
    for trial in (out / "trials").glob("*"):
        try:
            last = attempts(trial)[-1]
        except (OSError, ValueError, IndexError, KeyError):
            continue  # not begun yet, or run.json being replaced
        if last.get("pid") == pid and last.get("ended") is None and (trial / "checkpoints/latest.json").exists():
            return True
    return False


def test_workers_killed_mid_trial_leave_their_trials_to_the_next_which_continue_them(tmp_path):
    """Two workers side by side, one killed outright (SIGKILL of its group) mid-trial and started again: exactly N
    COMPLETE trials with N parameter sets, N folders; the killed trial continued from its checkpoint and equal to an
    uninterrupted run of its config.yaml; best.json and best/ as predict's --model."""
    space, out = space_file(tmp_path, trials=3), tmp_path / "S"
    a, b = worker(space, out, 4000), worker(space, out, 4000)
    wait_for(lambda: mid_trial(out, a.pid), what="worker a inside a trial, past its first checkpoint")
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    a = worker(space, out, 4000)
    assert a.wait(timeout=600) == 0 and b.wait(timeout=600) == 0, (tmp_path / "S").parent
    study = study_of(f"sqlite:///{out}/study.db")
    done = complete(study)
    assert len(done) == 3 and len({tuple(sorted(t.params.items())) for t in done}) == 3
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["0", "1", "2"]
    interrupted = [p for p in (out / "trials").iterdir() if len(attempts(p)) > 1]
    assert interrupted, "the kill landed outside a trial"
    run = interrupted[0]
    assert attempts(run)[-1]["from"]["step"] > 0  # continued from its checkpoint, not from zero
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") is not None]
    assert retried and all(t.params == study.trials[t.system_attrs["failed_trial"]].params for t in retried)
    ref = tmp_path / "ref"
    r = run_job("train", "--device", "cpu", "--config", str(run / "config.yaml"), "--output", str(ref))
    assert r.returncode == 0, r.stderr
    assert_same_run(str(ref), str(run))
    best = json.loads((out / "best.json").read_text())
    assert best["metric"]["val_accuracy"] == max(t.value for t in done)
    (placed,) = {tuple(t.params.items()) for t in done if t.user_attrs["trial"] == best["trial"]}
    assert dict(placed) == best["values"]
    assert (out / "trials.csv").read_text().count("COMPLETE") == 3 and (out / "params.png").stat().st_size > 1000
    iris = Path(__file__).parents[1] / "job/presets/iris.csv"
    r = run_job(
        "predict", "--model", str(out / "best"), str(iris), "--device", "cpu", "--output", str(tmp_path / "p.csv")
    )
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 151


def test_a_worker_stopped_by_sigterm_exits_75_and_the_sweep_goes_on_as_one_never_stopped(tmp_path):
    """SIGTERM: the trial commits, is failed at once with its retry queued (no wait for its heartbeat to go stale),
    the worker exits 75; the same command finishes the study with the values of an uninterrupted one."""
    space, out = space_file(tmp_path, trials=2), tmp_path / "S"
    w = worker(space, out, 6000)
    wait_for(lambda: evaluations(out) >= 2, what="an evaluation of trial 0")
    os.killpg(w.pid, signal.SIGTERM)
    assert w.wait(timeout=120) == 75
    study = study_of(f"sqlite:///{out}/study.db")
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.WAITING]
    assert worker(space, out, 6000).wait(timeout=600) == 0
    assert attempts(out / "trials/0")[1]["from"]["step"] > 0
    again = tmp_path / "U"
    assert worker(space, again, 6000).wait(timeout=600) == 0
    stopped = [t.params for t in complete(study_of(f"sqlite:///{out}/study.db"))]
    assert stopped == [t.params for t in complete(study_of(f"sqlite:///{again}/study.db"))]


@pytest.mark.parametrize(
    "space,args,says",
    [
        ({"space": {"optim.lrr": {"low": 0.1, "high": 1.0}}}, [], "did you mean optim.lr?"),
        ({"space": {"optim.lr": {"low": 1.0, "high": 0.1}}}, [], "empty or reversed range"),
        ({"space": {"optim.lr": {"low": 0.1, "high": 0.1}}}, [], "empty or reversed range"),
        ({"metric": "val_acc"}, [], "val_accuracy"),
        ({"direction": "up"}, [], "maximize or minimize"),
        ({"metric": "val_loss", "direction": "maximize"}, [], "val_loss is better lower: minimize"),
        ({"sampler": {"name": "grid"}}, [], "a grid takes lists"),
        ({}, ["--study", "postgresql://nobody@127.0.0.1:1/none"], "cannot open the study's storage"),
        ({}, ["--output", "gs://bucket/sweep"], "--study postgresql://"),
        ({}, ["--study", "sqlite:////gcs/bucket/study.db"], "Cloud Storage FUSE"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, space, args, says):
    path = space_file(tmp_path, **space)
    out = tmp_path / "S"
    code, err = invoke(["sweep", str(path), "--output", str(out), *IRIS, *args])
    assert code == (4 if "postgresql://nobody" in " ".join(args) else 2), err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "metric, args, says",
    [
        ("val_accuracy", sets("data.val_split=0"), "set data.val_split"),  # never chosen on test
        ("val_map", [], "val_accuracy"),  # a table's classes are one a row: no mAP
    ],
)
def test_a_metric_the_run_will_not_write_is_refused_before_any_trial(tmp_path, metric, args, says):
    out = tmp_path / "S"
    argv = ["sweep", str(space_file(tmp_path, metric=metric)), "--output", str(out), *IRIS, *args]
    r = run_job(*argv, timeout=120)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def test_trials_in_one_worker_count_their_own_device_time(tmp_path):
    """A worker runs its trials one after another in one process: each trial's start-up and device time count
    from its own start, not from the worker's, so they add up to no more than the worker's time."""
    space, out = space_file(tmp_path, trials=3), tmp_path / "S"
    t0 = time.time()
    assert worker(space, out, 400).wait(timeout=600) == 0
    wall = time.time() - t0
    firsts = [attempts(out / f"trials/{n}")[0] for n in range(3)]
    device_s = [a["device_hours"] * 3600 for a in firsts]
    assert sum(device_s) <= wall + 1, (device_s, wall)
    assert max(a["startup_s"] for a in firsts[1:]) < firsts[0]["startup_s"] + 1, firsts


def test_a_space_file_that_is_not_yaml_is_refused(tmp_path):
    bad = tmp_path / "space.yaml"
    bad.write_text("metric: [val_accuracy\n")
    code, err = invoke(["sweep", str(bad), "--output", str(tmp_path / "S"), *IRIS])
    assert code == 2 and "not valid YAML" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "S").exists()


def test_sqlite_on_a_network_filesystem_is_refused(tmp_path, monkeypatch):
    from job.study import storage as study_storage

    monkeypatch.setattr(study_storage, "network_filesystem", lambda path: "nfs4")
    code, err = invoke(["sweep", str(space_file(tmp_path)), "--output", str(tmp_path / "S"), *IRIS])
    assert code == 2 and "network filesystem (nfs4)" in err and "postgresql://" in err
    assert not (tmp_path / "S").exists()


@pytest.fixture(scope="session")
def postgres() -> str:
    """A private PostgreSQL cluster on loopback (as the postgres user when run as root); its URL."""
    binaries = [*sorted(Path("/usr/lib/postgresql").glob("*/bin")), Path("/usr/local/bin")]
    initdb = next((b / "initdb" for b in binaries if (b / "initdb").exists()), None)
    if initdb is None:
        pytest.skip("no PostgreSQL server here (initdb)")
    pytest.importorskip("psycopg2")
    root = Path(tempfile.mkdtemp(prefix="job-pg-"))  # not under pytest's private folder: the server's user enters it
    os.chmod(root, 0o777)
    data, port = root / "data", free_port()
    as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run(
        [*as_pg, str(initdb), "-A", "trust", "-U", "postgres", "-D", str(data)], check=True, capture_output=True
    )
    ctl = str(initdb.with_name("pg_ctl"))
    options = f"-p {port} -k {root} -h 127.0.0.1"
    subprocess.run(
        [*as_pg, ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"],
        check=True,
        capture_output=True,
    )
    yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    subprocess.run([*as_pg, ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def test_a_study_in_postgresql_shared_by_two_workers(tmp_path, postgres):
    space, out = space_file(tmp_path, trials=3), tmp_path / "S"
    ws = [worker(space, out, 1000, "--study", postgres) for _ in range(2)]
    assert [w.wait(timeout=600) for w in ws] == [0, 0]
    study = study_of(postgres.replace("postgresql://", "postgresql+psycopg2://"))  # SQLAlchemy 2.1: psycopg 3
    assert len(complete(study)) == 3 and len({tuple(t.params.items()) for t in complete(study)}) == 3
    assert not (out / "study.db").exists() and (out / "best.json").exists()


def test_a_trial_on_two_processes_has_the_same_parameters_on_both(tmp_path):
    """--nproc-per-node 2: the worker draws the parameters once and starts the group with them as --set."""
    space, out = space_file(tmp_path, trials=1), tmp_path / "S"
    w = worker(space, out, 400, "--nproc-per-node", "2")
    assert w.wait(timeout=600) == 0
    (trial,) = complete(study_of(f"sqlite:///{out}/study.db"))
    cfg = yaml.safe_load((out / "trials/0/config.yaml").read_text())
    assert cfg["optim"]["lr"] == trial.params["optim.lr"] and cfg["optim"]["momentum"] == trial.params["optim.momentum"]
    assert attempts(out / "trials/0")[0]["world_size"] == 2


def test_a_pruned_trial_stops_at_a_checkpoint_and_says_why(tmp_path):
    """With the median pruner, a trial worse than the median of the earlier ones at an evaluation is stopped there
    (its checkpoint committed), PRUNED in the study, and its run.json's note says why."""
    space = space_file(
        tmp_path,
        trials=3,
        pruner="median",
        space={"optim.lr": [0.5, 0.001, 0.0011]},
        sampler={"name": "grid", "seed": 1},
    )
    out = tmp_path / "S"
    assert worker(space, out, 3000).wait(timeout=600) == 0
    study = study_of(f"sqlite:///{out}/study.db")
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert [t.params["optim.lr"] for t in pruned] == [0.001]  # seed 1's grid order: 0.5, 0.0011, then 0.001
    run = Path(pruned[0].user_attrs["run"])
    judged = max(pruned[0].intermediate_values)  # the evaluation it was pruned at: its last report
    note = json.loads((run / "run.json").read_text())["note"]
    assert f"pruned by the median pruner at epoch {judged}" in note
    assert (run / "checkpoints/latest.json").exists() and not (run / "model.pt").exists()
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    (at,) = [r["step"] for r in records if r.get("epoch") == judged and "train_loss" in r]
    assert attempts(run)[-1]["committed"]["step"] == at  # stopped at that evaluation, not steps after it
    (log,) = tmp_path.glob("worker-*.log")
    stops = [line for line in log.read_text().splitlines() if ": stopping " in line]  # the run's stop line
    assert stops and stops[-1].startswith(f"the sweep's pruner (median, at epoch {judged}): stopping"), stops
    assert "time limit" not in log.read_text()


def test_the_sweep_command_is_in_the_help():
    r = subprocess.run([sys.executable, "-m", "job", "sweep", "--help"], capture_output=True, text=True, env=job_env())
    assert r.returncode == 0 and "--study" in r.stdout


def test_a_tracked_study_is_one_mlflow_run_with_each_trial_a_child_of_it(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    space, out = space_file(tmp_path, trials=2), tmp_path / "S"
    tracked = sets(f"track.mlflow={mlflow_server}", "track.experiment=sweeps")
    assert worker(space, out, 1000, *tracked).wait(timeout=600) == 0
    c = MlflowClient(tracking_uri=mlflow_server)
    runs = c.search_runs([c.get_experiment_by_name("sweeps").experiment_id])
    (parent,) = [r for r in runs if r.info.run_name == "iris-sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["job.run"] for r in children) == [str(out / "trials/0"), str(out / "trials/1")]
    assert len(runs) == 3 and parent.info.status == "FINISHED"
    best = json.loads((out / "best.json").read_text())
    assert parent.data.metrics["best_val_accuracy"] == best["metric"]["val_accuracy"]


def talking_to(pid: int, port: int) -> bool:
    """Whether process `pid` has a connection open to `port` on this machine (a request sent, or being sent)."""
    psutil = pytest.importorskip("psutil")
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.raddr and c.raddr.port == port for c in conns)


def test_two_workers_starting_at_once_agree_on_one_mlflow_run_for_the_study(tmp_path, mlflow_server):
    """Both workers find the study without its MLflow run and ask the server for one at the same moment (the server
    is held stopped until both have asked): they converge on one parent run, every trial's run a child of it."""
    psutil = pytest.importorskip("psutil")
    from mlflow import MlflowClient

    space, out = space_file(tmp_path, trials=2), tmp_path / "S"
    tracked = sets(f"track.mlflow={mlflow_server}", "track.experiment=two-workers")
    port = int(mlflow_server.rsplit(":", 1)[1])
    (server,) = {c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    group = os.getpgid(server)
    os.killpg(group, signal.SIGSTOP)  # requests wait in the server's queue, answered together once it goes on
    try:
        ws = [worker(space, out, 300, *tracked) for _ in range(2)]
        wait_for(lambda: all(talking_to(w.pid, port) for w in ws), what="both workers asking the server")
    finally:
        os.killpg(group, signal.SIGCONT)
    assert [w.wait(timeout=600) for w in ws] == [0, 0], list(tmp_path.glob("worker-*.log"))
    c = MlflowClient(tracking_uri=mlflow_server)
    runs = c.search_runs([c.get_experiment_by_name("two-workers").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.data.tags["job.run"] for r in children) == [str(out / "trials/0"), str(out / "trials/1")]
    assert len(runs) == 3 and parents[0].info.status == "FINISHED"


def test_a_sweep_in_a_bucket_with_its_study_on_local_disk(tmp_path, bucket):
    """--output gs://...: the trials are runs in the bucket, the results written there; the study in a local SQLite
    file (--study), as a bucket takes no SQLite."""
    space = space_file(tmp_path, trials=2)
    env = {"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"], "JOB_STAGING_DIR": str(tmp_path / "staging")}
    argv = ["sweep", str(space), "--output", bucket.url("S"), "--study", f"sqlite:///{tmp_path}/study.db", *IRIS]
    r = run_job(*argv, *sets("train.epochs=1000"), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    names = bucket.names("S")
    assert {"best.json", "best/model.pt", "best/model.json", "trials.csv", "trials/0/model.pt"} <= set(names)
    best = json.loads(bucket.fs.cat_file(f"{bucket.name}/S/best.json"))
    assert best["run"] == bucket.url(f"S/trials/{best['trial']}")


IRIS_CSV = Path(__file__).parents[1] / "job/presets/iris.csv"


def test_a_sweep_whose_trial_failed_goes_on_and_ends_when_run_again(tmp_path):
    """A trial that fails (exit 3: its data.path is missing) is FAIL with its reason, tried once more with the same
    parameters, then ended; the worker goes on to the next trial and ends the study with the rest. The same command
    again ends at once, creating no trial."""
    missing = tmp_path / "no-such.csv"
    grid = {"name": "grid", "seed": 0}
    space = space_file(tmp_path, trials=2, sampler=grid, space={"data.path": [str(IRIS_CSV), str(missing)]})
    out = tmp_path / "S"
    argv = ["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=2")]
    first = run_job(*argv, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "no-such.csv" in first.stderr and "Traceback" not in first.stderr
    again = run_job(*argv, timeout=120)
    assert again.returncode == 0, again.stderr
    study = study_of(f"sqlite:///{out}/study.db")
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(study.trials) == 3 and len(failed) == 2, [(t.state, t.params) for t in study.trials]
    assert all(t.params == {"data.path": str(missing)} and "no-such.csv" in t.user_attrs["failure"] for t in failed)
    assert "no-such.csv" in again.stderr  # the summary names every failure
    best = json.loads((out / "best.json").read_text())
    assert best["values"] == {"data.path": str(IRIS_CSV)}
    assert "FAIL" in (out / "trials.csv").read_text()


def test_a_sweep_whose_every_trial_failed_exits_with_the_first_failure_code(tmp_path):
    grid = {"name": "grid", "seed": 0}
    paths = [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]
    space = space_file(tmp_path, trials=2, sampler=grid, space={"data.path": paths})
    out = tmp_path / "S"
    argv = ["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=2")]
    for _ in range(2):
        r = run_job(*argv, timeout=300)
        assert r.returncode == 3, r.stderr
        assert "a.csv" in r.stderr and "b.csv" in r.stderr and "Traceback" not in r.stderr
    assert len(study_of(f"sqlite:///{out}/study.db").trials) == 4  # each tried twice, none created unrun
    assert not (out / "best.json").exists()


def test_the_metric_is_one_the_evaluation_writes_for_the_task():
    from job.config import load_config
    from job.study.space import metrics_written

    multi = metrics_written(
        load_config("cifar10", ["data.kind=manifest", "data.task=multilabel", "data.val_split=0.2"])
    )
    assert {"val_map", "val_micro_f1", "val_exact_match", "val_loss"} <= set(multi)
    assert not {"val_accuracy", "val_top5"} & set(multi)
    single = metrics_written(load_config("cifar10", ["data.val_split=0.2"]))
    assert {"val_accuracy", "val_top5", "val_macro_f1"} <= set(single) and "val_map" not in single
    either = metrics_written(load_config("cifar10", ["data.kind=folder", "data.val_split=0.2"]))  # task auto
    assert {"val_accuracy", "val_map"} <= set(either)


def test_the_records_hold_the_scores_named_for_them():
    import numpy as np
    import torch

    from job.recipe.multilabel import scored
    from job.recorded import split_scores
    from job.use.evaluate import Scored

    for k in (3, 10):
        s = Scored(0.5, 0.5, 0.9, torch.eye(k), [])
        assert list(s.record("val")) == [f"val_{m}" for m in split_scores(False, k)]
    y = np.array([[1, 0], [0, 1], [1, 1]])
    m = scored(y, np.array([[0.9, 0.2], [0.1, 0.8], [0.7, 0.6]]), 0.3)
    assert list(m.record("val")) == [f"val_{m}" for m in split_scores(True, 2)]


def test_a_multilabel_model_is_swept_on_val_map(tmp_path):
    from test_multilabel import manifests, mosaic_images

    data = tmp_path / "mosaics"
    manifests(data, mosaic_images(data, 96))
    over = sets(
        "data.kind=manifest",
        f"data.path={data / 'labels.jsonl'}",
        "data.label_column=labels",
        "data.image_size=32",
        "data.val_split=0.25",
        "optim.name=adamw",
        "train.epochs=2",
        "data.batch_size=16",
    )
    space = space_file(tmp_path, trials=2, metric="val_map", space={"optim.lr": {"low": 0.001, "high": 0.01}})
    out = tmp_path / "S"
    code, err = invoke(["sweep", str(space), "--output", str(out), "--device", "cpu", "--config", "cifar10", *over])
    assert code == 0, err
    study = study_of(f"sqlite:///{out}/study.db")
    assert len(complete(study)) == 2 and all(0 <= t.value <= 1 for t in complete(study))
    best = json.loads((out / "best.json").read_text())
    assert best["metric"]["val_map"] == max(t.value for t in complete(study))


def test_best_holds_the_weights_that_gave_best_json_number_for_val_loss(tmp_path):
    """A sweep on val_loss (lower is better): each trial's model.pt is the evaluation of its lowest val_loss, so
    `job evaluate` of best/ on the val images gives best.json's number."""
    from conftest import write_image_folder

    root = write_image_folder(tmp_path / "images", per_class=16, test_per_class=6)
    (root / "test").rename(root / "val")
    write_image_folder(tmp_path / "more", per_class=1, test_per_class=4)
    (tmp_path / "more/test").rename(root / "test")
    over = sets(f"data.path={root}", "data.kind=folder", "data.image_size=32", "train.epochs=6", "data.batch_size=8")
    space = space_file(tmp_path, trials=2, metric="val_loss", direction="minimize", space={"optim.lr": [0.3, 0.05]})
    out = tmp_path / "S"
    code, err = invoke(["sweep", str(space), "--output", str(out), "--device", "cpu", "--config", "cifar10", *over])
    assert code == 0, err
    best = json.loads((out / "best.json").read_text())
    r = run_job("evaluate", "--model", str(out / "best"), "--data", str(root / "val"), "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["all_loss"] == pytest.approx(best["metric"]["val_loss"], rel=1e-5)
    assert yaml.safe_load((out / "best/config.yaml").read_text())["train"]["choose_on"] == "val_loss"


def test_trials_sweeping_the_batch_size_are_pruned_at_the_same_epochs(tmp_path):
    """The pruner compares trials at equal points of training: each reports at its epochs, whatever its batch size
    (at optimizer steps, a trial of 16 samples a step and one of the whole table never met)."""
    space = space_file(tmp_path, trials=3, pruner="median", space={"data.batch_size": [16, 64, 128]})
    out = tmp_path / "S"
    argv = ["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=4", "train.eval_every_epochs=2")]
    code, err = invoke(argv)
    assert code == 0, err
    reported = [sorted(t.intermediate_values) for t in study_of(f"sqlite:///{out}/study.db").trials]
    assert reported == [[2, 4]] * 3, reported


def test_a_trial_whose_loss_is_not_finite_is_stopped_at_that_evaluation(tmp_path):
    space = space_file(tmp_path, trials=1, sampler={"name": "grid", "seed": 0}, space={"optim.lr": [1e12]})
    out = tmp_path / "S"
    argv = ["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=50", "train.eval_every_epochs=5")]
    code, err = invoke(argv)
    assert code == 2 and "each was stopped short" in err, err  # no trial completed, none failed
    (t,) = study_of(f"sqlite:///{out}/study.db").trials
    assert t.state == optuna.trial.TrialState.PRUNED and "not finite at epoch 5" in t.user_attrs["stopped"], err
    assert [r["epoch"] for r in map(json.loads, (out / "trials/0/metrics.jsonl").read_text().splitlines())] == [5]
    assert "not finite" in (out / "trials.csv").read_text()


def test_a_changed_space_is_refused_and_a_changed_config_said(tmp_path):
    out = tmp_path / "S"
    space = space_file(tmp_path, trials=1)
    argv = ["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=2")]
    assert invoke(argv)[0] == 0
    study = study_of(f"sqlite:///{out}/study.db")
    tpe = study.user_attrs["began_with"]["sampler"]
    assert tpe == {"name": "tpe", "seed": 0, "multivariate": False, "constant_liar": True, "n_startup_trials": 10,
                   "n_ei_candidates": 24}  # fmt: skip
    wider = space_file(tmp_path, trials=1, space={"optim.lr": {"low": 0.01, "high": 2.0, "log": True}})
    code, err = invoke(["sweep", str(wider), "--output", str(out), *IRIS, *sets("train.epochs=2")])
    assert code == 2 and "differs from the one study iris-sweep began with (space.optim.lr" in err, err
    code, err = invoke(["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=3")])
    assert code == 0 and "config: differs from the one study iris-sweep began with: train.epochs 2 -> 3" in err, err


def test_trials_csv_and_best_json_carry_what_the_sweep_cost(tmp_path):
    out = tmp_path / "S"
    space = space_file(tmp_path, trials=2)
    argv = ["sweep", str(space), "--output", str(out), *IRIS, *sets("train.epochs=2", "train.price_per_device_hour=3")]
    assert invoke(argv)[0] == 0
    import csv

    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["trial"] for r in rows] == ["0", "1", "total"]
    hours = [float(r["device_hours"]) for r in rows]
    assert all(h > 0 for h in hours) and hours[2] == pytest.approx(hours[0] + hours[1], abs=2e-6)
    assert float(rows[2]["spent"]) == pytest.approx(3 * hours[2], rel=1e-3) and rows[2]["lost_s"] == "0.0"
    best = json.loads((out / "best.json").read_text())
    cost = best["cost"]
    assert cost["device_hours"] == pytest.approx(hours[2]) and cost["spent"] == pytest.approx(float(rows[2]["spent"]))
    assert best["trial_cost"]["device_hours"] == pytest.approx(hours[best["trial"]])


def test_the_sweeps_page_example_runs_as_written(tmp_path):
    import re

    page = (Path(__file__).parents[1] / "docs/sweeps.md").read_text()
    (example,) = re.findall(r"```yaml\n(.*?)```", page, re.S)
    (command,) = re.findall(r"^    python -m job sweep space.yaml (.*)$", page, re.M)
    (tmp_path / "space.yaml").write_text(example)
    out = tmp_path / "S"
    argv = ["sweep", str(tmp_path / "space.yaml"), *command.split(), "--output", str(out), "--device", "cpu"]
    code, err = invoke([*argv, "--trials", "2", *sets("train.epochs=3")])
    assert code == 0, err
    assert len(complete(study_of(f"sqlite:///{out}/study.db"))) + err.count("pruned by") == 2


def test_a_metric_the_data_never_gives_ends_the_sweep_before_training(tmp_path):
    """top-5 of a folder of 5 classes is never written: known once the first trial's run has read its data, which
    stops there, and the sweep ends in one line (exit 2), trying no other trial."""
    from conftest import write_image_folder

    root = write_image_folder(tmp_path / "images", n_classes=5, per_class=6, test_per_class=2)
    over = sets(f"data.path={root}", "data.kind=folder", "data.image_size=32", "data.val_split=0.3", "train.epochs=1")
    space = space_file(tmp_path, trials=3, metric="val_top5")
    out = tmp_path / "S"
    r = run_job("sweep", str(space), "--output", str(out), "--device", "cpu", "--config", "cifar10", *over)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: space metric: val_top5: train.choose_on"), r.stderr
    assert len(study_of(f"sqlite:///{out}/study.db").trials) == 1 and not (out / "trials/0/metrics.jsonl").exists()
    space = space_file(tmp_path, trials=2, metric="val_accuracy")  # the space mended: the study takes it
    r = run_job("sweep", str(space), "--output", str(out), "--device", "cpu", "--config", "cifar10", *over)
    assert r.returncode == 0 and "no trial has run" in r.stderr, r.stderr
    assert len(complete(study_of(f"sqlite:///{out}/study.db"))) == 2
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["0", "1"]


def test_two_workers_on_postgresql_go_on_past_a_failed_trial_and_end(tmp_path, postgres):
    """Two workers on one PostgreSQL study whose grid fails for one data.path: both end 0; each failed trial was tried
    twice, whichever worker took its retry, and the others completed."""
    grid = {"name": "grid", "seed": 0}
    swept = {"data.path": [str(IRIS_CSV), str(tmp_path / "gone.csv")], "optim.lr": [0.01, 0.02]}
    space = space_file(tmp_path, trials=3, name="failing-pg", sampler=grid, space=swept)
    out = tmp_path / "S"
    ws = [worker(space, out, 200, "--study", postgres) for _ in range(2)]
    assert [w.wait(timeout=600) for w in ws] == [0, 0]
    study = optuna.load_study(
        study_name="failing-pg", storage=postgres.replace("postgresql://", "postgresql+psycopg2://")
    )
    tried = [t for t in study.trials if not t.user_attrs.get("extra")]
    failed = [t for t in tried if t.state == optuna.trial.TrialState.FAIL]
    assert all("gone.csv" in t.user_attrs["failure"] for t in failed) and len(failed) in (2, 4), failed
    assert len(complete(study)) + len(failed) // 2 == 3


def test_a_retry_after_a_failure_that_is_stopped_is_continued_and_keeps_no_old_failure(tmp_path):
    """A failed trial's retry is made with the failed try's attributes: stopped by SIGTERM, it is still queued again
    (a stopped try, not a failed one), and once complete it carries no failure."""
    out = tmp_path / "S"
    out.mkdir()
    storage = f"sqlite:///{out}/study.db"
    study = optuna.create_study(storage=storage, study_name="iris-sweep", direction="maximize")
    trial = study.ask({"optim.lr": optuna.distributions.FloatDistribution(0.01, 1.0, log=True)})
    attrs = {
        "failure": "data.path x.csv: no such file or folder",
        "exit_code": 3,
        "trial": 0,
        "run": str(out / "trials/0"),
    }
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)(study, study.trials[0])
    space = space_file(tmp_path, trials=1, space={"optim.lr": {"low": 0.01, "high": 1.0, "log": True}})
    w = worker(space, out, 6000)
    wait_for(lambda: evaluations(out) >= 2, what="an evaluation of the retry")
    os.killpg(w.pid, signal.SIGTERM)
    assert w.wait(timeout=120) == 75
    assert [t.state.name for t in study_of(storage).trials] == ["FAIL", "FAIL", "WAITING"]
    assert worker(space, out, 6000).wait(timeout=600) == 0
    study = study_of(storage)
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL", "COMPLETE"]
    assert study.trials[2].user_attrs.get("failure") is None
    row = (out / "trials.csv").read_text().splitlines()[1]
    assert "COMPLETE" in row and "no such file" not in row, row
