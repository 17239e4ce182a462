"""Which axis each norm of a model normalizes, and which norms convert() cannot swap.

:func:`~qnorm.passes.convert` swaps norm *modules* for qnorm layers, which normalize
the last axis of their input.  That is right for a module running the stock
``nn.LayerNorm`` / ``nn.RMSNorm`` / ``CRMSNorm`` forward and wrong or impossible in
two patterns, which :func:`norm_axes` finds before anything is swapped:

* **A subclass that overrides forward**, e.g. ConvNeXt's / timm's channels-first
  ``LayerNorm2d`` (NCHW permuted to NHWC, the stock forward, permuted back).
  Swapped blindly, the qnorm layer would normalize W.  Given a sample model input,
  the module is exported with ``torch.export`` on the input the model hands it, and
  one shape is accepted: axis permutations (permute, transpose, movedim,
  contiguous), one ``layer_norm`` / ``rms_norm`` call with the module's own
  normalized_shape, weight, bias and eps, then permutations that restore the input
  layout.  The result is the input axis it normalizes (:class:`Axis`); convert
  wraps the qnorm layer in the same move (:class:`~qnorm.passes.PermutedNorm`).
  Any other forward, or no sample input, is refused with the reason.
* **A functional** ``F.layer_norm`` / ``F.rms_norm`` call in a custom module: there
  is no module to swap, so the norm would stay float.  With a sample input the
  model runs once (eval, no grad) under a torch function mode that records every
  such call with the module running it; without one, the model's ``torch.fx`` graph
  shows them (custom modules traced through).  Either way they are refused.

Library modules (torch.nn, Brevitas, qnorm) are trusted to use their norms as
modules, and only custom modules are looked into, with one exception:
``nn.TransformerEncoderLayer``'s inference fast path (eval, no gradients) computes
``norm1``/``norm2`` itself from their weights, bypassing any module swapped in, so
those are refused too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export import ExportedProgram
from torch.overrides import TorchFunctionMode

from qnorm.passes._graph import LEAF_PACKAGES, fx_graph
from qnorm.passes.crms import CRMSNorm

NORM_BASES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, CRMSNorm)
# What each traceable base's stock forward exports to.
_NORM_OPS = {nn.LayerNorm: torch.ops.aten.layer_norm.default, nn.RMSNorm: torch.ops.aten.rms_norm.default}
FUNCTIONAL_NORMS: dict[Any, str] = {
    F.layer_norm: "torch.nn.functional.layer_norm",
    F.rms_norm: "torch.nn.functional.rms_norm",
    torch.layer_norm: "torch.layer_norm",
    torch.rms_norm: "torch.rms_norm",
}
# Library modules that compute these child norms themselves on a fast path.
_BYPASSING: dict[type[nn.Module], tuple[str, ...]] = {nn.TransformerEncoderLayer: ("norm1", "norm2")}
# Ops that only reorder or copy a tensor's axes (an Unrecognised forward otherwise).
_COPIES = (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default)


@dataclass(frozen=True)
class Axis:
    """A norm over axis ``dim`` of ``ndim``-D inputs (the stock forward: ``dim = ndim - 1``)."""

    dim: int
    ndim: int


@dataclass(frozen=True)
class FunctionalCall:
    """A functional norm call: the qualified name of the module running it ('' = the model)."""

    module: str
    function: str


class Unrecognised(Exception):
    """A norm module's exported forward is not one convert() can reproduce (the reason)."""


def norm_axes(model: nn.Module, example_input: Any | None) -> dict[int, Axis]:
    """``{id(module): Axis}`` for each norm module whose forward is not the stock one.

    ``example_input``: a sample model input (a tensor, or a tuple of positional
    arguments), or None.  Raises one ValueError listing, by module name, every norm
    convert() cannot swap correctly: overridden forwards it cannot recognise (or
    see: no sample input) and functional norm calls in custom modules.
    """
    norms = {name: m for name, m in model.named_modules() if isinstance(m, NORM_BASES)}
    custom = {name: m for name, m in norms.items() if overrides_forward(m)}
    if example_input is None:
        calls, problems = _traced_calls(model)
        problems += [
            f"{_who(name, m)} overrides {_base(m).__name__}.forward, so which axis it normalizes is unknown "
            "without running it: pass example_input= (a sample model input) to convert()"
            for name, m in custom.items()
        ]
        axes: dict[int, Axis] = {}
    else:
        seen = observe(model, example_input, custom)
        calls = seen.calls
        axes, problems = _recognised_axes(custom, seen.inputs)
    problems += [
        f"{_who(call.module, model.get_submodule(call.module))} calls {call.function} in its forward: a functional "
        "norm has no module for convert() to swap, so it would stay float; make it an nn.LayerNorm / nn.RMSNorm "
        "submodule"
        for call in dict.fromkeys(calls)
        if call.module not in norms
    ]
    problems = _bypassed(model) + problems
    if problems:
        raise ValueError("convert() cannot swap these norms correctly:\n  " + "\n  ".join(problems))
    return axes


