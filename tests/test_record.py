"""recipe/record.py: a function's operations recorded as they run once, replayed as a graph (a CPU step's tracer)."""

import pytest
import torch
from torch import nn

from job.recipe.record import NotRecordable, record


def training_step(model: nn.Module):
    """(weights..., buffers..., x, y) -> (loss, *grads): forward, loss and backward, the weights updated in place
    (plain SGD), the buffers as the model writes them."""
    weights, buffers = [n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()]

    def step(*tensors):
        k = len(weights)
        leaves = [t.detach().requires_grad_() for t in tensors[:k]]
        state = dict(zip(weights, leaves)) | dict(zip(buffers, tensors[k:-2]))
        x, y = tensors[-2:]
        loss = nn.functional.cross_entropy(torch.func.functional_call(model, state, (x,)), y)
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            for p, g in zip(tensors[:k], grads):
                p.add_(g, alpha=-0.1)
        return (loss.detach(), *grads)

    return step


def both_ways(step, replay, start: list, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The step run eagerly and replayed, each on its own copy of `start`, from the same random state: (eager's
    outputs, the replay's, eager's state after, the replay's)."""
    eager_state, replay_state = [t.clone() for t in start], [t.clone() for t in start]
    torch.manual_seed(1)
    eager = step(*eager_state, x, y)
    torch.manual_seed(1)
    with torch.no_grad():
        replayed = replay(*replay_state, x, y)
    return eager, replayed, eager_state, replay_state


def test_a_recorded_step_replays_what_the_step_does_to_the_bit():
    """Batch norm (its statistics written in place), dropout (a random draw per call), ReLU and Sigmoid (whose
    backward reads their own results, which autograd saves as new objects) and an in-place update: the graph
    replays each on new weights and a new batch as the eager step computes it, random draws included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 8),
                          nn.Sigmoid(), nn.Linear(8, 3))  # fmt: skip
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    step = training_step(model)
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    graph = record(step, *[t.clone() for t in state], x, y)

    x2, y2 = torch.randn(12, 6), torch.randint(0, 3, (12,))  # another batch, other weights: not the recorded ones
    start = [t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t.clone() for t in state]
    eager, replayed, eager_state, replay_state = both_ways(step, graph, start, x2, y2)
    assert len(eager) == len(replayed) == 1 + sum(1 for _ in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
    assert all(torch.equal(a, b) for a, b in zip(eager_state, replay_state))  # weights and running statistics
    assert not torch.equal(eager_state[-3], start[-3])  # running_mean did change


def test_a_recorded_step_runs_in_torchscripts_interpreter_as_it_ran():
    """What the CPU step does with the graph: TorchScript's tracer takes it (batch norm's backward it does not: such
    a step runs as the graph's own Python code, test_step.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    state = [p.detach().clone() for p in model.parameters()]
    step = training_step(model)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    traced = torch.jit.trace(
        record(step, *[t.clone() for t in state], x, y), (*[t.clone() for t in state], x, y), check_trace=False
    )
    eager, replayed, eager_state, replay_state = both_ways(step, traced, state, x, y)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
    assert all(torch.equal(a, b) for a, b in zip(eager_state, replay_state))


def test_a_tensor_from_outside_is_kept_and_a_value_read_on_the_host_refuses():
    weight = torch.tensor([1.0, 2.0, 3.0])  # not an input: the graph keeps it

    def scaled(x):
        return (x * weight,)

    graph = record(scaled, torch.ones(3))
    assert torch.equal(graph(torch.full((3,), 2.0))[0], torch.tensor([2.0, 4.0, 6.0]))

    def branches(x):
        return (x * 2,) if x.sum() > 0 else (x,)  # a Python branch on the data: one replay would freeze it

    with pytest.raises(NotRecordable, match="data-dependent"):
        record(branches, torch.ones(3))


def test_views_that_are_their_own_base_are_read_as_it_and_others_kept():
    """detach, t of t and a view to the same shape read their base; a transpose, a narrowing view and the views of a
    graph that reshapes a tensor in place stay: the replay computes what the function does either way."""

    def f(w, x):
        same = w.t().t().detach().view(w.shape)  # w itself, four views later
        return (x @ same.t(), same[:, :2].sum(), same * 2)

    w, x = torch.randn(3, 4), torch.randn(5, 4)
    graph = record(f, w, x)
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    kept = ["aten.t.default", "aten.mm.default", "aten.slice.Tensor", "aten.sum.default", "aten.mul.Tensor"]
    assert sorted(ops) == sorted(kept), ops
    w2, x2 = torch.randn(3, 4), torch.randn(5, 4)
    assert all(torch.equal(a, b) for a, b in zip(graph(w2, x2), f(w2, x2)))

    def reshaped(w):
        v = w.t().t()
        v.t_()  # in place: v is no longer w's layout
        return (v * 1,)

    kept = record(reshaped, torch.randn(3, 4))
    assert [str(n.target) for n in kept.graph.nodes if n.op == "call_function"].count("aten.t.default") == 2
    w3 = torch.randn(3, 4)
    assert torch.equal(kept(w3.clone())[0], reshaped(w3.clone())[0])


def test_a_tensor_made_in_the_function_is_made_afresh_at_each_replay():
    """torch.tensor(...) inside the function makes a new tensor at each call: a replay starts from its first values,
    however the recording wrote to it."""

    def total(x):
        t = torch.tensor(0.0)
        t += x.sum()
        return (t,)

    graph = record(total, torch.ones(3))
    assert [graph(torch.ones(3))[0].item() for _ in range(3)] == [3.0, 3.0, 3.0]


def test_an_operation_whose_shape_depends_on_the_data_refuses():
    """A boolean mask's selection has as many elements as the mask has True values: a graph would freeze the count."""

    def picked(x):
        return (x[x > 0].sum() / (x > 0).sum(),)

    for how in (picked, lambda x: (x.masked_select(x > 0).sum(),), lambda x: (x.nonzero().float().sum(),)):
        with pytest.raises(NotRecordable, match="data-dependent"):
            record(how, torch.tensor([1.0, -1.0, 2.0]))


def test_a_value_read_on_the_host_past_the_dispatcher_refuses_too():
    """.tolist(), .numpy() and NumPy's own conversion read a tensor's memory without an operation the recorder sees:
    while it records, they refuse as .item() does (a graph would freeze what they read)."""
    for read in (lambda x: x.tolist(), lambda x: x.numpy(), lambda x: __import__("numpy").asarray(x)):

        def counted(x, read=read):
            k = sum(1 for v in read(x > 0) if v)
            return (x * (k + 1),)

        with pytest.raises(NotRecordable, match="data-dependent"):
            record(counted, torch.tensor([1.0, -1.0, 2.0]))
    assert torch.tensor([1.0, 2.0]).tolist() == [1.0, 2.0]  # as torch has it again once recording is done


def test_a_conjugate_view_is_kept():
    """A conjugate view has its base's layout but not its values."""

    def imaginary(z):
        return ((z.conj() * 1).imag,)

    z = torch.randn(3, dtype=torch.complex64)
    assert torch.equal(record(imaginary, z)(z)[0], imaginary(z)[0])
