"""What the graph passes share: the dataflow between a model's modules, and edits.

Passes never return a ``torch.fx.GraphModule``: they find patterns in a traced
graph, then edit a deep copy of the *original* module (replace submodules by
qualified name, swap parameters), so an ``nn.Sequential`` stays an ``nn.Sequential``
and a custom model keeps its class, forward and state-dict layout.

The graph comes from ``torch.fx`` symbolic tracing with torch, Brevitas and qnorm
layers as leaves (one ``call_module`` node per call).  An ``nn.Sequential`` that fx
cannot trace (a child with data-dependent control flow) falls back to its chain:
each child consumes the previous child's output, which is what Sequential means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import fx, nn

# Modules of these packages are opaque units: a pass sees the call, not the inside.
# (qnorm.train holds whole models, whose blocks must be traced through.)
LEAF_PACKAGES = ("torch.nn.", "brevitas.", "qnorm.nn.", "qnorm.passes.")


class _Tracer(fx.Tracer):
    def __init__(self, leaf_types: tuple[type, ...]) -> None:
        super().__init__()
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types):
            return True
        if isinstance(m, nn.Sequential):  # a container: its children are the units
            return False
        return type(m).__module__.startswith(LEAF_PACKAGES) or super().is_leaf_module(m, module_qualified_name)


def dataflow(model: nn.Module, leaf_types: tuple[type, ...] = ()) -> fx.Graph:
    """The model's dataflow graph (see the module docstring); ValueError if none can be built.

    ``leaf_types``: further module types to keep as units (a pass that matches them).
    """
    try:
        return fx_graph(model, leaf_types)
    except ValueError:
        if isinstance(model, nn.Sequential):
            return _chain(model)
        raise


def fx_graph(model: nn.Module, leaf_types: tuple[type, ...] = ()) -> fx.Graph:
    """The ``torch.fx`` graph alone, without the Sequential fallback: a pass that must
    see inside every non-leaf module cannot use a chain of opaque children."""
    try:
        return _Tracer(leaf_types).trace(model)
    except Exception as err:  # tracing runs arbitrary user forward code: any error means "not traceable"
        raise ValueError(
            f"cannot trace {type(model).__name__} with torch.fx ({type(err).__name__}: {err}); "
            "graph passes need a symbolically traceable model or an nn.Sequential"
        ) from err


def _chain(seq: nn.Sequential) -> fx.Graph:
    graph = fx.Graph()
    value = graph.placeholder("input")
    for name, _ in _flatten(seq, ""):
        value = graph.call_module(name, (value,))
    graph.output(value)
    return graph


def _flatten(seq: nn.Sequential, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for name, child in seq.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            yield from _flatten(child, qualified + ".")
        else:
            yield qualified, child


def call_counts(graph: fx.Graph) -> dict[str, int]:
    """How often each module (by qualified name) is called in the forward."""
    counts: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            counts[n.target] = counts.get(n.target, 0) + 1
    return counts


def check_single_call(name: str, counts: dict[str, int]) -> None:
    """A module called twice (or shared under two names, which fx reports as one
    target called twice) cannot be edited for one call site without changing the
    other, so it is refused."""
    if counts.get(name, 0) != 1:
        raise ValueError(
            f"module {name!r} is called {counts.get(name, 0)} times in the forward; a pass can only "
            "rewrite a module with exactly one call site (give each use its own module)"
        )


def module_calls(graph: fx.Graph, root: nn.Module, types: type | tuple[type, ...]) -> list[fx.Node]:
    """The ``call_module`` nodes of modules of ``types``, each checked to be its module's only call."""
    counts = call_counts(graph)
    nodes = [n for n in graph.nodes if n.op == "call_module" and isinstance(root.get_submodule(n.target), types)]
    for n in nodes:
        check_single_call(n.target, counts)
    return nodes


def describe(node: object, root: nn.Module) -> str:
    """A node as a user reads it: the module's name and type, or the function called."""
    if not isinstance(node, fx.Node):
        return f"the constant {node!r}"
    if node.op == "call_module":
        return f"{node.target!r} ({type(root.get_submodule(node.target)).__name__})"
    if node.op == "placeholder":
        return f"the model input {node.target!r}"
    target = getattr(node.target, "__name__", node.target)
    return f"{node.op} {target!r} (node {node.name!r})"


def tensor_input(node: fx.Node, root: nn.Module) -> fx.Node:
    """The one tensor input of a single-input module call (refused otherwise)."""
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        raise ValueError(f"{describe(node, root)} must be called with exactly one tensor argument")
    return node.args[0]


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    root.set_submodule(name, new)


def replace_modules(root: nn.Module, convert: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """Replace, in place, every module of ``root`` for which ``convert`` returns a module.

    ``convert`` sees modules outermost first; the inside of a replaced module is not
    visited.  A module shared under several names is converted once and stays
    shared.  Returns ``root``, or ``convert(root)`` when ``root`` itself is replaced.
    Passes call it on a deep copy.
    """
    done: dict[int, nn.Module | None] = {}

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent._modules.items()):  # named_children() hides repeats
            if child is None:
                continue
            if id(child) not in done:
                done[id(child)] = convert(child)
            new = done[id(child)]
            if new is None:
                visit(child)
            else:
                setattr(parent, name, new)

    top = convert(root)
    if top is not None:
        return top
    visit(root)
    return root