def _recognised_axes(
    custom: Mapping[str, nn.Module], inputs: Mapping[str, tuple[tuple[Any, ...], dict[str, Any]]]
) -> tuple[dict[int, Axis], list[str]]:
    """The axes of overridden-forward norms that normalize another axis than the last, and the refusals."""
    axes, problems = {}, []
    for name, m in custom.items():
        if name not in inputs:
            problems.append(f"{_who(name, m)} overrides forward and did not run on example_input: its axis is unknown")
            continue
        try:
            axis = traced_axis(m, *inputs[name])
        except Unrecognised as why:
            problems.append(f"{_who(name, m)} overrides {_base(m).__name__}.forward: {why}")
            continue
        if axis.dim != axis.ndim - 1:  # the last axis: the plain swap is right
            axes[id(m)] = axis
    return axes, problems


def _bypassed(model: nn.Module) -> list[str]:
    """Norms a library parent computes itself on a fast path (swapping them changes nothing there)."""
    problems = []
    for name, parent in model.named_modules():
        children = next((c for cls, c in _BYPASSING.items() if isinstance(parent, cls)), ())
        for child in (c for c in children if isinstance(getattr(parent, c), NORM_BASES)):
            qualified = f"{name}.{child}" if name else child
            problems.append(
                f"{_who(qualified, getattr(parent, child))} belongs to {type(parent).__name__}, whose inference fast "
                "path (eval, no gradients) computes it in float from its weight and bias, bypassing any module "
                "swapped in; build the block from its submodules in a module of your own"
            )
    return problems


def overrides_forward(module: nn.Module) -> bool:
    """True when a norm module's class replaces its base's stock forward."""
    return type(module).forward is not _base(module).forward


def _base(module: nn.Module) -> type[nn.Module]:
    return next(base for base in NORM_BASES if isinstance(module, base))


def _who(name: str, module: nn.Module) -> str:
    return f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


# --------------------------------------------------------------------------- running the model


@dataclass(frozen=True)
class Observed:
    """What one run of the model showed: watched modules' first inputs (args, kwargs), norm calls."""

    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]]
    calls: list[FunctionalCall]


