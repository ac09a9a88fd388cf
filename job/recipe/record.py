"""A function's ATen operations, recorded as it runs once on real tensors, as a torch.fx graph.

torch's own recorder, make_fx, does this and more (symbolic shapes, decompositions, functionalisation), and its first
call imports torch's compiler (torch._dynamo, torch._inductor, sympy, triton): 1.5 s of CPU on this project's CPU
machine, a third of a 20,000-step Iris run. A CPU step traced for TorchScript's interpreter needs none of that: the
operations as they ran, on tensors of fixed shapes. This records them with a dispatch mode (torch's documented way to
see each operation below autograd, backward's included) and nothing else.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode


class NotRecordable(RuntimeError):
    pass


# Operations whose result is a host value the graph would freeze: the function branches on its data.
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}
# Operations whose result's shape follows the data's values (a boolean mask's selection): the graph would freeze it.
SHAPED_BY_DATA = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "argwhere",
                  "repeat_interleave", "bincount"}  # fmt: skip
# Tensor methods that copy its values to the host without an operation a dispatch mode sees.
HOST_COPIES = ("tolist", "numpy", "__array__")
MASKS = (torch.bool, torch.uint8)


class Recorder(TorchDispatchMode):
    """Each operation run under it becomes a node; a tensor is known by the object (autograd's saved tensors are kept
    as the objects themselves while recording, see `record`), so each argument names the node that made it."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph) -> None:
        super().__init__()
        self.root, self.graph = root, graph
        self.nodes: dict[int, tuple[torch.Tensor, fx.Node]] = {}  # id -> (the tensor, kept alive; its node)
        self.storages: set[int] = set()  # the storages of tensors the graph made or took: an unknown view of one is
        # a tensor the recorder lost track of, not a constant

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's switch for a mode that needs no compiler's wrapper: nothing is compiled while it records

    def bind(self, t: torch.Tensor, node: fx.Node) -> None:
        self.nodes[id(t)] = (t, node)
        self.storages.add(storage(t))
        node.meta["layout"] = (storage(t), t.storage_offset(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())

    def node(self, t: torch.Tensor, fresh: bool = False) -> fx.Node:
        """The node that made t; a tensor from outside the function is kept by the graph as it is (its later values
        are read), a `fresh` one (made in the function from host data: torch.tensor) as its values are now."""
        known = self.nodes.get(id(t))
        if known is not None:
            return known[1]
        if storage(t) in self.storages:
            raise NotRecordable("an operation took a view of the step's own tensors that was not recorded")
        name = f"_constant{len(self.root._buffers)}"
        self.root.register_buffer(name, t.detach().clone() if fresh else t.detach(), persistent=False)
        node = self.graph.get_attr(name)
        self.bind(t, node)
        return node

    def arg(self, a):
        if isinstance(a, torch.Tensor):
            return self.node(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        if isinstance(a, dict):
            return {k: self.arg(v) for k, v in a.items()}
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name in HOST_READS:
            raise NotRecordable("data-dependent: the function reads a tensor's value on the host")
        if name in SHAPED_BY_DATA or (name == "index" and any(masks(args))):
            raise NotRecordable(f"data-dependent: {func}'s result is shaped by the data's values")
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(...): a new tensor at each call, as make_fx has it
            node = self.graph.call_function(torch.ops.aten.lift_fresh_copy.default, (self.node(args[0], fresh=True),))
        else:
            node = self.graph.call_function(func, self.arg(args), self.arg(kwargs))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
        elif isinstance(out, (list, tuple)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    self.bind(t, self.graph.call_function(operator.getitem, (node, i)))
                elif t is not None:
                    raise NotRecordable(f"data-dependent: {func} returned a host value")
        elif out is not None:
            raise NotRecordable(f"data-dependent: {func} returned a host value")
        return out


@contextlib.contextmanager
def host_copies_refused() -> Iterator[None]:
    """While recording, on the recording thread, .tolist(), .numpy() and NumPy's conversion refuse as .item() does:
    they read values a graph would freeze, past the dispatcher. Other threads (a decoding pool) are not refused."""
    here = threading.get_ident()
    saved = {name: (getattr(torch.Tensor, name), name in torch.Tensor.__dict__) for name in HOST_COPIES}

    def refusing(name: str, original: Callable) -> Callable:
        def method(self, *args, **kwargs):
            if threading.get_ident() == here:
                raise NotRecordable(f"data-dependent: the function reads a tensor's values on the host (.{name}())")
            return original(self, *args, **kwargs)

        return method

    for name, (original, _) in saved.items():
        setattr(torch.Tensor, name, refusing(name, original))
    try:
        yield
    finally:
        for name, (original, own) in saved.items():
            if own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)  # torch's own is the base class's again


def op_name(target) -> str:
    """An operation's name without its overload: add_ for aten.add_.Tensor ('' for a Python function)."""
    return getattr(target, "__name__", "").split(".")[0]


def masks(args) -> list[bool]:
    """Whether each index of aten.index (x[i]) is a boolean mask."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return [isinstance(i, torch.Tensor) and i.dtype in MASKS for i in indices]


def storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a subclass): its own identity
        return id(t)


def record(fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor) -> fx.GraphModule:
    """fn's operations on `inputs` as a GraphModule taking tensors of the same shapes (and returning fn's tuple).
    fn runs once, for real: its in-place writes to `inputs` happen."""
    root, graph = torch.nn.Module(), fx.Graph()
    mode = Recorder(root, graph)
    for i, t in enumerate(inputs):
        mode.bind(t, graph.placeholder(f"input{i}"))
    # Autograd keeps some saved tensors (a result its own backward reads) as new objects over the same memory; kept as
    # themselves here, backward's operations name the nodes that made them.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), host_copies_refused(), mode:
        outputs = fn(*inputs)
    graph.output(tuple(mode.node(t) for t in outputs))
    without_needless_views(graph)
    return fx.GraphModule(root, graph)


# In-place operations that change a tensor's shape or strides, not its values: a graph with one keeps all its views.
RESHAPED_IN_PLACE = {"t_", "transpose_", "squeeze_", "unsqueeze_", "resize_", "resize_as_", "as_strided_", "set_",
                     "swapdims_", "swapaxes_", "detach_"}  # fmt: skip


def is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def without_needless_views(graph: fx.Graph) -> None:
    """Each view that is its own base again (detach, alias, t of t, a view to the same shape) read as that base. A
    view is cheap, but TorchScript's interpreter dispatches it like any operation: on a small model's step, a sixth
    of its time (the Iris MLP's step: 44 operations recorded, 27 left). Views are told by their schema (a result that
    aliases an argument); a graph that changes a tensor's shape or strides in place keeps them all."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    if any(op_name(n.target) in RESHAPED_IN_PLACE for n in calls):
        return
    for node in calls:
        layout = node.meta.get("layout")  # None for an operation returning several tensors (split): kept
        base = node.args[0] if is_view(node) and layout is not None else None
        while isinstance(base, fx.Node):
            if base.meta.get("layout") == layout:
                node.replace_all_uses_with(base)
                break
            base = base.args[0] if is_view(base) else None
    for node in reversed(calls):  # views nothing reads any more (a view writes nothing: it can go)
        if is_view(node) and not node.users:
            graph.erase_node(node)
