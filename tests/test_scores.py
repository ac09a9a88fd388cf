"""Where the model fails, at every evaluation: the confusion matrix counted on the device, per-class precision,
recall and F1 with macro and weighted averages, top-5, the weakest classes, a model that predicts one class for
everything; the training loss logged at least once an epoch."""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import invoke, metrics, scalars, sets, write_image_folder

from job.data.batches import IGNORED
from job.data.dataset import Split
from job.data.loader import BatchLoader
from job.use import scores
from job.use.evaluate import test_sums as evaluation_sums

CPU = torch.device("cpu")


def test_scores_from_a_confusion_matrix_by_hand():
    # true 0: 8 right, 2 as 1; true 1: 5 right, 5 as 0; true 2: 0 samples, predicted once (a 0 taken for it)
    confusion = torch.tensor([[7, 2, 1], [5, 5, 0], [0, 0, 0]])
    s = scores.per_class(confusion)
    assert torch.allclose(s["precision"], torch.tensor([7 / 12, 5 / 7, 0.0], dtype=torch.float64))
    assert torch.allclose(s["recall"], torch.tensor([7 / 10, 5 / 10, 0.0], dtype=torch.float64))
    f1_0, f1_1 = 2 * (7 / 12) * 0.7 / (7 / 12 + 0.7), 2 * (5 / 7) * 0.5 / (5 / 7 + 0.5)
    avg = scores.averages(confusion)
    assert abs(avg["macro_f1"] - (f1_0 + f1_1) / 2) < 1e-12  # the class with no samples left out
    assert abs(avg["weighted_f1"] - (f1_0 * 10 + f1_1 * 10) / 20) < 1e-12
    assert scores.weakest(confusion, ["a", "b", "c"]) == [("b", f1_1), ("a", f1_0)]
    assert scores.one_class(torch.tensor([[4, 0], [3, 0]])) == 0 and scores.one_class(confusion) is None
    assert scores.one_class(torch.tensor([[0, 0], [0, 5]])) is None  # a split of one class, every sample right


def test_the_confusion_matrix_is_counted_on_the_device_without_padding_or_ignored_samples():
    torch.manual_seed(0)
    x, y = torch.randint(0, 255, (37, 3, 4, 4), dtype=torch.uint8), torch.randint(0, 7, (37,))
    y[3] = IGNORED
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 7))
    loader = BatchLoader(Split(x, y), 8, CPU, CPU)
    sums = evaluation_sums(model, loader, torch.no_grad, classes=7)
    with torch.no_grad():
        out = model(x.float() / 255)
    keep = y != IGNORED
    want = torch.bincount(y[keep] * 7 + out.argmax(1)[keep], minlength=49).view(7, 7)
    assert torch.equal(sums[4:].long().view(7, 7), want) and sums[2] == 36
    top5 = (out.topk(5, 1).indices == y[:, None]).any(1)[keep].sum()
    assert sums[3] == top5 and sums[1] == torch.diag(want).sum()


ONE_CLASS = """
import torch
from torch import nn


class Stubborn(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))
        self.bias = torch.zeros(num_classes)
        self.bias[-1] = 1e4  # whatever the input: the last class

    def forward(self, x):
        return self.net(x) + self.bias.to(x.device)
"""


