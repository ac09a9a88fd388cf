"""Cloud storage for real: config, data and outputs on gs:// against a GCS emulator on loopback; the input cache;
preflight (credentials, buckets, permissions); Vertex AI's variables and FUSE paths; and a store that fails a
share of requests, or goes away in the middle of a run."""

import io
import json
import os
import signal
import time
from importlib import resources
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import free_port, run_job, sets, start_job, tar_folder, write_image_folder
from faultproxy import FaultProxy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from job.config import load_config
from job.recipe.models import build_model
from job.run import checkpoint
from job.storage.run_folder import RunDir

IRIS_SHORT = sets(
    "train.epochs=2000", "train.eval_every_epochs=500", "train.checkpoint_every_epochs=500", "train.keep_last=10"
)


def verified_checkpoints(bucket, run: str) -> list[str]:
    """Names of the run's committed checkpoints in the store, each loaded and checked against its manifest."""
    names = [n for n in bucket.names(f"{run}/checkpoints") if checkpoint.is_manifest(n)]
    for name in names:
        manifest = json.loads(bucket.fs.cat_file(f"{bucket.name}/{run}/checkpoints/{name}"))
        payload = bucket.fs.cat_file(f"{bucket.name}/{run}/checkpoints/{manifest['file']}")
        checkpoint.load_payload(payload, manifest, name)  # raises unless size, sha256 and contents hold
    pointer = json.loads(bucket.fs.cat_file(f"{bucket.name}/{run}/checkpoints/latest.json"))
    assert f"{pointer['file'][:-3]}.json" == names[-1]
    return names


def strip(text: str) -> list[dict]:
    """metrics.jsonl without its timings."""
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("samples_per_s", "wall_s")}
        for line in text.splitlines()
    ]


