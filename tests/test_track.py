"""MLflow tracking against a real MLflow server (SQLite backend, artifacts served by it) on 127.0.0.1: one MLflow run
per job run, each point once however often the run is killed and resumed, params, artifacts and a model version;
a server that is down costs the run nothing, and `job track` sends what waited, once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, run_job, sets, start_job, start_mlflow_server, stop_group, wait_healthy

mlflow = pytest.importorskip("mlflow", reason="the MLflow server and client (requirements-test.txt)")

JOB = ["train", "--device", "cpu", "--config", "iris"]
# Iris with a val split: 4 evaluations, a checkpoint every 1000 epochs, a loss window every 200 steps.
RUN = sets("data.val_split=0.2", "train.epochs=4000", "train.checkpoint_every_epochs=1000", "track.experiment=tests")


@pytest.fixture(scope="module")
def server(mlflow_server) -> str:
    return mlflow_server


def client(url: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=url)


def runs_named(url: str, name: str) -> list:
    c = client(url)
    exp = c.get_experiment_by_name("tests")
    return [r for r in c.search_runs([exp.experiment_id], max_results=1000) if r.info.run_name == name] if exp else []


def histories(url: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    c = client(url)
    keys = c.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k)) for k in keys}


def artifacts(url: str, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client(url).list_artifacts(run_id, path):
        out += artifacts(url, run_id, f.path) if f.is_dir else [f.path]
    return out


def computed(h: dict) -> dict:
    """The metrics that are computed from the model and data (system/ ones are measured: they differ run to run)."""
    return {k: v for k, v in h.items() if not k.startswith("system/")}


@pytest.fixture(scope="module")
def uninterrupted(server, tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("runs") / "A"
    r = run_job(*JOB, *RUN, *sets(f"track.mlflow={server}", "track.register=tests-model"), "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = runs_named(server, "A")
    return str(out), {"run": run, "stderr": r.stderr, "histories": histories(server, run.info.run_id)}


def test_a_run_is_one_mlflow_run_with_its_params_metrics_files_and_model_version(server, uninterrupted):
    out, a = uninterrupted
    run, h = a["run"], a["histories"]
    assert f"tracking: MLflow {server}, experiment tests, run A" in a["stderr"]
    assert f"tracking: sent to MLflow {server}" in a["stderr"]
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.01" and run.data.params["decided.world_size"] == "1"
    assert run.data.tags["job.run"] == out and run.data.tags["job.attempts"] == "1"
    # one point per log window (every 200 steps) and per evaluation (every 1000), steps increasing
    assert [s for s, _ in h["train/loss"]] == list(range(200, 4001, 200))
    assert [s for s, _ in h["val_accuracy"]] == [1000, 2000, 3000, 4000]
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert [v for _, v in h["val_loss"]] == [r["val_loss"] for r in records if "val_loss" in r]
    assert {"val_f1/setosa", "test_f1/virginica", "test_accuracy", "system/samples_per_s"} <= set(h)
    files = artifacts(server, run.info.run_id)
    assert {"model.json", "run.json", "model/model.pt", "model/model.json", "report/val/classes.csv"} <= set(files)
    (version,) = client(server).search_model_versions("name='tests-model'")
    assert version.run_id == run.info.run_id and float(version.tags["best_accuracy"]) > 0.5
    assert json.loads(Path(out, "run.json").read_text())["attempts"][-1]["mlflow_run_id"] == run.info.run_id


def test_a_run_killed_and_resumed_sends_every_point_once_as_the_uninterrupted_run(server, uninterrupted, tmp_path):
    """SIGKILL at whatever moment the kill lands (before a checkpoint, after one, while points are in flight): the
    MLflow run's histories end exactly as the uninterrupted run's, one point per step."""
    out = tmp_path / "B"
    args = [*JOB, *RUN, *sets(f"track.mlflow={server}"), "--output", str(out)]
    for evaluations in (1, 2, 3):
        proc = start_job(*args, start_new_session=True)
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= evaluations):
            time.sleep(0.02)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended first: only a run that finished may do that
            assert proc.wait() == 0, f"the run ended by itself with {proc.returncode} before the kill"
        proc.wait()
    r = run_job(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = runs_named(server, "B")
    h = histories(server, run.info.run_id)
    a = uninterrupted[1]["histories"]
    assert computed(h) == computed(a)
    assert {k: [s for s, _ in v] for k, v in h.items()} == {k: [s for s, _ in v] for k, v in a.items()}
    assert run.info.status == "FINISHED" and int(run.data.tags["job.attempts"]) >= 2


def test_a_server_that_is_down_costs_the_run_nothing_and_job_track_sends_it_later_once(server, uninterrupted, tmp_path):
    out, down = tmp_path / "C", f"http://127.0.0.1:{free_port()}"
    r = run_job(*JOB, *RUN, *sets(f"track.mlflow={down}"), "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"not yet sent to MLflow {down}" in r.stderr and f"python -m job track {out}" in r.stderr
    assert runs_named(server, "C") == []
    (out / "curves.png").unlink()  # a file gone before it could be sent: said, the rest sent
    sent = run_job("track", str(out), "--mlflow", server)
    assert sent.returncode == 0 and "curves.png" in sent.stderr, sent.stderr
    (run,) = runs_named(server, "C")
    h = histories(server, run.info.run_id)
    assert computed(h) == computed(uninterrupted[1]["histories"])
    first_point = min(m.timestamp for key in h for m in client(server).get_metric_history(run.info.run_id, key))
    assert run.info.start_time <= first_point <= run.info.end_time  # its real start, not the moment it was sent
    assert run.info.status == "FINISHED" and "model/model.pt" in artifacts(server, run.info.run_id)
    again = run_job("track", str(out), "--mlflow", server)
    assert again.returncode == 0 and "tracking: 0 points sent" in again.stderr, again.stderr
    assert histories(server, run.info.run_id) == h and len(runs_named(server, "C")) == 1
    unreachable = run_job("track", str(out))  # the server it was tracked in: still down
    assert unreachable.returncode == 4 and "connection refused" in unreachable.stderr
    assert len(unreachable.stderr.strip().splitlines()) == 1, unreachable.stderr


def test_two_processes_make_one_mlflow_run(server, tmp_path):
    out = tmp_path / "G"
    args = sets("train.epochs=400", "train.eval_every_epochs=200")
    r = run_job(*JOB, *RUN, *args, *sets(f"track.mlflow={server}"), "--nproc-per-node", "2", "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = runs_named(server, "G")
    assert run.data.params["decided.world_size"] == "2"
    assert [s for s, _ in histories(server, run.info.run_id)["val_accuracy"]] == [200, 400]


@pytest.mark.parametrize(
    "setting, env, said",
    [
        ("track.mlflow=http://", {}, "track.mlflow"),
        ("track.mlflow=ftp://host/x", {}, "track.mlflow"),
        ("train.epochs=1", {"MLFLOW_TRACKING_URI": "http://:80"}, "MLFLOW_TRACKING_URI"),
    ],
)
def test_a_malformed_tracking_uri_is_one_line_and_exit_2(tmp_path, setting, env, said):
    r = run_job(*JOB, *sets(setting), "--output", str(tmp_path / "run"), env=env)
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_tracking_without_the_mlflow_client_is_one_line_and_exit_2(tmp_path):
    """A Python where `import mlflow` fails (sys.modules marks it absent, as an uninstalled package is)."""
    code = "import sys; sys.modules['mlflow'] = None; from job.cli import main; main()"
    argv = [*JOB, *sets("track.mlflow=http://127.0.0.1:5000"), "--output", str(tmp_path / "run")]
    r = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        timeout=300,
    )
    assert r.returncode == 2 and "pip install mlflow-skinny" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_an_export_with_track_joins_the_runs_mlflow_run(server, tmp_path, image_folder):
    out = tmp_path / "P"
    photos = sets("data.kind=folder", f"data.path={image_folder}", "data.val_split=0.25", "data.image_size=32")
    photos += sets("train.epochs=1")
    r = run_job(
        "train",
        "--device",
        "cpu",
        "--config",
        "cifar10",
        *photos,
        *sets(f"track.mlflow={server}"),
        *sets("track.experiment=tests"),
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    e = run_job("export", "--model", "P", "--format", "onnx", "--track", cwd=tmp_path)  # the docs' relative form
    assert e.returncode == 0, e.stderr[-2000:]
    (run,) = runs_named(server, "P")
    assert {"export/model.onnx", "export/model.onnx.check.json"} <= set(artifacts(server, run.info.run_id))
    again = run_job("export", "--model", str(out), "--format", "onnx", "--track")
    assert again.returncode == 0 and "tracking: 0 points sent" in again.stderr, again.stderr


def same_histories(server: str, name: str, uninterrupted: dict) -> None:
    (run,) = runs_named(server, name)
    h, a = histories(server, run.info.run_id), uninterrupted[1]["histories"]
    assert computed(h) == computed(a)
    assert {k: [s for s, _ in v] for k, v in h.items()} == {k: [s for s, _ in v] for k, v in a.items()}


def test_a_server_that_answers_errors_loses_no_point_and_gets_none_twice(server, uninterrupted, tmp_path):
    """Through a proxy that fails a third of the requests (503, connection reset, delay): the run finishes (exit 0),
    and what it could not send `job track` sends, to the same histories as the uninterrupted run's."""
    from faultproxy import FaultProxy

    out = tmp_path / "E"
    with FaultProxy(server, fail_rate=0.33, seed=3, delay_s=0.2) as proxy:
        r = run_job(*JOB, *RUN, *sets(f"track.mlflow={proxy.url}"), "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert proxy.counts["requests"] > 0, proxy.counts
    sent = run_job("track", str(out), "--mlflow", server)
    assert sent.returncode == 0, sent.stderr
    same_histories(server, "E", uninterrupted)


def test_a_server_gone_mid_run_costs_the_run_nothing_and_job_track_sends_the_rest(server, uninterrupted, tmp_path):
    """The server goes away while the first val accuracy is on its way to it: the run finishes (exit 0) and says
    what waits; `job track` sends it."""
    from faultproxy import FaultProxy

    out = tmp_path / "F"
    with FaultProxy(server, kinds=("reset",), hold="val_accuracy") as proxy:
        proc = start_job(*JOB, *RUN, *sets(f"track.mlflow={proxy.url}"), "--output", str(out))
        assert proxy.held.wait(300), "the first evaluation never went to the server"
        proxy.down = True  # the request in flight and every later one: the connection reset
        proxy.release.set()
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert "not yet sent to MLflow" in stderr and "python -m job track" in stderr, stderr[-1000:]
    sent = run_job("track", str(out), "--mlflow", server)
    assert sent.returncode == 0, sent.stderr
    same_histories(server, "F", uninterrupted)


def test_a_run_in_a_bucket_with_the_server_down_is_sent_later_from_the_bucket(server, uninterrupted, bucket):
    """The journal and the files are read back from gs:// (the staging copy is gone once the run ends)."""
    url, down = bucket.url("runs/D"), f"http://127.0.0.1:{free_port()}"
    r = run_job(*JOB, *RUN, *sets(f"track.mlflow={down}"), "--output", url)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "track.jsonl" in bucket.names("runs/D")
    sent = run_job("track", url, "--mlflow", server)
    assert sent.returncode == 0, sent.stderr
    same_histories(server, "D", uninterrupted)
    (run,) = runs_named(server, "D")
    assert run.data.tags["job.run"] == url and "model/model.pt" in artifacts(server, run.info.run_id)


def test_the_same_command_on_a_finished_run_sends_what_its_end_did_not(server, uninterrupted, tmp_path):
    """A run whose end could not reach the server (down, or the process killed while it sent): running the same
    command again finds it complete and sends what waits."""
    out, down = tmp_path / "K", f"http://127.0.0.1:{free_port()}"
    r = run_job(*JOB, *RUN, *sets(f"track.mlflow={down}"), "--output", str(out))
    assert r.returncode == 0 and "not yet sent" in r.stderr, r.stderr[-1000:]
    again = run_job(*JOB, *RUN, *sets(f"track.mlflow={server}"), "--output", str(out))
    assert again.returncode == 0 and "is complete" in again.stderr, again.stderr[-1000:]
    assert "points sent" in again.stderr, again.stderr[-1000:]
    same_histories(server, "K", uninterrupted)
    (run,) = runs_named(server, "K")
    assert run.info.status == "FINISHED" and "model/model.pt" in artifacts(server, run.info.run_id)


@contextlib.contextmanager
def second_server(root: Path):
    """Another real MLflow server, as the session's is started."""
    root.mkdir()
    url = f"http://127.0.0.1:{free_port()}"
    proc = start_mlflow_server(root, int(url.rsplit(":", 1)[1]))
    try:
        wait_healthy(url, proc, root / "server.log")
        yield url
    finally:
        stop_group(proc)


def test_a_run_continued_with_another_server_gets_a_run_there_with_its_whole_history(server, tmp_path):
    """track.mlflow changed on resume (and train.epochs raised): the second server gets a run of its own with every
    point from the first step, the raised setting recorded with the step it changed at; the first server's run is
    left as it was, and `job track` sends to the server the config names."""
    out = tmp_path / "M"
    first = sets("data.val_split=0.2", "train.epochs=2000", "train.checkpoint_every_epochs=1000")
    r = run_job(*JOB, *first, *sets("track.experiment=tests", f"track.mlflow={server}"), "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    (before,) = runs_named(server, "M")
    h_before = histories(server, before.info.run_id)
    with second_server(tmp_path / "mlflow2") as other:
        r = run_job(*JOB, *RUN, *sets(f"track.mlflow={other}"), "--output", str(out))
        assert r.returncode == 0 and f"tracking: sent to MLflow {other}" in r.stderr, r.stderr[-2000:]
        (run,) = runs_named(other, "M")
        h = histories(other, run.info.run_id)
        assert [s for s, _ in h["train/loss"]] == list(range(200, 4001, 200))
        assert [s for s, _ in h["val_accuracy"]] == [1000, 2000, 3000, 4000]
        assert h["val_loss"][:2] == h_before["val_loss"]  # the first server's points, sent from the run's records
        assert run.info.status == "FINISHED" and "model/model.pt" in artifacts(other, run.info.run_id)
        assert run.data.params["train.epochs"] == "2000"
        assert run.data.params["train.epochs/at_step_2000"] == "4000"
        assert run.data.tags["job.changed/train.epochs"].startswith("4000 at step 2000")
        again = run_job("track", str(out))
        assert again.returncode == 0 and "tracking: 0 points sent" in again.stderr and other in again.stderr, (
            again.stderr
        )
    (after,) = runs_named(server, "M")
    assert histories(server, after.info.run_id) == h_before and after.data.params == before.data.params
    assert after.info.status == before.info.status == "FINISHED"


def test_a_reconnecting_sender_reads_no_metric_history_back(server, uninterrupted):
    """`job track` on a run the server holds whole: what was sent is known without asking for any metric's
    history (a 1,000-class run has 2,000 of them)."""
    from faultproxy import FaultProxy

    out, _ = uninterrupted
    with FaultProxy(server, hold="get-history") as proxy:
        proxy.release.set()  # nothing waits: `held` only tells whether a history was asked for
        r = run_job("track", out, "--mlflow", proxy.url)
    assert r.returncode == 0 and "tracking: 0 points sent" in r.stderr, r.stderr
    assert not proxy.held.is_set(), "a metric's history was read back"


@pytest.mark.parametrize("path, said", [("", "connection refused"), ("/nothing", "404")])
def test_a_server_that_refuses_or_answers_404_is_said_in_the_start_lines(server, tmp_path, path, said):
    uri = f"http://127.0.0.1:{free_port()}" if not path else server + path
    r = run_job(*JOB, *sets("train.epochs=200", f"track.mlflow={uri}"), "--output", str(tmp_path / "R"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step:"))
    assert any(said in line and uri in line for line in lines[:first_step]), r.stderr


def test_a_sweep_worker_with_the_server_down_starts_its_first_trial_within_seconds(tmp_path):
    """The study's MLflow run is looked up without the client's retries (4 minutes by default): the worker says the
    server is down and starts its first trial at once."""
    down = f"http://127.0.0.1:{free_port()}"
    space = tmp_path / "space.yaml"
    space.write_text("trials: 1\nsampler: {name: random, seed: 0}\nspace:\n  optim.lr: [0.01, 0.1]\n")
    args = ["sweep", str(space), "--output", str(tmp_path / "S"), "--device", "cpu", "--config", "iris"]
    w = start_job(*args, *sets("data.val_split=0.2", "train.epochs=200", f"track.mlflow={down}"))
    t0, said = time.monotonic(), []
    for line in w.stderr:  # up to the first trial's line, timed from the worker's start
        said.append(line)
        if line.startswith("trial 0"):
            break
    first_trial = time.monotonic() - t0
    rest = w.communicate(timeout=180)[1]
    assert w.returncode == 0, "".join(said) + rest
    assert first_trial < 40, f"{first_trial:.0f} s before the first trial: " + "".join(said)
    assert "connection refused" in "".join(said), said


def test_a_tracked_sweep_holds_its_space_best_trial_and_files(server, tmp_path):
    """The study's MLflow run: the space, metric and direction, the best trial's params and value (one point, however
    many workers find the study done), trials.csv, best.json and params.png; its children named after the study."""
    space, out = tmp_path / "space.yaml", tmp_path / "S"
    space.write_text("name: lr-a\ntrials: 2\nsampler: {name: random, seed: 0}\nspace:\n  optim.lr: [0.01, 0.1]\n")
    args = ["sweep", str(space), "--output", str(out), "--device", "cpu", "--config", "iris"]
    args += sets("data.val_split=0.2", "train.epochs=200", f"track.mlflow={server}", "track.experiment=sweep-track")
    for _ in range(2):  # the second worker finds the study done
        r = run_job(*args)
        assert r.returncode == 0, r.stderr[-2000:]
    c = client(server)
    runs = c.search_runs([c.get_experiment_by_name("sweep-track").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    best = json.loads((out / "best.json").read_text())
    p = parent.data.params
    assert p["sweep.metric"] == "val_accuracy" and p["sweep.direction"] == "maximize" and p["sweep.trials"] == "2"
    assert json.loads(p["sweep.space.optim.lr"]) == [0.01, 0.1]
    assert float(p["best.optim.lr"]) == best["values"]["optim.lr"]
    points = c.get_metric_history(parent.info.run_id, "best_val_accuracy")
    assert [m.value for m in points] == [best["metric"]["val_accuracy"]]
    assert {"trials.csv", "best.json", "params.png"} <= set(artifacts(server, parent.info.run_id))
    children = sorted(r.info.run_name for r in runs if r is not parent)
    assert children == ["lr-a-0", "lr-a-1"]
    more = [a if a != str(out) else str(tmp_path / "T") for a in args] + ["--trials", "1"]  # another study named lr-a
    r = run_job(*more)
    assert r.returncode == 0, r.stderr[-2000:]
    names = [r.info.run_name for r in c.search_runs([c.get_experiment_by_name("sweep-track").experiment_id])]
    assert len(names) == len(set(names)) == 5, names  # its run and trial named apart from the first's


def test_a_trial_sent_late_is_its_studys_child_where_the_server_holds_the_study(server, tmp_path):
    """A sweep's trial run while the server was down, sent by job track: a child of its study's run, named after it;
    sent where the study's run is not held, a run of its own."""
    c = client(server)
    exp = c.get_experiment_by_name("tests") or c.get_experiment(c.create_experiment("tests"))
    parent = c.create_run(exp.experiment_id, run_name="late-study").info.run_id
    out, down = tmp_path / "3", f"http://127.0.0.1:{free_port()}"
    late = sets(f"track.mlflow={down}", f"track.parent_run_id={parent}", "train.epochs=20")
    r = run_job(*JOB, *RUN, *late, "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    sent = run_job("track", str(out), "--mlflow", server)
    assert sent.returncode == 0, sent.stderr
    (run,) = runs_named(server, "late-study-3")
    assert run.data.tags["mlflow.parentRunId"] == parent
    c.delete_run(parent)  # the study's run gone: the trial is sent as a run of its own
    other = tmp_path / "4"
    r = run_job(*JOB, *RUN, *late, "--output", str(other))
    sent = run_job("track", str(other), "--mlflow", server)
    assert sent.returncode == 0 and len(runs_named(server, "4")) == 1, sent.stderr


def test_a_tracking_uri_with_credentials_is_probed_without_a_traceback():
    from job.sinks.track import probe

    assert probe(f"http://user:token@127.0.0.1:{free_port()}", "tests") == ""  # urllib takes no userinfo: not probed
