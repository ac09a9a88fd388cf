"""job/sinks/: one reporter, sinks behind it. A sink of the caller's own subscribed without touching the loop gets what
metrics.jsonl and TensorBoard get; Kubeflow Trainer's TrainJob progress is POSTed as its status server takes it (a
real HTTPS server on 127.0.0.1, its CA and a token in files, as the Trainer's status plugin puts them in the pod)."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import re
import ssl
import threading
from pathlib import Path

import pytest
from conftest import metrics, run_job, scalars, sets

from job.config import load_config
from job.run.train import run
from job.sinks.kubeflow_progress import STATUS_CA, STATUS_TOKEN, STATUS_URL, TrainJobProgress
from job.sinks.sink import EVALUATION, TESTED, WINDOW, EpochEnd, Record, Sink

STATUS_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/iris-1/status"
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


class Collected(Sink):
    """A sink a caller brings: it keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.ends: list[EpochEnd] = []
        self.epochs: list[tuple[int, int]] = []
        self.closed = 0

    def take(self, record: Record) -> None:
        self.records.append(record)

    def epoch_started(self, epoch: int, done_steps: int) -> None:
        self.epochs.append((epoch, done_steps))

    def epoch_done(self, end: EpochEnd) -> None:
        self.ends.append(end)

    def close(self) -> None:
        self.closed += 1


def test_a_sink_of_the_callers_own_gets_what_the_runs_journal_and_tensorboard_get(tmp_path):
    """Given to run(), a sink is subscribed beside the run's: it takes every evaluation as metrics.jsonl holds it,
    the test split's record, each log window as TensorBoard plots it, each epoch's start and end, and the close."""
    sink, out = Collected(), str(tmp_path / "run")
    every = ["train.eval_every_epochs=1", "train.checkpoint_every_epochs=1", "train.log_every_steps=2"]
    cfg = load_config("iris", ["train.epochs=4", "data.val_split=0.2", *every])  # a step an epoch
    summary = run(cfg, out, device_name="cpu", sinks=[sink])
    kinds = [r.kind for r in sink.records]
    evaluations = [r.values for r in sink.records if r.kind in (EVALUATION, TESTED)]
    assert evaluations == [dict(r) for r in metrics_lines(out)] and len(evaluations) == 5  # 4 evaluations, 1 test
    assert [r.split for r in sink.records if r.kind == EVALUATION] == ["val"] * 4
    windows = [(r.step, r.values["train/loss"]) for r in sink.records if r.kind == WINDOW]
    assert windows == [(s, pytest.approx(v)) for s, v in scalars(out, "train/loss")] and len(windows) == 4
    assert sink.epochs == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [(e.epoch, e.step, e.saved) for e in sink.ends] == [(n, n, True) for n in (1, 2, 3, 4)]
    assert sink.ends[-1].record == evaluations[3] and kinds[-1] == "final" and sink.closed == 1
    folder = tmp_path / "bundle"
    folder.mkdir()
    sink.ends[-1].bundle(folder, sink.ends[-1].record)  # the weights held at that end, as a model bundle
    described = json.loads((folder / "model.json").read_text())
    assert (folder / "model.pt").stat().st_size > 0
    assert described["metrics"]["val_accuracy"] == evaluations[3]["val_accuracy"] and summary["epochs"] == 4


class Counted(Sink):
    """A sink that keeps state: how many evaluations it has passed on."""

    name = "counted"

    def __init__(self) -> None:
        self.passed = 0

    def take(self, record: Record) -> None:
        self.passed += record.kind == EVALUATION

    def state_dict(self) -> dict:
        return {"passed": self.passed}

    def load_state_dict(self, state: dict) -> None:
        self.passed = state["passed"]


