"""How the step runs on a CPU: eagerly, as the plan says and why; the precision auto comes to; padded steps. The CUDA
graph path is in test_gpu.py."""

import json

import pytest
import torch
from conftest import write_image_folder

from job.config import load_config
from job.recipe.build import prime_momentum
from job.run.train import run


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train(tmp_path, name, overrides, capsys):
    cfg = load_config("iris", ["train.epochs=150", "train.eval_every_epochs=50", *overrides])
    summary = run(cfg, str(tmp_path / name), "cpu", "never", True)
    said = capsys.readouterr().err
    weights = torch.load(tmp_path / name / "model.pt", weights_only=True)
    return summary, weights, said


@pytest.mark.parametrize("overrides", [[], ["optim.momentum=0.9", "optim.nesterov=true", "data.batch_size=48"]])
def test_a_cpu_step_is_eager_whatever_train_step_capture_says(tmp_path, capsys, overrides):
    """A CPU step runs eagerly: torch has no maintained public way to capture one (TorchScript, which traced it, is
    deprecated). A config that asks for capture (train.step_capture=on, as configs of the traced CPU step did) still
    runs, trains exactly as with capture off, and says how its step runs."""
    names = ("off", "on")
    off, w_off, said_off = train(tmp_path, "off", [*overrides, "train.step_capture=off"], capsys)
    on, w_on, said = train(tmp_path, "on", [*overrides, "train.step_capture=on"], capsys)
    assert "step: fp32; eager (train.step_capture off)" in said_off
    assert "step: fp32; eager (a CPU step runs eagerly)" in said and "traced" not in said
    for k in w_off:
        assert torch.equal(w_off[k], w_on[k]), k
    assert off["final_test_loss"] == on["final_test_loss"]
    logged = [[json.loads(line)["train_loss"] for line in (tmp_path / run / "metrics.jsonl").open()] for run in names]
    assert logged[0] == logged[1] and len(logged[0]) == 3


def test_the_eager_iris_step_trains_as_the_bare_loop_does(tmp_path, capsys):
    """The job's eager step is forward, loss, backward and the optimizer step: on the Iris preset's full batches (the
    order its loader gives them) it leaves the weights a bare loop of those four calls leaves, to rounding."""
    from job.recipe import build as recipe

    cfg = load_config("iris", ["train.epochs=30", "train.eval_every_epochs=30"])
    run(cfg, str(tmp_path / "job"), "cpu", "never", True)
    capsys.readouterr()
    torch.manual_seed(cfg.seed)
    r = recipe.build(cfg, torch.device("cpu"), recipe.read_data(cfg))
    for epoch in range(cfg.train.epochs):
        for batch in r.train.batches(epoch):
            r.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(r.model(batch.x), batch.y).backward()
            r.optimizer.step()
    saved = torch.load(tmp_path / "job" / "model.pt", weights_only=True)
    for k, v in r.model.state_dict().items():
        assert torch.allclose(v, saved[k], rtol=1e-5, atol=1e-6), k


def test_cpu_threads_one_for_a_small_model_else_as_set(tmp_path, capsys):
    _, _, said = train(tmp_path, "auto", ["train.epochs=2"], capsys)
    assert "device cpu (1 thread)" in said
    _, _, said = train(tmp_path, "two", ["train.epochs=2", "train.cpu_threads=2"], capsys)
    assert "device cpu (2 threads)" in said


def test_a_large_cpu_step_runs_eagerly_on_all_threads(tmp_path, capsys):
    cfg = load_config("iris", ["train.epochs=2", "model.hidden=[4096, 4096]"])
    threads = torch.get_num_threads()
    run(cfg, str(tmp_path / "big"), "cpu", "never", True)
    said = capsys.readouterr().err
    assert "eager (a CPU step runs eagerly)" in said
    assert f"device cpu ({threads} thread{'s' if threads != 1 else ''})" in said
    assert torch.get_num_threads() == threads  # the run's setting does not outlive it


def test_torch_compile_option_trains_the_same_model(tmp_path, capsys):
    eager, w_eager, _ = train(tmp_path, "eager", ["train.epochs=20", "train.step_capture=off"], capsys)
    compiled, w_compiled, said = train(tmp_path, "compiled", ["train.epochs=20", "train.compile=true"], capsys)
    assert "torch.compile; eager (the compiled model in eager steps" in said
    assert list(w_compiled) == list(w_eager)  # the plain module's names, without torch.compile's prefix
    for k in w_eager:
        assert torch.allclose(w_eager[k], w_compiled[k], rtol=1e-4, atol=1e-6), k