def test_a_run_reports_scores_logs_short_epochs_and_warns_of_one_class(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "imgs", n_classes=7, per_class=6, size=16, test_per_class=2)
    out = tmp_path / "run"
    over = sets("data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=3", "data.batch_size=8")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    rows = metrics(str(out))
    assert all({"test_macro_f1", "test_weighted_f1", "test_top5"} <= set(r) for r in rows)
    assert len(scalars(str(out), "test/macro_f1")) == 3 and len(scalars(str(out), "test/top5_accuracy")) == 3
    losses = scalars(str(out), "train/loss")  # 6 steps an epoch, log_every_steps 100: one window an epoch
    assert [s for s, _ in losses] == [6, 12, 18]
    for (_, logged), row in zip(losses, rows):
        assert abs(logged - row["train_loss"]) < 1e-5  # the window is the epoch: its mean is the evaluation's
    assert "weakest classes by F1:" in err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("test/classes/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("| class | precision | recall | f1 | support |") and text.count("\n") == 8
    (tmp_path / "stubborn.py").write_text(ONE_CLASS)
    monkeypatch.syspath_prepend(str(tmp_path))
    over = sets("data.kind=folder", f"data.path={root}", "model.name=stubborn:Stubborn", "train.epochs=1")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "s"), *over])
    assert code == 0, err
    assert "warning: the model predicts class6 for every test sample" in err
    json.dumps(rows)


def test_the_run_and_evaluate_write_the_same_report(tmp_path):
    """report/<split>/ at the end of a run, and `evaluate --report DIR` on its checkpoint: classes.csv (weakest
    first), most_confused.csv, worst.csv naming files, and the two pictures; the confusion image in TensorBoard."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = write_image_folder(tmp_path / "imgs", n_classes=4, per_class=8, size=16, test_per_class=4)
    out = tmp_path / "run"
    over = sets("data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=2", "data.batch_size=8")
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    for name in ("classes.csv", "most_confused.csv", "worst.csv", "confusion.png", "worst.png"):
        assert (out / "report" / "test" / name).stat().st_size > 0, name
    with open(out / "report" / "test" / "classes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["class"] for r in rows) == ["class0", "class1", "class2", "class3"]
    assert [float(r["f1"]) for r in rows] == sorted(float(r["f1"]) for r in rows)  # weakest first
    assert sum(int(r["support"]) for r in rows) == 16
    with open(out / "report" / "test" / "worst.csv", newline="") as f:
        worst = list(csv.DictReader(f))
    assert worst[0]["path"].startswith("test/class") and float(worst[0]["loss"]) >= float(worst[-1]["loss"])
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert "test/confusion" in events.Tags()["images"]
    code, err = invoke(["evaluate", "--checkpoint", str(out), "--device", "cpu", "--report", str(tmp_path / "rep")])
    assert code == 0, err
    for name in ("classes.csv", "worst.csv", "most_confused.csv"):
        assert (tmp_path / "rep" / "test" / name).read_bytes() == (out / "report" / "test" / name).read_bytes(), name


def test_every_evaluation_draws_its_confusion_matrix_in_tensorboard(tmp_path):
    """The confusion image at each evaluation (val here), class names on its axes, and test's once at the end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=12, size=16, test_per_class=3)
    out = tmp_path / "run"
    over = sets(
        "data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=3", "data.batch_size=8",
        "data.val_split=0.25",
    )  # fmt: skip
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    evaluated = [step for step, _ in scalars(str(out), "val/accuracy")]
    assert len(evaluated) == 3
    assert [e.step for e in events.Images("val/confusion")] == evaluated
    assert [e.step for e in events.Images("test/confusion")] == evaluated[-1:]
    first = events.Images("val/confusion")[0]
    assert first.width >= 100 and first.height >= 100


def test_the_confusion_picture_names_the_classes_and_shows_the_most_confused_of_many():
    from job.use import diagnostics

    k = 1000
    confusion = torch.eye(k, dtype=torch.long) * 5
    confusion[7, 9] = 40  # the classes most confused
    pixels = diagnostics.confusion_picture(confusion, [f"c{i}" for i in range(k)], "val")
    assert pixels.dtype == torch.uint8 and pixels.shape[2] == 3 and max(pixels.shape[:2]) <= 1200
    two = diagnostics.confusion_picture(torch.tensor([[3, 1], [0, 4]]), ["cat", "dog"], "val")
    assert two.shape[0] >= 60 and two.float().std() > 10  # drawn: not one colour


