"""What a run costs and what a stop throws away (run/cost.py, run/attempts.py): run.json's device hours, start-up and
lost seconds per attempt, the cost totals with a price, and train.budget, which ends a run cleanly at a checkpoint
and is continued by a larger one. Real processes: an Iris run killed by SIGKILL, its lost seconds measured outside."""

from __future__ import annotations

import json
import math
import time

import pytest
from conftest import assert_same_run, invoke, pointer, run_job, scalars, sets, start_job

from job.config.budget import parse_budget
from job.run.attempts import iso
from job.run.cost import describe, price_of, totals

ARGS = ["--device", "cpu", *sets("train.eval_every_epochs=1000", "train.log_every_steps=500")]
PRICE = 2.5


def run_json(out) -> dict:
    return json.loads((out / "run.json").read_text())


def assert_cost_adds_up(doc: dict, price: float) -> None:
    attempts, cost = doc["attempts"], doc["cost"]
    for a in attempts:
        for key in ("device_hours", "lost_s", "startup_s"):
            assert isinstance(a[key], (int, float)) and a[key] >= 0, (key, a)
        assert a["device_hours"] > 0
    assert math.isclose(cost["device_hours"], sum(a["device_hours"] for a in attempts), rel_tol=1e-3, abs_tol=1e-6)
    assert math.isclose(cost["spent"], cost["device_hours"] * price, rel_tol=1e-3, abs_tol=1e-6)
    assert cost["price_per_device_hour"] == price


def committed(out) -> int:
    try:
        return pointer(str(out))["step"]
    except (FileNotFoundError, ValueError, KeyError):
        return -1