class _NormCallRecorder(TorchFunctionMode):
    """Records every functional norm call with the innermost module running (top of ``stack``)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[FunctionalCall] = []

    def __torch_function__(
        self, func: Any, types: Collection[type], args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        function = FUNCTIONAL_NORMS.get(func)
        if function is not None:
            self.calls.append(FunctionalCall(self.stack[-1], function))
        return func(*args, **(kwargs or {}))


def observe(model: nn.Module, example_input: Any, watch: Collection[str]) -> Observed:
    """Run ``model(*example_input)`` once in eval mode without gradients (modes restored).

    Eval mode, so the run changes no state (running statistics, calibrations).
    """
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    stack: list[str] = []
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def enter(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            stack.append(name)
            if name in watch and name not in inputs:
                inputs[name] = (args, kwargs)

        return hook

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stack.pop()

    modes = {m: m.training for m in model.modules()}
    handles = []
    recorder = _NormCallRecorder(stack)
    try:
        for name, m in model.named_modules():
            handles.append(m.register_forward_pre_hook(enter(name), with_kwargs=True))
            handles.append(m.register_forward_hook(leave))
        model.eval()
        with torch.no_grad(), recorder:
            model(*args)
    except Exception as err:  # the user's forward on the user's input: any failure means "cannot observe"
        raise ValueError(
            f"convert() could not run {type(model).__name__} on example_input ({type(err).__name__}: {err})"
        ) from err
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return Observed(inputs, recorder.calls)


def _traced_calls(model: nn.Module) -> tuple[list[FunctionalCall], list[str]]:
    """Functional norm calls in the model's fx graph (norm modules kept whole), and the
    refusal of a model fx cannot trace unless it has no custom module to hide one."""
    custom = [name for name, m in model.named_modules() if not _library(m)]
    if not custom:
        return [], []
    try:
        graph = fx_graph(model, NORM_BASES)
    except ValueError as err:
        named = ", ".join(map(repr, custom[:4])) + (f" and {len(custom) - 4} more" if len(custom) > 4 else "")
        unseen = (
            f"{err}, so functional norm calls in its custom modules ({named}) cannot be "
            "ruled out: pass example_input= (a sample model input) to convert() to run it instead"
        )
        return [], [unseen]
    calls = [
        FunctionalCall(_innermost(node), FUNCTIONAL_NORMS[node.target])
        for node in graph.nodes
        if node.op == "call_function" and node.target in FUNCTIONAL_NORMS
    ]
    return calls, []


def _library(module: nn.Module) -> bool:
    return type(module).__module__.startswith(LEAF_PACKAGES) or isinstance(module, NORM_BASES)


def _innermost(node: fx.Node) -> str:
    """The qualified name of the module whose forward made ``node`` ('' for the model's own)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


# --------------------------------------------------------------------------- an overridden forward


def traced_axis(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Axis:
    """The input axis ``module`` normalizes, from its export on ``args``/``kwargs``;
    :class:`Unrecognised` unless the forward is permutations, the norm, permutations back."""
    base = _base(module)
    if base not in _NORM_OPS:
        raise Unrecognised(f"convert() traces overridden forwards of {', '.join(b.__name__ for b in _NORM_OPS)} only")
    try:
        program = torch.export.export(module, tuple(args), dict(kwargs))
    except Exception as err:  # exporting runs the user's forward: any failure means "cannot see it"
        raise Unrecognised(f"torch.export cannot export it ({type(err).__name__}: {err})") from err
    graph = program.graph
    users = [n for n in graph.nodes if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    if len(users) != 1 or not isinstance(users[0].meta.get("val"), torch.Tensor):
        raise Unrecognised(f"its forward takes {len(users)} inputs; a norm takes one tensor")
    chain, norm, at_norm, out_axes = _follow(users[0], _NORM_OPS[base])
    stray = [n.target for n in graph.nodes if n.op == "call_function" and n not in chain]
    if stray:
        raise Unrecognised(f"its forward also computes {', '.join(map(str, stray))}")
    if out_axes != list(range(len(out_axes))):
        raise Unrecognised(f"its output's axes are the input's {out_axes}, not in their order")
    _check_norm_call(norm, module, program)
    return Axis(at_norm[-1], len(at_norm))


def _follow(start: fx.Node, norm_op: Any) -> tuple[set[fx.Node], fx.Node, list[int], list[int]]:
    """Walk the single chain from the input to the output: its nodes, the norm call,
    the input axes at the norm (``axes[i]``: the input axis now at i) and at the output."""
    axes = list(range(start.meta["val"].dim()))
    chain: set[fx.Node] = set()
    norm, at_norm, node = None, axes, start
    while True:
        users = list(node.users)
        if len(users) != 1:
            raise Unrecognised(f"{node.name} is used {len(users)} times; a norm's forward is one chain")
        prev, node = node, users[0]
        if node.op == "output":
            if len(node.args[0]) != 1:
                raise Unrecognised("its forward returns more than one value")
            break
        if node.op != "call_function" or node.args[0] is not prev:
            raise Unrecognised(f"its forward passes {prev.name} to {node.target} as other than its input tensor")
        chain.add(node)
        if node.target == norm_op:
            if norm is not None:
                raise Unrecognised(f"its forward calls {norm_op} twice")
            norm, at_norm = node, axes
        elif node.target in _NORM_OPS.values():
            raise Unrecognised(f"its forward calls {node.target}, not its base's {norm_op}")
        else:
            axes = _moved(node, axes)
    if norm is None:
        raise Unrecognised(f"its exported forward has no {norm_op} on the way from its input to its output")
    return chain, norm, at_norm, axes


def _moved(node: fx.Node, axes: list[int]) -> list[int]:
    """``axes`` after a layout op (permute, transpose, movedim, a copy); Unrecognised for any other op."""
    target, nd = node.target, len(axes)
    if target == torch.ops.aten.permute.default:
        return [axes[d % nd] for d in node.args[1]]
    if target == torch.ops.aten.transpose.int:
        a, b = (d % nd for d in node.args[1:3])
        moved = list(axes)
        moved[a], moved[b] = axes[b], axes[a]
        return moved
    if target == torch.ops.aten.movedim.int:
        src, dst = (d % nd for d in node.args[1:3])
        order = [d for d in range(nd) if d != src]
        order.insert(dst, src)
        return [axes[d] for d in order]
    if target in _COPIES:
        return axes
    raise Unrecognised(f"its forward computes {target} between its input and its output, not only axis permutations")


def _check_norm_call(node: fx.Node, module: nn.Module, program: ExportedProgram) -> None:
    """The norm call uses the module's own normalized_shape, weight, bias and eps."""
    args = _arguments(node)
    if list(args["normalized_shape"]) != list(module.normalized_shape):
        raise Unrecognised(
            f"it normalizes over {list(args['normalized_shape'])}, its normalized_shape is {list(module.normalized_shape)}"
        )
    params = program.graph_signature.inputs_to_parameters
    for name in ("weight", "bias") if "bias" in args else ("weight",):
        given = args[name]
        used = params.get(given.name) if isinstance(given, fx.Node) else given
        mine = getattr(module, name) is not None
        if used != (name if mine else None):
            raise Unrecognised(f"its {node.target} call's {name} is {used!r}, not the module's own {name}")
    if args["eps"] != module.eps:
        raise Unrecognised(f"its {node.target} call has eps={args['eps']!r}, the module's eps is {module.eps!r}")


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The op call's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    values = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        else:
            values[arg.name] = arg.default_value if arg.has_default_value() else None
    return values