def test_what_each_sink_keeps_is_the_reporters_state_saved_and_restored_as_a_run_component(tmp_path):
    """The reporter is one of the run's components (job/run/state.py): each sink that keeps state is saved by its
    name, in a payload torch.load(weights_only=True) reads, and handed back to the sink of that name."""
    import io

    import torch

    from job.run.state import Components
    from job.sinks.report import Report
    from job.storage.run_folder import RunDir

    report = Report(RunDir(str(tmp_path / "a")), {}, 2, 1, 0, [Counted()])
    for step in (1, 2):
        report.evaluation(
            {"epoch": step, "step": step, "train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5, "samples_per_s": 1.0}
        )
    parts = Components()
    parts.add("sinks", report)
    buffer = io.BytesIO()
    torch.save(parts.gather(), buffer)
    payload = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert payload["sinks"] == {"counted": {"passed": 2}}
    fresh, again = Counted(), Components()
    again.add("sinks", Report(RunDir(str(tmp_path / "b")), {}, 2, 1, 0, [fresh]))
    assert again.restore(payload) == [] and fresh.passed == 2
    assert again.restore({"components": []}) == ["sinks"] and fresh.passed == 2  # an older checkpoint: as it was


def test_the_mlflow_marks_of_every_server_come_back_from_a_checkpoint_and_are_never_taken_back(tmp_path):
    """MLflow's state is what each server took (the journal's marks, by tracking URI); a checkpoint's marks join a
    journal that lacks them, and one behind the journal's changes nothing."""
    from job.sinks.track_journal import Journal
    from job.storage.run_folder import RunDir

    journal = Journal(RunDir(str(tmp_path / "a")), None)
    journal.add({"step": 3, "t": 0, "m": {"train/loss": 0.5}})
    journal.add({"run_id": "r1", "sent": "http://a:5000"})
    journal.add({"sent": "http://a:5000", "through": [3, 1]})
    journal.add({"run_id": "r2", "sent": "http://b:5000"})
    marks = journal.marks()
    assert marks == {"http://a:5000": {"run_id": "r1", "through": (3, 1)}, "http://b:5000": {"run_id": "r2"}}
    other = Journal(RunDir(str(tmp_path / "b")), None)
    other.merge(json.loads(json.dumps(marks)))  # as a checkpoint holds them: lists, not tuples
    assert other.marks() == marks
    other.merge({"http://a:5000": {"run_id": "r9", "through": [1, 0]}})  # behind: nothing taken back
    assert other.marks() == marks
    reread = Journal(RunDir(str(tmp_path / "b")), None)  # the marks are lines of track.jsonl, read by `job track`
    assert reread.marks() == marks


def metrics_lines(url: str) -> list[dict]:
    return [json.loads(line) for line in Path(url, "metrics.jsonl").read_text().splitlines()]


# --- Kubeflow Trainer's TrainJob progress, against a status server on loopback


def certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate it signed for 127.0.0.1: (ca.crt, server.crt, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-webhook-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(server.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )  # fmt: skip
    return paths


class StatusServer:
    """The Trainer's status server as the runtime sees it: HTTPS, each request kept (method, path, headers, body),
    200 with an empty object, or `answer` where set."""

    def __init__(self, folder: Path) -> None:
        self.requests: list[dict] = []
        self.answer = 200
        ca, cert, key = certificates(folder)
        self.ca = ca
        kept, server = self.requests, self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                kept.append({"method": "POST", "path": self.path, "headers": dict(self.headers), "body": body})
                self.send_response(server.answer)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_GET(self) -> None:  # noqa: N802
                kept.append({"method": "GET", "path": self.path, "headers": dict(self.headers), "body": b""})
                self.send_response(405)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}{STATUS_PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def status_server(tmp_path):
    server = StatusServer(tmp_path)
    yield server
    server.stop()


def pod_environment(tmp_path: Path, server: StatusServer) -> dict[str, str]:
    """The variables the Trainer's status plugin puts in the pod, its projected token in a file."""
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.pod-token.sig\n")  # a projected token ends with no newline; ours: stripped
    return {STATUS_URL: server.url, STATUS_TOKEN: str(token), STATUS_CA: str(server.ca)}


def check_update(request: dict) -> dict:
    """One request as the status server takes it: POST to the TrainJob's status path, the pod's token as a bearer
    token, a JSON trainerStatus in the API's shape. Returns the trainerStatus."""
    assert request["method"] == "POST" and request["path"] == STATUS_PATH
    headers = {k.lower(): v for k, v in request["headers"].items()}
    assert headers["authorization"] == "Bearer eyJhbGciOiJSUzI1NiJ9.pod-token.sig"
    assert headers["content-type"] == "application/json"
    body = json.loads(request["body"])
    assert set(body) == {"trainerStatus"}
    status = body["trainerStatus"]
    assert set(status) <= {"progressPercentage", "estimatedRemainingSeconds", "metrics", "lastUpdatedTime"}
    assert isinstance(status["progressPercentage"], int) and 0 <= status["progressPercentage"] <= 100
    if "estimatedRemainingSeconds" in status:
        assert isinstance(status["estimatedRemainingSeconds"], int) and status["estimatedRemainingSeconds"] >= 0
    assert RFC3339.match(status["lastUpdatedTime"]), status["lastUpdatedTime"]
    for metric in status["metrics"]:
        assert set(metric) == {"name", "value"} and metric["name"] and isinstance(metric["value"], str)
        assert metric["value"]
    return status


def test_the_trainjob_progress_is_posted_as_the_status_server_takes_it(tmp_path, status_server):
    """The sink alone: its first update at once, then the steps' share, the time left, the latest metrics; at its
    close 100% and no time left."""
    env = pod_environment(tmp_path, status_server)
    sink = TrainJobProgress(env[STATUS_URL], env[STATUS_TOKEN], env[STATUS_CA], total_steps=40, start_step=10, epochs=4)
    sink.take(Record(WINDOW, 20, {"train/loss": 0.75, "train/lr": 0.1}, epoch=1))
    record = {"epoch": 2, "step": 20, "train_loss": 0.7, "val_loss": 0.5, "val_accuracy": 0.875, "wall_s": 3.0}
    sink.take(Record(EVALUATION, 20, record, epoch=2, split="val"))
    sink.close()
    statuses = [check_update(r) for r in status_server.requests]
    assert len(statuses) == 2  # the first at once; the second would wait 5 s: the close's replaces it
    first, last = statuses
    assert first["progressPercentage"] == 25 and "estimatedRemainingSeconds" not in first  # 10 of 40: no pace yet
    assert {m["name"]: m["value"] for m in first["metrics"]} == {"totalEpochs": "4"}
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    named = {m["name"]: m["value"] for m in last["metrics"]}
    assert named == {
        "totalEpochs": "4",
        "currentEpoch": "2",
        "train_loss": "0.7",
        "val_loss": "0.5",
        "val_accuracy": "0.875",
    }


def test_a_server_that_refuses_costs_the_run_nothing_and_is_said_once(tmp_path, status_server, capsys):
    env = pod_environment(tmp_path, status_server)
    status_server.answer = 403
    sink = TrainJobProgress(env[STATUS_URL], env[STATUS_TOKEN], env[STATUS_CA], total_steps=10, start_step=0, epochs=1)
    sink.take(Record(WINDOW, 5, {"train/loss": 0.5, "train/lr": 0.1}, epoch=0))
    sink.close()
    said = [line for line in capsys.readouterr().err.splitlines() if "Kubeflow Trainer progress" in line]
    assert len(status_server.requests) == 2 and len(said) == 1 and "403" in said[0] and "the run goes on" in said[0]


def test_a_server_whose_certificate_the_ca_file_does_not_sign_gets_nothing(tmp_path, status_server, capsys):
    env = pod_environment(tmp_path, status_server)
    other = tmp_path / "other"
    other.mkdir()
    sink = TrainJobProgress(env[STATUS_URL], env[STATUS_TOKEN], str(certificates(other)[0]), 10, 0, 1)
    sink.close()
    assert status_server.requests == []  # the TLS handshake refused: no request reached the server
    assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err


def test_a_run_in_a_trainjob_pod_reports_its_progress_to_the_trainer(tmp_path, status_server):
    """`job train` where the status plugin set its variables: rank 0 posts the progress from the start to 100%,
    with the run's last evaluation among the metrics."""
    out = tmp_path / "run"
    done = run_job(
        "train", "--device", "cpu", "--config", "iris", "--output", str(out),
        *sets("train.epochs=3", "data.val_split=0.2"), env=pod_environment(tmp_path, status_server),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    statuses = [check_update(r) for r in status_server.requests]
    assert statuses[0]["progressPercentage"] == 0 and statuses[-1]["progressPercentage"] == 100
    named = {m["name"]: m["value"] for m in statuses[-1]["metrics"]}
    last = [r for r in metrics(str(out)) if "val_accuracy" in r][-1]  # the test record's: the chosen model's
    assert float(named["val_accuracy"]) == pytest.approx(last["val_accuracy"], abs=1e-6)
    assert named["currentEpoch"] == "3" and named["totalEpochs"] == "3"