def test_fused_sgd_momentum_survives_a_skipped_first_step():
    """fp16 on a GPU uses fused SGD; its loss scaler skips a step that overflowed. A skipped first step must leave
    momentum as SGD's own would (fused SGD alone leaves it uninitialised; the same kernels run on a CPU)."""

    def train(fused: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
        prime_momentum(optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        for i in range(3):
            optimizer.zero_grad()
            loss = model(torch.ones(1, 3)).sum() * (float("inf") if i == 0 else 1.0)  # the first step overflows
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return model.weight.detach()

    assert torch.allclose(train(fused=True), train(fused=False))


def test_a_cnn_on_a_cpu_trains_channels_last_by_default_and_learns_the_same(tmp_path, capsys):
    """auto: channels-last convolutions on a CPU (oneDNN's faster kernels): the same training, up to rounding."""
    root = write_image_folder(tmp_path / "images", size=32)
    weights, said = {}, {}
    for layout in ("auto", "off"):
        sets = [f"data.path={root}", "data.kind=folder", "data.batch_size=8", "train.epochs=3", "train.precision=fp32"]
        cfg = load_config("cifar10", [*sets, f"train.channels_last={layout}"])
        run(cfg, str(tmp_path / layout), "cpu", "never", True)
        said[layout] = capsys.readouterr().err
        weights[layout] = torch.load(tmp_path / layout / "model.pt", weights_only=True)
    assert "step: fp32, channels-last;" in said["auto"] and "channels-last" not in said["off"]
    for k, v in weights["off"].items():
        assert torch.allclose(v, weights["auto"][k], rtol=1e-4, atol=1e-5), k


def test_bf16_on_a_cpu_says_once_how_its_step_runs(tmp_path):
    """The run says up front how its step runs and why, in one `step:` line."""
    from conftest import invoke, sets

    code, err = invoke(["train", "--device", "cpu", "--output", str(tmp_path / "r"), *sets("train.precision=bf16")])
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("step:")]
    assert lines == ["step: bf16; eager (a CPU step runs eagerly)"]


def test_the_step_plan_is_one_pure_decision_with_its_reason():
    """How a step runs is a value of plan_step's, decided from the facts alone: no GPU needed to test the GPU's."""
    from job.recipe.plan import StepFacts, plan_step
    from job.recipe.step import StepKind

    sgd = StepFacts("cuda", plain_sgd=True)
    assert plan_step(sgd).kind is StepKind.CUDA_GRAPH and plan_step(sgd).optimizer_inside
    scheduled = plan_step(StepFacts("cuda", plain_sgd=False))
    assert scheduled.kind is StepKind.CUDA_GRAPH and not scheduled.optimizer_inside
    assert "optimizer step eager" in scheduled.describe()
    for facts, reason in [
        (StepFacts("cuda", wrapper="ddp", plain_sgd=True), "DistributedDataParallel"),
        (StepFacts("cuda", wrapper="compile"), "torch.compile"),
        (StepFacts("cuda", capture="off"), "train.step_capture off"),
        (StepFacts("cuda", own_model=True), "a model of your own"),
        (StepFacts("cpu"), "a CPU step runs eagerly"),
        (StepFacts("cpu", capture="on", plain_sgd=True), "a CPU step runs eagerly"),
        (StepFacts("cpu", capture="off"), "train.step_capture off"),
        (StepFacts("mps"), "no step capture on mps"),
    ]:
        plan = plan_step(facts)
        assert plan.kind is StepKind.EAGER and reason in plan.reason, (facts, plan)
    own_on = plan_step(StepFacts("cuda", capture="on", own_model=True))
    assert own_on.kind is StepKind.CUDA_GRAPH


def test_a_step_that_falls_back_says_so_as_a_value():
    from job.recipe.step import EagerStep, StepKind, StepPlan

    model = torch.nn.Linear(2, 2)
    scaler, optimizer = torch.amp.GradScaler("cpu", enabled=False), torch.optim.SGD(model.parameters(), lr=0.1)
    plan = StepPlan(StepKind.CUDA_GRAPH, "small")
    step = EagerStep(model, optimizer, None, scaler, torch.no_grad, torch.zeros(3), plan=plan)
    assert step.fallback is None and step.description.startswith("one CUDA graph per batch shape")
    step.fall_back("the step could not be captured: a reason")
    assert step.fallback == StepPlan(StepKind.EAGER, "the step could not be captured: a reason")
    assert step.description == "eager (the step could not be captured: a reason)"


def test_waits_are_reported_for_the_watching_thread_alone_and_warnings_survive_other_threads():
    """The host-wait probe turns on a process-wide mode while another thread (the device decoder) works: that
    thread's waits are not the step's, and its own warning state, entered and left across the probe, must not
    leave the process's warnings going nowhere (catch_warnings(record=True) did: the other thread put back the
    probe's recorder, and every later warning of the run went into a list no one read)."""
    import threading
    import warnings

    from job.recipe.cuda_graph import SYNC_WARNING, waits_reported

    seen: list[str] = []
    entered, probed, left = threading.Event(), threading.Event(), threading.Event()

    def decoder() -> None:
        entered.wait()
        with warnings.catch_warnings():  # what any library in another thread may do
            warnings.simplefilter("ignore", DeprecationWarning)
            # the decoder waiting for its own stream
            warnings.warn(f"called a {SYNC_WARNING}", UserWarning, stacklevel=1)
            probed.set()
            left.wait()

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_, **__: seen.append(str(message))
        other = threading.Thread(target=decoder)
        other.start()
        before = list(warnings.filters)
        with waits_reported() as found:
            entered.set()
            probed.wait(10)
            for _ in range(2):  # the step's: each one, also at a line seen before
                warnings.warn(f"called a {SYNC_WARNING}", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)  # not a wait: shown as usual
        left.set()
        other.join(10)
        warnings.warn("a later warning", UserWarning, stacklevel=1)
        assert len(found) == 2 and all(SYNC_WARNING in f and "test_step.py" in f for f in found), found
        assert seen == ["something else", "a later warning"], seen
        assert [f for f in warnings.filters if f not in before] in ([], [warnings.filters[0]])  # at most the rule


def test_a_padded_step_learns_nothing_and_leaves_batch_norm_statistics_alone():
    """A streamed process that has run out replays its last batch with loss weight 0, so that the group's gradient
    all-reduce still happens. That batch must count for nothing: no gradient, no loss, and no update of BatchNorm's
    running statistics (nor, on GPUs, of SyncBatchNorm's batch statistics, which the other processes share): the
    model runs on none of its samples."""
    import contextlib

    from job.recipe.step import EagerStep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    scaler, optimizer = torch.amp.GradScaler("cpu", enabled=False), torch.optim.SGD(model.parameters(), lr=0.1)
    sums = torch.zeros(())
    step = EagerStep(model, optimizer, None, scaler, contextlib.nullcontext, sums)
    x, y = torch.randn(6, 4) + 3, torch.tensor([0, 1, 2, 0, 1, 2])
    step(x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = sums.clone()
    step(x + 5, y, 0.0)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k]) and k != "1.num_batches_tracked"]
    assert not changed, changed
    assert torch.equal(sums, loss)
    assert all(p.grad is not None and not p.grad.any() for p in step.params)  # DDP all-reduces zeros