def test_a_streamed_run_names_its_worst_samples_by_shard_and_key(tmp_path):
    """A streamed split's report: worst.csv names each sample by its shard and key, worst.png shows them."""
    import csv

    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=10, size=16, test_per_class=4)
    code, err = invoke(["shard", str(root), str(tmp_path / "shards"), "--samples-per-shard", "8", "--val-split", "0"])
    assert code == 0, err
    out = tmp_path / "run"
    over = sets(
        "data.kind=shards", f"data.path={tmp_path / 'shards'}", "data.placement=stream", "model.name=mlp",
        "train.epochs=1", "data.batch_size=8",
    )  # fmt: skip
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    with open(out / "report" / "test" / "worst.csv", newline="") as f:
        worst = list(csv.DictReader(f))
    assert len(worst) == 12
    assert all(".tar:" in row["path"] for row in worst), worst[0]
    assert len({row["path"] for row in worst}) == 12
    assert (out / "report" / "test" / "worst.png").stat().st_size > 0


def scored_problem(n: int = 193, k: int = 12, absent: int = 11):
    """A fixed model and n samples of k classes (one class absent from the labels, yet predicted)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 20, generator=g)
    y = torch.randint(0, k - 1, (n,), generator=g)
    y[y >= absent] += 1
    torch.manual_seed(2)
    model = torch.nn.Linear(20, k)
    return x, y, model


def test_scores_equal_scikit_learns_classification_report_and_confusion_matrix():
    from sklearn.metrics import classification_report, confusion_matrix, top_k_accuracy_score

    x, y, model = scored_problem()
    k = 12
    sums = evaluation_sums(model, BatchLoader(Split(x, y), 16, CPU, CPU), torch.no_grad, classes=k)
    confusion = sums[4:].round().long().view(k, k)
    with torch.no_grad():
        out = model(x)
    predicted = out.argmax(1).numpy()
    assert (confusion.numpy() == confusion_matrix(y.numpy(), predicted, labels=list(range(k)))).all()
    assert int(confusion[:, 11].sum()) > 0  # the absent class is predicted: its precision is 0, it has no recall
    present = sorted(set(y.tolist()))
    report = classification_report(y.numpy(), predicted, labels=present, output_dict=True, zero_division=0)
    s = scores.per_class(confusion)
    for c in present:
        want = report[str(c)]
        got = (float(s["precision"][c]), float(s["recall"][c]), float(s["f1"][c]), int(s["support"][c]))
        assert got == pytest.approx((want["precision"], want["recall"], want["f1-score"], want["support"]))
    avg = scores.averages(confusion)
    for kind in ("macro", "weighted"):
        for name, field in (("precision", "precision"), ("recall", "recall"), ("f1", "f1-score")):
            assert avg[f"{kind}_{name}"] == pytest.approx(report[f"{kind} avg"][field], abs=1e-12), (kind, name)
    top5 = top_k_accuracy_score(y.numpy(), out.numpy(), k=5, labels=list(range(k)), normalize=False)
    assert float(sums[3]) == top5 and float(sums[1]) == (predicted == y.numpy()).sum()


GROUP_EVALUATION = """
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[2])
from test_scores import scored_problem, stream_sums

from job.group import distributed
from job.data.dataset import Split
from job.data.loader import BatchLoader
from job.use.evaluate import test_sums

dist.init_process_group("gloo")
x, y, model = scored_problem()
loader = BatchLoader(Split(x, y), 16, torch.device("cpu"), torch.device("cpu"), shard=(dist.get_rank(), 3))
sums = test_sums(model, loader, torch.no_grad, classes=12)
totals = distributed.totals(sums, sums[:0])
streamed = stream_sums(sys.argv[3], rank=dist.get_rank(), world=3)
streamed = distributed.totals(streamed, streamed[:0])
if dist.get_rank() == 0:
    torch.save([totals, streamed], sys.argv[1])