def test_a_killed_attempts_lost_seconds_match_the_time_since_its_last_commit_measured_outside(tmp_path):
    """SIGKILL some time after a commit: the next attempt reports the killed one's lost seconds as the time from
    that commit (seen here as the pointer's change) to the kill, within 1.5 s on a busy machine (the heartbeat is
    0.5 s); then the cost adds up over both attempts."""
    out = tmp_path / "run"
    args = [*ARGS, *sets("train.checkpoint_every_epochs=20000", f"train.price_per_device_hour={PRICE}")]
    proc = start_job("train", *args, *sets("train.epochs=100000000"), "--output", str(out))
    deadline, step, seen_at = time.time() + 300, -1, 0.0
    while time.time() < deadline and proc.poll() is None and step < 0:
        step, seen_at = committed(out), time.time()
        time.sleep(0.01)
    assert step > 0 and proc.poll() is None, "no first commit within 300 s"
    first, first_at = step, seen_at
    while time.time() < deadline and proc.poll() is None and step == first:
        step, seen_at = committed(out), time.time()
        time.sleep(0.01)
    assert step > first and proc.poll() is None, "no second commit within 300 s"
    # the kill lands 40% of the way to the next commit, the interval measured here (on a fast machine commits come
    # every two seconds or so: a fixed wait could meet the next one)
    kill_at = seen_at + min(3.0, 0.4 * (seen_at - first_at))
    while time.time() < kill_at:
        time.sleep(0.01)
    proc.kill()
    killed_at = time.time()
    proc.communicate()
    truth = killed_at - seen_at
    last = committed(out)
    assert last == step, "a commit landed as the run was killed: the mark is unknown"
    done = run_job("train", *args, *sets(f"train.epochs={last + 1000}"), "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    doc = run_json(out)
    killed, finished = doc["attempts"]
    print(f"lost seconds of the killed attempt: reported {killed['lost_s']:.3f}, measured outside {truth:.3f}")
    assert killed["ended"] is None and killed["exit_code"] is None
    assert killed["committed"]["step"] == last and killed["last_seen"]["by"] == "heartbeat"
    assert abs(killed["lost_s"] - truth) <= 1.5
    # its device time runs from its process's start to its last sign of life, past its last commit
    assert killed["device_hours"] * 3600 >= killed["startup_s"] + killed["lost_s"] - 0.01
    assert finished["lost_s"] == 0 and finished["exit_code"] == 0  # its last commit is its end: nothing lost
    assert_cost_adds_up(doc, PRICE)
    assert doc["cost"]["projected"] == doc["cost"]["spent"]  # the run is done: what it will have cost is what it did
    assert f"; {describe(doc['cost'])}; outputs in" in done.stderr.splitlines()[-1], done.stderr[-500:]
    tb = dict(scalars(str(out), "cost/device_hours"))
    assert math.isclose(tb[last + 1000], doc["cost"]["device_hours"], rel_tol=1e-3)  # the same figure, at the end
    assert not (out / ".alive").exists()  # the sign of life goes with the attempt that ends


def test_an_attempt_killed_on_another_machine_is_bounded_by_the_heartbeat_of_the_lease_it_left(tmp_path):
    """No sign of life here (the machine went away with it): the stale lease's last heartbeat bounds the stop."""
    out, beat = tmp_path / "run", time.time() - 100
    out.mkdir()
    killed = {
        "started": iso(beat - 17),
        "ended": None,
        "exit_code": None,
        "host": "gone-7",
        "pid": 4242,
        "devices": [{"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}],
        "world_size": 2,
        "from": {"epoch": 0, "step": 0},
        "to": None,
        "startup_s": 3.0,
        "device_hours": 0.0,
        "lost_s": None,
        "committed": {"time": iso(beat - 7), "epoch": 3, "step": 30},
    }
    (out / "run.json").write_text(json.dumps({"attempts": [killed], "tracking": {"kept": True}}))
    lease = {"host": "gone-7", "machine": "gone-7 pid:[1]", "pid": 4242, "pid_started": beat - 20, "every": 1.0}
    (out / "lease.json").write_text(json.dumps({**lease, "heartbeat": beat, "started": iso(beat - 20), "token": "t"}))
    prices = "train.price_per_device_hour={cpu: 0.5, H100: 3.0}"
    done = run_job("train", *ARGS, *sets("train.epochs=1000", prices), "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    doc = run_json(out)
    first, second = doc["attempts"]
    assert first["last_seen"] == {"time": iso(beat), "by": "lease"} and first["lost_s"] == pytest.approx(7.0, abs=0.01)
    assert first["device_hours"] == pytest.approx(2 * 20 / 3600, abs=1e-5)  # two devices, from its process's start
    assert doc["cost"]["spent"] == pytest.approx(first["device_hours"] * 3.0 + second["device_hours"] * 0.5, rel=1e-3)
    assert doc["tracking"] == {"kept": True}  # what else run.json holds is kept


def test_a_budget_ends_the_run_at_a_checkpoint_and_a_larger_one_continues_it(tmp_path):
    """A budget spent by the first commit (0.1 s of device time: the imports alone take more) ends the run there,
    exit 0, saying why; the same command again says the budget is spent and writes nothing; a larger budget
    continues it to the uninterrupted run's result."""
    args = [
        *ARGS,
        *sets("train.epochs=3000", "train.checkpoint_every_epochs=1000", f"train.price_per_device_hour={PRICE}"),
    ]
    reference = run_job("train", *args, "--output", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = tmp_path / "run"
    small = run_job("train", *args, *sets("train.budget=0.1s"), "--output", str(out))
    assert small.returncode == 0, small.stderr[-2000:]
    last = small.stderr.splitlines()[-1]
    assert last.startswith("stopped by the budget after epoch 1000 at step 1000: train.budget=0.1s:"), last
    assert "the same command with a larger train.budget continues it" in last
    assert pointer(str(out))["step"] == 1000 and not (out / "model.pt").exists()
    doc = run_json(out)
    [attempt] = doc["attempts"]
    assert attempt["exit_code"] == 0 and attempt["stopped"] == "budget" and attempt["budget"] == "0.1s"
    assert attempt["lost_s"] == 0 and "train.budget=0.1s" in doc["note"]
    assert_cost_adds_up(doc, PRICE)
    assert doc["cost"]["projected"] == pytest.approx(doc["cost"]["spent"] * 3, rel=1e-3)  # a third of the steps done
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = run_job("train", *args, *sets("train.budget=0.1s"), "--output", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.splitlines()[-1].startswith("the run has spent its budget (train.budget=0.1s:"), again.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing new written
    larger = run_job("train", *args, *sets("train.budget=1h"), "--output", str(out))
    assert larger.returncode == 0, larger.stderr[-2000:]
    assert "resuming iris from epoch 1000" in larger.stderr and "done: 3000 epochs" in larger.stderr
    assert_same_run(str(tmp_path / "reference"), str(out))
    doc = run_json(out)
    assert [a["exit_code"] for a in doc["attempts"]] == [0, 0] and "note" not in doc
    assert_cost_adds_up(doc, PRICE)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("train.price_per_device_hour=-1", "train.price_per_device_hour: expected a price of 0 or more"),
        ("train.price_per_device_hour={cpu: x}", "got 'x' for cpu"),
        ("train.budget=$5", "train.budget: money needs a price: set train.price_per_device_hour"),
        ("train.budget=soon", "train.budget: expected device time such as 2h30m or 90m, or money such as $12.50"),
        ("train.budget=0m", "train.budget: expected a budget above 0"),
    ],
)
def test_a_bad_price_or_budget_is_one_line_and_exit_2(tmp_path, setting, said):
    code, err = invoke(["train", *ARGS, "--set", setting, "--output", str(tmp_path / "run")])
    assert code == 2 and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "run").exists()


def test_a_money_budget_needs_a_price_for_the_device_it_runs_on(tmp_path):
    prices = "train.price_per_device_hour={cuda: 3.0, H100: 4.0}"
    code, err = invoke(["train", *ARGS, *sets(prices, "train.budget=$1"), "--output", str(tmp_path / "run")])
    assert code == 2 and err.count("\n") == 1, err
    assert "train.budget=$1: train.price_per_device_hour has no price for this device" in err


def test_prices_by_device_and_the_totals():
    h100 = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    cpu = {"type": "cpu", "name": "x86_64"}
    prices = {"cpu": 0.1, "h100": 3.0, "NVIDIA H100 80GB HBM3": 2.0, "NVIDIA": 9.0}
    assert price_of(prices, h100) == 2.0  # the exact name first
    assert price_of({"H100 80GB": 3.0, "H100": 9.0}, h100) == 3.0  # then the longest part of the name
    assert price_of(prices, cpu) == 0.1 and price_of({"cuda": 1.0}, cpu) is None and price_of(1.5, cpu) == 1.5
    attempts = [{"device_hours": 2.0, "devices": [h100]}, {"device_hours": 1.0, "devices": [cpu]}]
    assert totals(attempts, prices, 50, 200) == {
        "device_hours": 3.0,
        "price_per_device_hour": prices,
        "spent": 4.1,
        "projected": 16.4,
    }
    assert totals(attempts, {"cpu": 1.0}) == {  # a device without a price: the run's cost is unpriced
        "device_hours": 3.0,
        "price_per_device_hour": {"cpu": 1.0},
        "spent": None,
        "projected": None,
    }
    assert describe({"device_hours": 2.5, "spent": 6.25}) == "2.5 device hours, $6.25 spent"
    assert describe({"device_hours": 0.5 / 3600, "spent": None}) == "0.5s of device time"
    assert parse_budget("$12.50").amount == 12.5 and parse_budget("2h30m").amount == 2.5
    assert not parse_budget("90m").money and parse_budget(" $3 ").money