def test_a_padded_step_of_a_model_that_cannot_take_an_empty_batch_steps_as_before():
    """`x.view(x.size(0), -1)` cannot reshape an empty batch, and a model may return no floating-point tensor for one:
    such a model's padded step runs on the batch with its loss times 0, as it always did, found out once, without
    a collective (an evaluation-mode forward) so that the other processes are not kept waiting."""
    import contextlib

    from job.recipe.step import EagerStep

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4 * 4 * 4, 3)

        def forward(self, x):
            return self.fc(self.conv(x).view(x.size(0), -1))

    torch.manual_seed(0)
    model = Flat()
    scaler, optimizer = torch.amp.GradScaler("cpu", enabled=False), torch.optim.SGD(model.parameters(), lr=0.1)
    sums = torch.zeros(())
    step = EagerStep(model, optimizer, None, scaler, contextlib.nullcontext, sums)
    x, y = torch.randn(5, 3, 6, 6), torch.tensor([0, 1, 2, 0, 1])
    step(x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = sums.clone()
    step(x, y, 0.0)
    step(x, y, 0.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(sums, loss) and model.training
    assert all(p.grad is not None and not p.grad.any() for p in step.params)


def test_auto_precision_is_one_pure_decision_with_its_reason():
    """train.precision auto: bf16 where the hardware computes it natively, for a step bound by arithmetic: a GPU from
    compute capability 8.0, and a CPU with AMX's matrix units (the tutorials' CIFAR-10 step about twice as fast there);
    a small CPU step, bound by per-operation overhead, stays fp32."""
    from job.recipe.plan import SMALL_STEP_FLOPS, choose_precision

    big, small = SMALL_STEP_FLOPS * 10, SMALL_STEP_FLOPS / 10
    assert choose_precision("fp16", "cpu", big, cpu_bf16=True).name == "fp16"  # named: as asked, no reason given
    assert choose_precision("fp32", "cuda", big, gpu_capability=(9, 0)).why == ""
    for args, name, why in [
        (("cuda", big, (9, 0), False), "bf16", "computes it natively"),
        (("cuda", big, (7, 5), False), "fp32", "no native bf16"),
        (("cpu", big, None, True), "bf16", "AMX"),
        (("cpu", small, None, True), "fp32", "small step"),
        (("cpu", big, None, False), "fp32", "no native bf16"),
        (("mps", big, None, False), "fp32", "no native bf16"),
    ]:
        device, flops, capability, amx = args
        chosen = choose_precision("auto", device, flops, gpu_capability=capability, cpu_bf16=amx)
        assert chosen.name == name and why in chosen.why and chosen.why.startswith("auto"), (args, chosen)


def test_amx_is_read_from_the_flags_the_kernel_lists(tmp_path):
    """torch has no public check for AMX: the CPU's flags as Linux lists them (both amx_tile and amx_bf16), none
    where there is no such list."""
    from job.recipe.plan import cpu_computes_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_computes_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile_extra\n")
    assert not cpu_computes_bf16(info)
    assert not cpu_computes_bf16(tmp_path / "absent")


def test_a_cpu_run_with_precision_auto_says_what_it_came_to(tmp_path, capsys):
    """The decision wired into a real run: bf16 on this CPU when it has AMX, else fp32; the Iris step stays fp32."""
    from job.recipe.plan import cpu_computes_bf16

    root = write_image_folder(tmp_path / "imgs", n_classes=2, per_class=8, size=32)
    sets = ["data.kind=folder", f"data.path={root}", "train.epochs=1", "train.precision=auto", "data.val_split=0"]
    run(load_config("cifar10", sets), str(tmp_path / "cnn"), "cpu", "never", True)
    expected = "bf16 (auto: this CPU's AMX" if cpu_computes_bf16() else "fp32 (auto: no native bf16"
    assert f"step: {expected}" in capsys.readouterr().err
    run(load_config("iris", ["train.epochs=2", "train.precision=auto"]), str(tmp_path / "iris"), "cpu", "never", True)
    assert "step: fp32 (auto: " in capsys.readouterr().err


def test_a_resumed_run_keeps_the_precision_auto_came_to_at_its_start(tmp_path, capsys, monkeypatch):
    """auto decides once a run: a run that began in bf16 on a CPU with AMX goes on in bf16 when it is resumed on a CPU
    without (the arithmetic of the run it continues), and says what a fresh decision would have been, once however
    often the run resumes; a precision named on resume is taken for that attempt. The CPU's AMX is the one fact
    stood in for: the machine cannot change under a test."""
    import job.recipe.plan

    root = write_image_folder(tmp_path / "imgs", n_classes=2, per_class=8, size=32)
    sets = ["data.kind=folder", f"data.path={root}", "train.precision=auto", "data.val_split=0"]
    out = str(tmp_path / "cnn")
    monkeypatch.setattr(job.recipe.plan, "cpu_computes_bf16", lambda: True)
    run(load_config("cifar10", [*sets, "train.epochs=1"]), out, "cpu")
    assert "step: bf16 (auto: this CPU's AMX units compute bf16 natively)" in capsys.readouterr().err
    monkeypatch.setattr(job.recipe.plan, "cpu_computes_bf16", lambda: False)
    run(load_config("cifar10", [*sets, "train.epochs=2"]), out, "cpu")
    said = capsys.readouterr().err
    began = "step: bf16 (auto, as the run began: this CPU's AMX units compute bf16 natively; afresh here: fp32, no "
    assert began + "native bf16 here)" in said
    run(load_config("cifar10", [*sets, "train.epochs=3", "train.precision=fp32"]), out, "cpu")
    assert "step: fp32, channels-last;" in capsys.readouterr().err
    for epochs in (4, 5):  # the run's start, not the attempt between; said once, however often the run resumes
        run(load_config("cifar10", [*sets, f"train.epochs={epochs}"]), out, "cpu")
        assert began + "native bf16 here)," in capsys.readouterr().err
    monkeypatch.setattr(job.recipe.plan, "cpu_computes_bf16", lambda: True)
    run(load_config("cifar10", [*sets, "train.epochs=6"]), out, "cpu")
    assert "step: bf16 (auto: this CPU's AMX units compute bf16 natively)," in capsys.readouterr().err
