"""Bad input of every kind: one clear line, the documented exit code, no traceback, and nothing already in the
output folder changed. Cases run through the real command line (`job.cli.main`) in this process, which keeps
the suite fast; test_e2e_train.py runs a few of them as separate processes too."""

from __future__ import annotations

import hashlib
import os
import pickle
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    encode,
    invoke,
    pattern_images,
    sets,
    start_job,
    tar_folder,
    write_cifar_batches,
    write_image_folder,
)

from job.errors import JobError


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A small finished Iris run: the output folder every case must leave as it found it."""
    out = tmp_path_factory.mktemp("template") / "run"
    code, err = invoke(
        [
            "train",
            "--device",
            "cpu",
            *sets("train.epochs=200", "train.eval_every_epochs=100", "train.checkpoint_every_epochs=100"),
            "--output",
            str(out),
        ]
    )
    assert code == 0, err
    return out


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def truncated(archive: Path) -> Path:
    cut = archive.with_name("cut-" + archive.name)
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    return cut


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def corrupt_all_checkpoints(run: Path) -> None:
    for p in (run / "checkpoints").glob("*.pt"):
        p.write_bytes(p.read_bytes()[:50])


def iris(*overrides: str) -> list[str]:
    return ["train", "--device", "cpu", *sets(*overrides)]


def cifar(path, *overrides: str) -> list[str]:
    return ["train", "--config", "cifar10", "--device", "cpu", *sets(f"data.path={path}", *overrides)]


def folder(path, *overrides: str) -> list[str]:
    return cifar(path, "data.kind=folder", *overrides)


def weights_of_another_model(tmp: Path) -> Path:
    torch.save({"w": torch.ones(1)}, tmp / "w.pt")
    return tmp / "w.pt"


def cifar_with(tmp: Path, name: str, data: bytes) -> Path:
    batches = write_cifar_batches(tmp / "cifar-10-batches-py", n_train=50, n_test=20)
    (batches / name).write_bytes(data)
    return batches


def images_with(tmp: Path, rel: str, data: bytes) -> Path:
    root = write_image_folder(tmp / "imgs", per_class=3, size=16)
    write(root / rel, data)
    return root


def malicious_batch() -> bytes:
    return pickle.dumps({b"data": Evil(), b"labels": [0]}, protocol=2)


# Each case: (name, build(tmp, run) -> argv, exit code, text the one line must hold). `run` is a copy of the
# finished run, passed as --output unless the argv names its own.
CASES = [
    # config and command line: exit 2
    (
        "unknown top key",
        lambda t, r: ["train", "--config", str(write(t / "c.yaml", "bogus: 1\n"))],
        2,
        "bogus: unknown key",
    ),
    ("unknown nested key", lambda t, r: iris("train.no_such_key=1"), 2, "train.no_such_key: unknown key"),
    ("misspelt key", lambda t, r: iris("optim.learning_rate=0.1"), 2, "optim.learning_rate: unknown key"),
    ("wrong type int", lambda t, r: iris("train.epochs=ten"), 2, "train.epochs: input should be a valid integer"),
    ("wrong type float", lambda t, r: iris("optim.lr=fast"), 2, "optim.lr: input should be a valid number"),
    ("bad choice", lambda t, r: iris("train.precision=fp8"), 2, "train.precision: input should be"),
    ("negative lr", lambda t, r: iris("optim.lr=-0.1"), 2, "optim.lr: input should be greater than 0"),
    ("zero epochs", lambda t, r: iris("train.epochs=0"), 2, "train.epochs: input should be greater than 0"),
    ("epochs a boolean", lambda t, r: iris("train.epochs=true"), 2, "train.epochs: expected a number, got True"),
    ("lr a boolean", lambda t, r: iris("optim.lr=false"), 2, "optim.lr: expected a number, got False"),
    ("config is a folder", lambda t, r: ["train", "--config", str(t)], 2, "is a folder, not a YAML file"),
    (
        "cifar10 without its data",
        lambda t, r: ["train", "--config", "cifar10", "--output", str(r)],
        3,
        "data.path ./data/cifar-10-batches-py: no such file or folder",
    ),
    ("zero batch", lambda t, r: iris("data.batch_size=0"), 2, "data.batch_size: expected a positive integer"),
    ("split out of range", lambda t, r: iris("data.test_split=1.5"), 2, "data.test_split"),
    ("unknown model", lambda t, r: iris("model.name=transformer"), 2, "model.name: unknown model 'transformer'"),
    ("bad run name", lambda t, r: iris("name=a/b"), 2, "name: string should match pattern"),
    ("yaml syntax", lambda t, r: ["train", "--config", str(write(t / "c.yaml", "train: [1,\n"))], 2, "not valid YAML"),
    (
        "yaml not a mapping",
        lambda t, r: ["train", "--config", str(write(t / "c.yaml", "- a\n"))],
        2,
        "expected a mapping",
    ),
    ("config missing", lambda t, r: ["train", "--config", str(t / "none.yaml")], 2, "no such file"),
    ("preset misspelt", lambda t, r: ["train", "--config", "irs"], 2, "not a preset"),
    ("set without value", lambda t, r: ["train", "--set", "train.epochs"], 2, "expected key=value"),
    ("set into a value", lambda t, r: iris("train.epochs.x=1"), 2, "train.epochs is not a section"),
    ("unknown option", lambda t, r: ["train", "--epochs", "3"], 2, "No such option: --epochs"),
    ("option without value", lambda t, r: ["train", "--output", str(r), "--device"], 2, "requires an argument"),
    ("bogus device", lambda t, r: ["train", "--device", "tpu"], 2, "--device tpu"),
    ("missing gpu", lambda t, r: ["train", "--device", "cuda:7"], 2, "--device cuda:7"),
    ("resume never on a run", lambda t, r: [*iris(), "--resume", "never"], 2, "already holds a run"),
    ("resume with another model", lambda t, r: iris("model.hidden=[20]"), 2, "cannot resume: "),
    ("nesterov without momentum", lambda t, r: iris("optim.nesterov=true"), 2, "optim.nesterov"),
    ("user model not importable", lambda t, r: iris("model.name=no_such_pkg.nets:Net"), 2, "cannot import"),
    (
        "user model bad kwargs",
        lambda t, r: iris("model.name=torch.nn:Linear", "model.kwargs.bogus=1"),
        2,
        "does not take",
    ),
    ("user model not a module", lambda t, r: iris("model.name=os:getcwd"), 2, "not a torch.nn.Module"),
    ("model cannot take the data", lambda t, r: iris("model.name=cifar_cnn"), 2, "cannot take the data's inputs"),
    # data: exit 3
    ("csv missing", lambda t, r: iris(f"data.path={t}/none.csv"), 3, "no such file"),
    ("csv wrong target", lambda t, r: iris("data.target=label"), 3, "no column 'label'"),
    (
        "csv not a number",
        lambda t, r: iris("data.path=" + str(write(t / "a.csv", "x,species\noops,a\n"))),
        3,
        "not a number",
    ),
    (
        "csv ragged row",
        lambda t, r: iris("data.path=" + str(write(t / "a.csv", "x,y,species\n1,2,a\n3,b\n"))),
        3,
        "2 fields, the header has 3",
    ),
    (
        "csv header only",
        lambda t, r: iris("data.path=" + str(write(t / "a.csv", "x,species\n"))),
        3,
        "expected a header row and data rows",
    ),
    ("csv not text", lambda t, r: iris(f"data.path={write(t / 'a.csv', bytes(range(256)))}"), 3, "not UTF-8"),
    ("csv path is a folder", lambda t, r: iris(f"data.path={t}"), 3, "is a folder"),
    ("cifar empty folder", lambda t, r: cifar(write(t / "e/x.txt", "").parent), 3, "no CIFAR-10 python-version"),
    (
        "cifar truncated archive",
        lambda t, r: cifar(truncated(tar_folder(write_cifar_batches(t / "b"), t / "c.tar.gz", "b"))),
        3,
        "not a readable tar archive",
    ),
    (
        "cifar corrupt batch",
        lambda t, r: cifar(cifar_with(t, "data_batch_2", b"\x80\x02}q\x00(")),
        3,
        "data_batch_2: not a readable CIFAR-10 batch",
    ),
    (
        "cifar malicious pickle",
        lambda t, r: cifar(cifar_with(t, "data_batch_1", malicious_batch())),
        3,
        "refused to load posix.system",
    ),
    (
        "cifar wrong shape",
        lambda t, r: cifar(cifar_with(t, "test_batch", pickle.dumps({b"data": b"x", b"labels": []}))),
        3,
        "not a CIFAR-10 batch",
    ),
    ("folder empty", lambda t, r: folder(write(t / "e/train/x.txt", "").parent.parent), 3, "no images in the"),
    (
        "folder corrupt image, not skipped",
        lambda t, r: folder(
            images_with(t, "train/class0/bad.png", b"\x89PNG\r\n\x1a\n??"), "data.skip_bad_samples=false"
        ),
        3,
        "cannot decode image train/class0/bad.png",
    ),
    (
        "folder mixed sizes",
        lambda t, r: folder(images_with(t, "test/class1/big.png", encode(pattern_images(1, 1, 24)[0][0]))),
        3,
        "set data.image_size",
    ),
    (
        "folder nothing to evaluate on",
        lambda t, r: folder(shutil.rmtree(p := write_image_folder(t / "i") / "test") or p.parent),
        2,
        "nothing to evaluate on",
    ),
    (
        "folder truncated archive",
        lambda t, r: folder(truncated(tar_folder(write_image_folder(t / "i"), t / "i.tar.gz", "i"))),
        3,
        "not a readable tar archive",
    ),
    (
        "folder unknown test class",
        lambda t, r: folder(images_with(t, "test/zebra/0.png", encode(pattern_images(1, 1, 16)[0][0]))),
        3,
        "test classes without training images: zebra",
    ),
    ("data path missing", lambda t, r: folder(t / "nowhere"), 3, "no such file or folder"),
    # storage: exit 4
    (
        "output under a file",
        lambda t, r: [*iris(), "--output", str(r / "metrics.jsonl" / "sub")],
        4,
        "cannot write the output folder",
    ),
    (
        "output unknown protocol",
        lambda t, r: [*iris(), "--output", "nosuch://bucket/run"],
        4,
        "not a usable URL",
    ),
    ("config unknown protocol", lambda t, r: ["train", "--config", "nosuch://bucket/c.yaml"], 4, "cannot read"),
    # checkpoints: exit 5
    (
        "resume from a missing checkpoint",
        lambda t, r: [*iris(), "--resume", str(t / "none.pt")],
        5,
        "no such checkpoint",
    ),
    (
        "resume from a pickle",
        lambda t, r: [*iris(), "--resume", str(torch.save({"x": Evil()}, t / "e.pt") or t / "e.pt")],
        5,
        "refusing to load it",
    ),
    ("every checkpoint corrupt", lambda t, r: corrupt_all_checkpoints(r) or iris(), 5, "no checkpoint verifies"),
    (
        "evaluate garbage",
        lambda t, r: ["evaluate", "--checkpoint", str(write(t / "g.pt", b"garbage"))],
        5,
        "not a readable checkpoint",
    ),
    (
        "evaluate another program's file",
        lambda t, r: ["evaluate", "--checkpoint", str(torch.save({"w": [1, 2]}, t / "w.pt") or t / "w.pt")],
        5,
        "not a checkpoint of this job",
    ),
    (
        "evaluate bare weights without a config",
        lambda t, r: ["evaluate", "--checkpoint", str(torch.save({"w": torch.ones(1)}, t / "w.pt") or t / "w.pt")],
        5,
        "the weights alone, with no config beside it: pass --config",
    ),
    (
        "evaluate weights of another model",
        lambda t, r: ["evaluate", "--checkpoint", str(weights_of_another_model(t)), "--config", "iris"],
        5,
        "weights do not fit model mlp",
    ),
    ("evaluate nothing", lambda t, r: ["evaluate", "--checkpoint", str(t / "none")], 5, "no such checkpoint"),
    ("misspelt model name", lambda t, r: iris("model.name=resnet_9000"), 2, "did you mean resnet50"),
    (
        "torchvision weights name for the job's mlp",
        lambda t, r: iris("model.weights=DEFAULT"),
        2,
        "needs a torchvision model, and mlp is not one",
    ),
    (
        "weights of another model",
        lambda t, r: iris(f"model.weights={weights_of_another_model(t)}"),
        2,
        "are not weights of mlp: keys 4 missing (0.weight, 0.bias, 2.weight); 1 unexpected (w)",
    ),
    (
        "weights file that would run code",
        lambda t, r: iris(f"model.weights={torch.save({'0.weight': Evil()}, t / 'evil.pt') or t / 'evil.pt'}"),
        5,
        "not a state_dict file torch.load can read without running code",
    ),
    ("weights file missing", lambda t, r: iris(f"model.weights={t / 'none.pt'}"), 2, "none.pt: no such file"),
    ("frozen backbone without weights", lambda t, r: iris("model.freeze_backbone=true"), 2, "needs model.weights"),
    ("accumulate zero batches", lambda t, r: iris("train.accumulate_steps=0"), 2, "train.accumulate_steps"),
    (
        "random resized crops without a size",
        lambda t, r: cifar(write_cifar_batches(t / "c" / "cifar-10-batches-py"), "data.random_resized_crop=true"),
        2,
        "data.random_resized_crop: needs data.image_size",
    ),
    (
        "crop scale backwards",
        lambda t, r: iris("data.crop_scale=[0.9, 0.1]"),
        2,
        "data.crop_scale: expected [low, high] with 0 < low <= high <= 1",
    ),
]


@pytest.mark.parametrize("name, build, code, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, finished_run, name, build, code, needle):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    args = build(tmp_path, run)
    if "--output" not in args and args[0] == "train":
        args = [*args, "--output", str(run)]
    before = snapshot(run)
    assert {"model.pt", "metrics.jsonl", "checkpoints/latest.json"} <= before.keys()  # a run to leave alone
    got, err = invoke(args)
    lines = err.strip().splitlines()
    assert got == code, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "Traceback" not in err
    assert snapshot(run) == before


def test_the_cases_cover_every_exit_code_for_bad_input():
    """Each fault a user can cause (every exit code cli/faults.py maps but the signals' 75 and 130) has cases above,
    each named once and with its own phrase to find in the line."""
    assert {code for _, _, code, _ in CASES} == {c.exit_code for c in JobError.__subclasses__()} - {75, 130}
    names = [name for name, _, _, _ in CASES]
    assert len(names) == len(set(names))
    assert all(needle.strip() for _, _, _, needle in CASES)


def test_full_disk_is_a_storage_error_with_the_last_commit_intact(tmp_path):
    """A file-size quota (RLIMIT_FSIZE) the checkpoints outgrow: one line, exit 4, no half-committed state."""

    def quota():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, 12_000))

    out = tmp_path / "run"
    args = ["train", "--device", "cpu", "--output", str(out)]
    args += sets("model.hidden=[64, 64]", "train.epochs=300", "train.checkpoint_every_epochs=100")
    proc = start_job(*args, preexec_fn=quota)
    _, err = proc.communicate(timeout=300)
    result = subprocess.CompletedProcess(args, proc.returncode, "", err)
    assert result.returncode == 4, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "cannot write checkpoints/" in last and "too large" in last
    assert not (out / "checkpoints" / "latest.json").exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "args",
    [
        ["--device", "tpu"],
        ["--resume", "/nonexistent/x.pt"],
        ["--set", "model.name=cifar_cnn"],
        ["--set", "data.path=/nonexistent.csv"],
    ],
    ids=["device", "resume", "model", "data"],
)
def test_a_run_that_fails_to_start_leaves_no_folder_behind(tmp_path, args):
    out = tmp_path / "runs" / "iris"
    code, err = invoke(["train", "--output", str(out), *args])
    assert code in (2, 3, 5) and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "runs").exists()