dist.destroy_process_group()
"""


def stream_sums(shards: str, rank: int = 0, world: int = 1) -> torch.Tensor:
    """A streamed test split's evaluation sums (3 classes of 16 px images) by a fixed model, in process rank."""
    from job.data.shard_sets import open_shards
    from job.data.stream import Decoder, StreamLoader

    split = open_shards(shards, None, lambda _: None).splits["test"]
    loader = StreamLoader(split, 6, CPU, Decoder(0, None), rank=rank, world=world)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 3))
    return evaluation_sums(model, loader, torch.no_grad, classes=3)


def test_scores_over_three_processes_equal_one(tmp_path):
    """Three real processes, each its part of every batch: 193 samples held in memory in batches of 16 (the last of
    one sample), and 15 streamed in shards of 4, 4, 4 and 3 in batches of 6 (a process that runs out feeds padding).
    The summed confusion matrix, top-5 and counts equal one process's, padding never counted."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import job_env

    script = tmp_path / "group.py"
    script.write_text(GROUP_EVALUATION)
    out = tmp_path / "totals.pt"
    tests = str(Path(__file__).parent)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script)]
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=2, size=16, test_per_class=5)
    shards = str(tmp_path / "shards")
    code, err = invoke(["shard", str(root), shards, "--samples-per-shard", "4", "--val-split", "0"])
    assert code == 0, err
    done = subprocess.run(
        [*args, str(out), tests, shards], capture_output=True, text=True, timeout=180, env=job_env(tests)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    x, y, model = scored_problem()
    one = evaluation_sums(model, BatchLoader(Split(x, y), 16, CPU, CPU), torch.no_grad, classes=12)
    three, streamed = torch.load(out)
    assert torch.equal(three[1:], one[1:]) and three[2] == 193
    assert float(three[0]) == pytest.approx(float(one[0]), rel=1e-6)
    alone = stream_sums(shards)
    assert torch.equal(streamed[1:], alone[1:]) and streamed[2] == 15
    assert float(streamed[0]) == pytest.approx(float(alone[0]), rel=1e-6)


def test_a_table_runs_report_names_its_rows_and_draws_no_pictures(tmp_path):
    """worst.csv of a csv run names each sample by its row in the table (the header not counted), the row's own
    label beside it; no picture of inputs."""
    import csv
    from importlib import resources

    out = tmp_path / "iris"
    code, err = invoke(["train", "--config", "iris", "--device", "cpu", "--output", str(out), *sets("train.epochs=30")])
    assert code == 0, err
    table = list(csv.DictReader(io.StringIO((resources.files("job.presets") / "iris.csv").read_text())))
    with open(out / "report" / "test" / "worst.csv", newline="") as f:
        worst = list(csv.DictReader(f))
    assert len(worst) == 30
    for row in worst:
        assert row["path"].startswith("row "), row
        assert table[int(row["path"].removeprefix("row ")) - 1]["species"] == row["true"], row
    assert not (out / "report" / "test" / "worst.png").exists()


@pytest.mark.parametrize("placement", ["held", "stream"])
def test_two_processes_write_the_report_of_one(tmp_path, placement):
    """Each process of a group scores its part of the split and rank 0 writes the report: the same files as one
    process scoring the same model (`evaluate --report` on the run), streamed samples and files named alike."""
    import csv

    from test_distributed import torchrun

    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=10, size=16, test_per_class=5)
    data = ["data.kind=folder", f"data.path={root}"]
    if placement == "stream":
        code, err = invoke(
            ["shard", str(root), str(tmp_path / "shards"), "--samples-per-shard", "4", "--val-split", "0"]
        )
        assert code == 0, err
        data = ["data.kind=shards", f"data.path={tmp_path / 'shards'}", "data.placement=stream"]
    over = sets(*data, "model.name=mlp", "train.epochs=2", "data.batch_size=6")
    two = torchrun("train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "two"), *over)
    assert two.returncode == 0, two.stderr[-3000:]
    rep = tmp_path / "rep"
    code, err = invoke(["evaluate", "--model", str(tmp_path / "two"), "--device", "cpu", "--report", str(rep)])
    assert code == 0, err
    written = tmp_path / "two" / "report" / "test"
    for name in ("classes.csv", "most_confused.csv"):
        assert (written / name).read_bytes() == (rep / "test" / name).read_bytes(), name

    def worst(folder):
        with open(folder / "worst.csv", newline="") as f:
            return sorted((r["path"], r["true"], r["predicted"], round(float(r["loss"]), 4)) for r in csv.DictReader(f))

    assert worst(written) == worst(rep / "test") and len(worst(written)) == 15
    assert (written / "worst.png").stat().st_size > 0


def test_evaluate_reports_on_any_labelled_data(tmp_path):
    """`evaluate --data PATH --report DIR`: the report of the model on new labelled photos, each named by its file."""
    import csv

    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=8, size=16, test_per_class=2)
    code, err = invoke(
        ["train", "--device", "cpu", "--config", "cifar10", "--output", str(tmp_path / "run"),
         *sets("data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=1")]
    )  # fmt: skip
    assert code == 0, err
    new = write_image_folder(tmp_path / "new", n_classes=3, per_class=4, size=16) / "train"  # class folders
    rep = tmp_path / "rep"
    code, err = invoke(
        ["evaluate", "--model", str(tmp_path / "run"), "--data", str(new), "--device", "cpu", "--report", str(rep)]
    )
    assert code == 0, err
    with open(rep / "all" / "worst.csv", newline="") as f:
        worst = list(csv.DictReader(f))
    assert len(worst) == 12 and all((new / row["path"]).is_file() for row in worst), worst[:2]
    with open(rep / "all" / "classes.csv", newline="") as f:
        assert sum(int(r["support"]) for r in csv.DictReader(f)) == 12
    assert (rep / "all" / "worst.png").stat().st_size > 0
    from job.use.evaluate import evaluate_on

    alone = evaluate_on(str(tmp_path / "run"), str(new), "cpu")  # the loss and accuracy of the report's own pass
    reported = evaluate_on(str(tmp_path / "run"), str(new), "cpu", str(tmp_path / "rep2"))
    assert alone["samples"] == reported["samples"] == 12 and alone["all_accuracy"] == reported["all_accuracy"]
    assert abs(alone["all_loss"] - reported["all_loss"]) < 1e-5 * max(1.0, alone["all_loss"])


def test_evaluate_streams_the_held_out_split_of_shards_and_reads_nothing_else(tmp_path):
    """`evaluate --data SHARDS`: their test split streamed (memory holds a few batches, whatever its size) and the
    training shards never read, so one damaged in place changes nothing; the scores are those of the folder the
    shards were packed from, with --report as without."""
    import csv

    from job.use.evaluate import evaluate_on

    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=8, size=16, test_per_class=4)
    run = str(tmp_path / "run")
    code, err = invoke(
        ["train", "--device", "cpu", "--config", "cifar10", "--output", run,
         *sets("data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=1")]
    )  # fmt: skip
    assert code == 0, err
    shards = tmp_path / "shards"
    code, err = invoke(["shard", str(root), str(shards), "--val-split", "0", "--samples-per-shard", "5"])
    assert code == 0, err
    for tar in (shards / "train").glob("*.tar"):  # the same size, so the index's check passes; unreadable
        tar.write_bytes(b"\xff" * tar.stat().st_size)
    folder = evaluate_on(run, str(root), "cpu")
    streamed = evaluate_on(run, str(shards), "cpu")
    reported = evaluate_on(run, str(shards), "cpu", str(tmp_path / "rep"))
    assert folder["split"] == streamed["split"] == reported["split"] == "test"
    assert folder["samples"] == streamed["samples"] == reported["samples"] == 12
    assert folder["test_accuracy"] == streamed["test_accuracy"] == reported["test_accuracy"]
    assert streamed["test_loss"] == pytest.approx(folder["test_loss"], rel=1e-5)
    assert reported["test_loss"] == pytest.approx(folder["test_loss"], rel=1e-5)
    with open(tmp_path / "rep" / "test" / "worst.csv", newline="") as f:
        named = [row["path"] for row in csv.DictReader(f)]
    assert named and all("/test/" in name and ".tar:" in name for name in named), named[:2]


def test_samples_without_names_are_named_by_their_place_in_the_split_across_processes():
    """A split with no file names (CIFAR-10's batches): each process's worst samples are named by their place in the
    whole split, so the parts of two processes merge into one process's report."""
    from job.use import diagnostics

    x, y, model = scored_problem(n=50)
    one = diagnostics.per_sample(model, BatchLoader(Split(x, y), 8, CPU, CPU), torch.no_grad)
    parts = [diagnostics.per_sample(model, BatchLoader(Split(x, y), 8, CPU, CPU, shard=(r, 2)), torch.no_grad)
             for r in range(2)]  # fmt: skip
    two = diagnostics.merged(parts)
    named = sorted(two.names[i] for i in two.worst.tolist())
    assert named == sorted(one.names[i] for i in one.worst.tolist()) == sorted(str(i) for i in one.worst.tolist())
    for i in two.worst.tolist():  # each name's loss is that sample's
        assert float(two.losses[i]) == pytest.approx(float(one.losses[int(two.names[i])]), rel=1e-5)


def test_a_sample_whose_loss_is_not_a_number_stays_among_the_worst():
    from job.use import diagnostics

    x, y, model = scored_problem(n=10)
    x[0] = float("nan")
    s = diagnostics.per_sample(model, BatchLoader(Split(x, y), 4, CPU, CPU), torch.no_grad)
    assert sorted(s.worst.tolist()) == list(range(10))


def confusion_of(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


def test_a_one_class_model_is_never_chosen_over_one_that_separates_classes():
    """Val accuracy 0.38 by always saying the largest class must not beat 0.30 of a model that tells classes apart; a
    separating model beats a one-class best whatever its accuracy; the chosen model's confusion is the one reported
    at the end, across a resume too."""
    from job.config import TrainConfig
    from job.run.choose import Chooser
    from job.run.progress import Progress

    model = torch.nn.Linear(2, 3)
    separating = confusion_of([3, 2, 3], [2, 3, 3], [2, 2, 3])  # 9 of 23 right: 0.39... here accuracy is given
    constant = confusion_of([0, 0, 8], [0, 0, 8], [0, 0, 7])
    for first, second, chosen in ((separating, constant, 1), (constant, separating, 2)):
        chooser, state = Chooser(TrainConfig(), "val"), Progress()
        state.epoch = 1
        chooser.judge(state, 0.30 if first is separating else 0.38, 1.0, model, first)
        state.epoch = 2
        chooser.judge(state, 0.38 if second is constant else 0.30, 1.0, model, second)
        assert state.best_epoch == chosen and torch.equal(chooser.chosen_confusion(), separating)
        state.epoch = 3
        chooser.judge(state, 0.2, 1.0, model, constant)  # the latest evaluation is not what the end describes
        payload = {"progress": {"best_epoch": state.best_epoch, "epoch": 3, "epoch_step": 0}} | chooser.saved(state)
        again = Chooser(TrainConfig(), "val")
        again.restore(payload, model)
        assert torch.equal(again.chosen_confusion(), separating) and again.chosen_one_class() is None
    alone = Chooser(TrainConfig(), "test")  # no val split: the end describes the final model's latest evaluation
    state = Progress(epoch=1)
    alone.judge(state, 0.5, 1.0, model, separating)
    state.epoch = 2
    alone.judge(state, 0.2, 1.0, model, constant)
    again = Chooser(TrainConfig(), "test")
    again.restore({"progress": {"best_epoch": 1, "epoch": 2, "epoch_step": 0}} | alone.saved(state), model)
    assert torch.equal(again.chosen_confusion(), constant)  # resumed with no evaluation since: still described


def test_a_one_class_warning_follows_its_epoch_line_and_the_end_says_the_chosen_model_is_one(tmp_path):
    out = tmp_path / "run"
    over = sets("optim.lr=1e-9", "train.epochs=3", "train.eval_every_epochs=1", "data.val_split=0.2")
    code, err = invoke(["train", "--device", "cpu", "--output", str(out), *over])
    assert code == 0, err
    lines = err.splitlines()
    warned = [i for i, line in enumerate(lines) if line.startswith("warning: the model predicts")]
    assert len(warned) == 3 and all(lines[i - 1].startswith(f"epoch {n + 1}/3") for n, i in enumerate(warned)), err
    end = next(line for line in lines if line.startswith("warning: the chosen model"))
    assert "(epoch 1) predicts versicolor for every val sample" in end, err


def test_a_tie_in_val_accuracy_is_broken_by_the_val_loss_and_early_stopping_counts_on():
    """Val accuracy 1.0 from the first epoch on (a small val split): model.pt must not be the first epoch's barely
    trained model. The lower val loss wins a tie; early stopping still counts evaluations since accuracy improved."""
    from job.config import TrainConfig
    from job.run.choose import Chooser
    from job.run.progress import Progress

    model = torch.nn.Linear(2, 2)
    right = confusion_of([5, 0], [0, 5])
    chooser, state = Chooser(TrainConfig(early_stopping_patience=3), "val"), Progress()
    reasons = []
    for epoch, loss in enumerate([0.9, 0.4, 0.5, 0.1], start=1):
        state.epoch = epoch
        with torch.no_grad():
            model.weight.fill_(epoch)
        reasons.append(chooser.judge(state, 1.0, loss, model, right))
    assert state.best_epoch == 4 and state.best_loss == 0.1 and float(chooser.weights["weight"][0, 0]) == 4
    assert reasons[:2] == ["", ""] and reasons[3].startswith("early stopping") and state.evals_since_best == 3


@pytest.mark.parametrize("val_split", [0.0, 0.25])
def test_the_end_of_a_run_reports_from_its_last_pass_over_a_split(tmp_path, monkeypatch, val_split):
    """report/<split>/ reads the samples of the run's last pass over a split on the weights it ends with (the last
    evaluation, or the chosen model's test pass) instead of passing over the split again; the report agrees with
    the metrics that pass gave."""
    import csv

    from job.use import diagnostics
    from job.use import evaluate as evaluate_module

    passes = []
    for module, name in ((diagnostics, "per_sample"), (evaluate_module, "test_sums")):
        real = getattr(module, name)

        def counted(*args, real=real, **kwargs):
            passes.append(real.__name__)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    root = write_image_folder(tmp_path / "imgs", n_classes=3, per_class=12, size=16, test_per_class=4)
    out = tmp_path / "run"
    over = sets(
        "data.kind=folder", f"data.path={root}", "model.name=mlp", "train.epochs=2", "data.batch_size=8",
        f"data.val_split={val_split}",
    )  # fmt: skip
    code, err = invoke(["train", "--device", "cpu", "--config", "cifar10", "--output", str(out), *over])
    assert code == 0, err
    records = metrics(out)
    evaluations = [r for r in records if "train_loss" in r]
    if val_split:
        end = records[-1]
        chosen_last = end["chosen_epoch"] == evaluations[-1]["epoch"]
        # the evaluations, the final weights on test (when not the chosen ones), the chosen model on test, and val's
        # report pass only where the chosen weights are not the last evaluated
        assert len(passes) == len(evaluations) + (0 if chosen_last else 2) + 1, passes
    else:
        end = evaluations[-1]
        assert len(passes) == len(evaluations), passes
    with open(out / "report" / "test" / "classes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    right = sum(round(float(r["recall"]) * int(r["support"])) for r in rows)
    assert right / sum(int(r["support"]) for r in rows) == pytest.approx(end["test_accuracy"])