def scalars(url: str, tag: str) -> list[tuple[int, float]]:
    fsspec.core.url_to_fs(url)[0].invalidate_cache()  # TensorBoard lists through fsspec's cached client
    acc = EventAccumulator(url)  # TensorBoard's own reader
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_config_data_and_outputs_on_gcs_then_resume(bucket, tmp_path, cifar_folder):
    archive = tar_folder(cifar_folder, tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py")
    bucket.fs.put_file(str(archive), f"{bucket.name}/data/cifar-10-python.tar.gz")
    preset = (resources.files("job.presets") / "cifar10.yaml").read_text()
    bucket.fs.pipe_file(f"{bucket.name}/configs/c.yaml", preset.encode())
    args = [
        "train",
        "--config",
        bucket.url("configs/c.yaml"),
        "--device",
        "cpu",
        "--output",
        bucket.url("runs/c"),
        *sets(f"data.path={bucket.url('data/cifar-10-python.tar.gz')}", "train.log_every_steps=2"),
    ]
    first = run_job(*args, "--set", "train.epochs=2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "storage: gs:// as anonymous (storage emulator" in first.stderr
    assert "downloaded gs://" in first.stderr
    names = bucket.names("runs/c")
    for want in ("config.yaml", "metrics.jsonl", "model.pt", "curves.png", "checkpoints/latest.json"):
        assert want in names
    assert any(n.startswith("tensorboard/events.out.tfevents.") for n in names)
    assert not any(".probe" in n or ".uploads" in n for n in names)
    assert len(scalars(bucket.url("runs/c/tensorboard"), "test/accuracy")) == 2
    weights = torch.load(io.BytesIO(bucket.fs.cat_file(f"{bucket.name}/runs/c/model.pt")), weights_only=True)
    # the preset's CNN for CIFAR-10's 3 x 32 x 32 images and 10 classes, layer for layer
    fresh = build_model(load_config("cifar10").model, (3, 32, 32), 10).state_dict()
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in fresh.items()}
    assert all(v.dtype == torch.float32 and v.isfinite().all() for v in weights.values())
    assert verified_checkpoints(bucket, "runs/c") == ["e00001-s0000000002.json", "e00002-s0000000004.json"]

    again = run_job(*args, "--set", "train.epochs=3")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming cifar10 from epoch 2" in again.stderr
    assert "from the local cache" in again.stderr  # the archive is not downloaded twice
    metrics = bucket.fs.cat_file(f"{bucket.name}/runs/c/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == [1, 2, 3]
    assert [s for s, _ in scalars(bucket.url("runs/c/tensorboard"), "test/accuracy")] == [2, 4, 6]
    assert len(verified_checkpoints(bucket, "runs/c")) == 3
    assert not any(Path(os.environ["JOB_CACHE_DIR"], "staging").glob("*/*.yaml"))  # staging emptied at the end
    attempts = json.loads(bucket.fs.cat_file(f"{bucket.name}/runs/c/run.json"))["attempts"]
    assert [(a["exit_code"], a["from"]["epoch"], a["to"]["epoch"]) for a in attempts] == [(0, 0, 2), (0, 2, 3)]


def test_image_folder_from_gcs_is_fetched_once_then_cached(bucket, tmp_path):
    folder = write_image_folder(tmp_path / "images", n_classes=3, per_class=20, size=16, test_per_class=5)
    bucket.put_tree(folder, "images")
    args = [
        "train",
        "--config",
        "cifar10",
        "--device",
        "cpu",
        *sets("data.kind=folder", f"data.path={bucket.url('images')}", "model.name=mlp", "train.epochs=2"),
    ]
    first = run_job(*args, "--output", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "fetched 75 files of gs://" in first.stderr
    second = run_job(*args, "--output", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "75 files of gs://" in second.stderr and "from the local cache" in second.stderr
    assert strip((tmp_path / "a/metrics.jsonl").read_text()) == strip((tmp_path / "b/metrics.jsonl").read_text())
    bucket.fs.pipe_file(
        f"{bucket.name}/images/train/class0/0000.png", min((folder / "train/class1").iterdir()).read_bytes()
    )
    third = run_job(*args, "--output", str(tmp_path / "c"))
    assert third.returncode == 0 and "fetched 75 files" in third.stderr  # a changed object: fetched anew


def test_missing_bucket_is_refused_by_preflight(bucket, tmp_path):
    t0 = time.time()
    r = run_job("train", "--device", "cpu", "--output", "gs://no-such-bucket-here/run", cwd=tmp_path)
    assert r.returncode == 4, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "bucket no-such-bucket-here does not exist" in line and "Traceback" not in r.stderr
    assert "device" not in r.stderr  # refused before the device or the data were touched
    assert time.time() - t0 < 30
    data = run_job("train", "--device", "cpu", *sets("data.path=gs://no-data-bucket/iris.csv"), cwd=tmp_path)
    assert data.returncode == 4 and "bucket no-data-bucket does not exist" in data.stderr
    missing = run_job("train", "--device", "cpu", *sets(f"data.path={bucket.url('none.csv')}"), cwd=tmp_path)
    assert missing.returncode == 3 and "no such file" in missing.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent/key.json"}, "no such key file"),
        ({}, "no Google Cloud credentials found"),
        ({"GOOGLE_APPLICATION_CREDENTIALS": "{tmp}/key.json"}, "GOOGLE_APPLICATION_CREDENTIALS={tmp}/key.json: "),
    ],
    ids=["missing key file", "no credentials at all", "malformed key file"],
)
def test_missing_credentials_are_one_line_exit_4(tmp_path, env, needle):
    (tmp_path / "key.json").write_text('{"type": "service_account", "client_email": ')  # cut short
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    needle = needle.replace("{tmp}", str(tmp_path))
    closed = f"127.0.0.1:{free_port()}"  # no metadata server: connections are refused at once
    full = {
        "STORAGE_EMULATOR_HOST": "",
        "HOME": str(tmp_path),
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
        "GCE_METADATA_HOST": closed,
        "GCE_METADATA_IP": closed,
        "GOOGLE_APPLICATION_CREDENTIALS": "",
        **env,
    }
    t0 = time.time()
    r = run_job("train", "--device", "cpu", "--output", "gs://some-bucket/run", cwd=tmp_path, env=full)
    assert r.returncode == 4 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and time.time() - t0 < 30
    assert "not a usable key file" in r.stderr or "key.json" not in needle


def test_permission_denied_is_one_line_exit_4(bucket, gcs_server, tmp_path):
    with FaultProxy(gcs_server, fail_rate=1.0, kinds=("403",)) as proxy:
        r = run_job("train", "--output", bucket.url("run"), cwd=tmp_path, env={"STORAGE_EMULATOR_HOST": proxy.url})
    assert r.returncode == 4, r.stderr
    assert "permission denied" in r.stderr and "Traceback" not in r.stderr


def test_vertex_ai_output_variables(bucket, tmp_path):
    env = {
        "AIP_CHECKPOINT_DIR": bucket.url("job/checkpoints/"),
        "AIP_MODEL_DIR": bucket.url("job/model/"),
        "AIP_TENSORBOARD_LOG_DIR": bucket.url("job/logs/"),
    }
    r = run_job("train", "--device", "cpu", *IRIS_SHORT, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Vertex AI (AIP_* variables): the run goes to gs://" in r.stderr
    names = bucket.names("job")
    assert "model/model.pt" in names and "checkpoints/config.yaml" in names and "checkpoints/metrics.jsonl" in names
    assert any(n.startswith("logs/events.out.tfevents.") for n in names)
    assert "checkpoints/checkpoints/latest.json" in names and not (tmp_path / "runs").exists()
    assert len(scalars(bucket.url("job/logs"), "test/accuracy")) == 4


def test_gs_data_is_read_through_a_fuse_mount_when_there_is_one(bucket, tmp_path):
    iris = (resources.files("job.presets") / "iris.csv").read_bytes()
    bucket.fs.pipe_file(f"{bucket.name}/data/iris.csv", b"not,the,table\n")  # what gcsfs would read
    mounted = tmp_path / "gcs" / bucket.name / "data" / "iris.csv"
    mounted.parent.mkdir(parents=True)
    mounted.write_bytes(iris)
    r = run_job(
        "train",
        "--device",
        "cpu",
        *IRIS_SHORT,
        *sets(f"data.path={bucket.url('data/iris.csv')}"),
        "--output",
        str(tmp_path / "run"),
        env={"JOB_GCS_FUSE_ROOT": str(tmp_path / "gcs")},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"through the Cloud Storage FUSE mount {mounted}" in r.stderr


def test_run_completes_with_a_fifth_of_requests_failing(bucket, gcs_server, tmp_path):
    with FaultProxy(gcs_server, fail_rate=0.2, seed=7, delay_s=0.2) as proxy:
        r = run_job(
            "train",
            "--device",
            "cpu",
            *IRIS_SHORT,
            "--output",
            bucket.url("run"),
            env={"STORAGE_EMULATOR_HOST": proxy.url},
            timeout=600,
        )
        counts = dict(proxy.counts)
    assert r.returncode == 0, r.stderr[-3000:]
    assert counts["503"] + counts["reset"] >= 5, counts
    assert len(verified_checkpoints(bucket, "run")) == 4
    metrics = bucket.fs.cat_file(f"{bucket.name}/run/metrics.jsonl").decode().splitlines()
    assert len(metrics) == 4
    assert len(scalars(bucket.url("run/tensorboard"), "test/accuracy")) == 4


def test_store_down_exits_4_keeps_the_checkpoint_then_the_same_command_continues(bucket, gcs_server, tmp_path):
    """The store goes away right after the run's first pointer reached it (the proxy's own trigger, the same point on
    any machine) with eleven commits still to come: the run ends with exit 4, its newer checkpoints kept locally,
    and the same command, with the store back, sends them and ends as an uninterrupted run does."""
    args = [
        "train",
        "--device",
        "cpu",
        *sets(
            "train.epochs=12000",
            "train.eval_every_epochs=1000",
            "train.checkpoint_every_epochs=1000",
            "output.upload_timeout_seconds=2",
        ),
    ]
    reference = run_job(*args, "--output", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    proxy = FaultProxy(gcs_server, kinds=("reset",), down_after="run/checkpoints/latest.json").start()
    try:
        failed = run_job(*args, "--output", bucket.url("run"), env={"STORAGE_EMULATOR_HOST": proxy.url})
        assert failed.returncode == 4, failed.stderr[-3000:]
        assert "the store stopped taking the run's files" in failed.stderr and "Traceback" not in failed.stderr
        stored = json.loads(bucket.fs.cat_file(f"{bucket.name}/run/checkpoints/latest.json"))
        staging = RunDir(bucket.url("run")).local
        kept = json.loads((staging / "checkpoints/latest.json").read_text())
        assert stored["epoch"] == 1000 and kept["step"] > stored["step"]  # newer work, kept on this machine
        wrote_results = (staging / "model.pt").is_file()
        never = run_job(*args, "--resume", "never", "--output", bucket.url("run"))
        assert never.returncode == 2 and "left files on this machine" in never.stderr  # and they stay
        assert json.loads((staging / "checkpoints/latest.json").read_text()) == kept
        proxy.down, proxy.down_after = False, None
        again = run_job(*args, "--output", bucket.url("run"), env={"STORAGE_EMULATOR_HOST": proxy.url})
    finally:
        proxy.stop()
    assert again.returncode == 0, again.stderr[-2000:]
    assert "uploading" in again.stderr  # what the first attempt kept on this machine, then the rest of the run
    # Where the first attempt stopped is a race between the loop and the uploader giving up: after any commit (the
    # last one included, its results then still to write), or in the end's wait for the uploads, its results written.
    if wrote_results:  # sent now; there is nothing left to train
        assert "is complete: 12000 of 12000 epochs done" in again.stderr
    else:
        assert f"from epoch {kept['epoch']}, step {kept['step']}" in again.stderr
    ref = torch.load(tmp_path / "reference/model.pt", weights_only=True)
    got = torch.load(io.BytesIO(bucket.fs.cat_file(f"{bucket.name}/run/model.pt")), weights_only=True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert strip((tmp_path / "reference/metrics.jsonl").read_text()) == strip(
        bucket.fs.cat_file(f"{bucket.name}/run/metrics.jsonl").decode()
    )
    verified_checkpoints(bucket, "run")


def test_sigterm_waits_for_the_uploads_then_exits_75(bucket, gcs_server):
    with FaultProxy(gcs_server, fail_rate=1.0, kinds=("delay",), delay_s=0.3) as proxy:  # a slow store
        proc = start_job(
            "train",
            "--device",
            "cpu",
            *sets("train.epochs=100000000", "train.checkpoint_every_epochs=100000000"),  # ends by the signal alone
            "--output",
            bucket.url("run"),
            env={"STORAGE_EMULATOR_HOST": proxy.url},
        )
        deadline = time.time() + 300
        while "metrics.jsonl" not in bucket.names("run") and time.time() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-2000:]
    pointer = json.loads(bucket.fs.cat_file(f"{bucket.name}/run/checkpoints/latest.json"))
    assert pointer["step"] > 0 and verified_checkpoints(bucket, "run")


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 75), ("SIGINT", 130)])
def test_a_signal_while_a_bucket_is_read_stops_at_once_with_its_code(bucket, gcs_server, tmp_path, sig, code):
    """A preemption while a bucket's images are fetched: the request for one image is held by the proxy (the state the
    test waits for), the signal sent, and the run ends at once with the signal's code, not a storage error's 4."""
    root = write_image_folder(tmp_path / "imgs", per_class=4)
    bucket.put_tree(root, "imgs")
    out = tmp_path / "run"
    over = sets("data.kind=folder", f"data.path={bucket.url('imgs')}", "data.image_size=32", "data.cache=false")
    with FaultProxy(gcs_server, hold="imgs/train/class1/0005.png") as proxy:
        proc = start_job(
            "train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over,
            env={"STORAGE_EMULATOR_HOST": proxy.url},
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while not proxy.held.wait(0.2):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            proc.send_signal(getattr(signal, sig))
            err = proc.communicate(timeout=120)[1]
        finally:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert f"stopped by {sig} before training began" in last and "Traceback" not in err and "cannot read" not in err
