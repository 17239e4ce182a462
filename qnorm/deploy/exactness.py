"""Static proof that a float graph computes the same bits under any compiler, or a refusal.

Rounding is what makes float graphs compiler-dependent: a compiler may sum in
another order, contract ``a * b + c`` into an FMA, or divide by multiplying with
a reciprocal.  None of that changes a result that is *exact*.  So
:func:`prove_exact` walks a decomposed ExportedProgram and tracks, per tensor,

* :class:`Grid` ``(exp, bound)``: every element is ``k * 2**exp`` with an integer
  ``|k| <= bound``.  With ``bound <= 2**24`` every such value is a float32, and so
  is every partial sum of a sum whose absolute values add up to at most 2^24
  units: sums, products and power-of-two scalings are exact in any order.
* ``FREE``: a float on no grid (the model input before its quantizer).  It may
  only pass through ops that are one correctly rounded IEEE operation with a
  single possible result — scaling by ±2^j, ``round`` (ties to even, as
  ``torch.round``), ``clamp``, ``relu`` — and into qnorm integer ops, which
  quantize their input by the arithmetic spec's own rule.
* :class:`Const`: a parameter or buffer with its values (tight accumulator
  bounds: per output, ``sum |w| * max |x| + |b|``, which never exceeds the
  textbook ``fan-in * max |x| * max |w| + max |b|``).

Everything else is a *problem*: a float op outside this set (softmax, GELU, a
float LayerNorm, a division by a non-power-of-two, a mean over a count that is
not a power of two), a quantizer or qnorm layer whose scale is not a power of
two, a bias off its accumulator's grid (a float bias), an accumulator that may
exceed 2^24 units.  All problems are collected and raised together
(:class:`NotDeployableError`), each naming the module (torch.export's
``nn_module_stack``) and the op.  That is the project's "proven, or refused".
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch import fx

from qnorm.deploy.freeze import int_op_info
from qnorm.errors import DeployError
from qnorm.qformat import QFormat

EXACT_BITS = 24  # float32 significand: every integer up to 2^24 is exact
EXACT_LIMIT = 1 << EXACT_BITS
_MIN_EXP, _MAX_EXP = -149, 127  # float32: smallest subnormal step, largest exponent
_SHOWN = 12  # problems listed in full before summarizing
_WEIGHT_LEVELS = 1 << 16  # weights on a grid finer than 16-bit integers: no quantizer made them


class NotDeployableError(DeployError):
    """The model cannot be compiled with a proof of bit-exactness; ``problems`` says why."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = "\n".join(f"  - {p}" for p in problems[:_SHOWN])
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        super().__init__(
            f"model is not deployable bit-exactly ({len(problems)} problem(s)); a compiled float graph is "
            f"exact only on power-of-two grids below 2^{EXACT_BITS} units:\n{shown}{more}"
        )


@dataclass(frozen=True)
class Grid:
    """Every element is ``k * 2**exp`` with an integer ``|k| <= bound`` (None: not bounded yet)."""

    exp: int
    bound: int | None

    def units(self, exp: int) -> int | None:
        """The bound in units of ``2**exp`` (``exp <= self.exp``)."""
        if self.bound is None:
            return None
        return self.bound << (self.exp - exp) if self.bound else 0


class _Free:
    def __repr__(self) -> str:
        return "FREE"


class _Shape:
    """A symbolic size (sym_size and arithmetic on it): no tensor."""


class _Bad:
    """The value of a node that already raised a problem: later ops stay silent."""


FREE, SHAPE, BAD = _Free(), _Shape(), _Bad()


@dataclass(frozen=True, eq=False)
class Const:
    value: torch.Tensor


@dataclass(frozen=True)
class Accumulator:
    """The proven bound of one exact accumulation (linear, conv, add, mean, ...)."""

    module: str
    op: str
    exp: int
    bound: int

    @property
    def headroom_bits(self) -> float:
        return EXACT_BITS - math.log2(max(self.bound, 1))


@dataclass
class ExactnessReport:
    """What :func:`prove_exact` proved: every accumulation bound and the output grids."""

    accumulators: list[Accumulator] = field(default_factory=list)
    int_ops: list[str] = field(default_factory=list)  # "name (Layer)" of every qnorm op
    outputs: list[Grid | None] = field(default_factory=list)  # None: an output on no grid

    @property
    def tightest(self) -> Accumulator | None:
        """The accumulation closest to 2^24 units."""
        return min(self.accumulators, key=lambda a: a.headroom_bits, default=None)

    def summary(self) -> str:
        worst = self.tightest
        tight = ""
        if worst is not None:
            bits = math.log2(max(worst.bound, 1))
            tight = f"; tightest: {worst.module} ({worst.op}) up to 2^{bits:.1f} of 2^{EXACT_BITS} units"
        return (
            f"proven exact: {len(self.accumulators)} float accumulations on power-of-two grids, "
            f"{len(self.int_ops)} qnorm integer op(s){tight}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "accumulators": [
                {
                    "module": a.module, "op": a.op, "grid_exp": a.exp, "bound": a.bound,
                    "headroom_bits": round(a.headroom_bits, 2),
                }  # fmt: skip
                for a in self.accumulators
            ],
            "int_ops": list(self.int_ops),
            "outputs": [None if g is None else {"grid_exp": g.exp, "bound": g.bound} for g in self.outputs],
        }


# --------------------------------------------------------------------------- exact grids of numbers


def scalar_grid(v: float | int) -> Grid:
    """The grid of one number: ``v = k * 2**exp`` with k odd (exact, via Fraction)."""
    q = Fraction(v)
    if q == 0:
        return Grid(0, 0)
    den_log = q.denominator.bit_length() - 1
    if q.denominator != 1 << den_log:
        raise ValueError(f"{v!r} is not a dyadic number")  # unreachable for floats and ints
    num, exp = abs(q.numerator), -den_log
    tz = (num & -num).bit_length() - 1
    return Grid(exp + tz, num >> tz)


def tensor_grid(t: torch.Tensor) -> Grid | None:
    """The coarsest grid holding every element of ``t`` exactly; None for NaN/Inf."""
    v = t.detach().to("cpu", torch.float64).numpy().ravel()  # exact: float32 widens
    if not np.isfinite(v).all():
        return None
    nz = v[v != 0]
    if nz.size == 0:
        return Grid(0, 0)
    mant, ex = np.frexp(nz)
    k = np.ldexp(np.abs(mant), 53).astype(np.int64)  # the exact 53-bit significands
    tz = np.log2((k & -k).astype(np.float64)).astype(np.int64)
    exp = int((ex - 53 + tz).min())
    return Grid(exp, int(np.ldexp(np.abs(nz).max(), -exp)))


def integers_on(t: torch.Tensor, exp: int) -> np.ndarray:
    """``t / 2**exp`` as int64 (exact: ``t`` lies on that grid)."""
    return np.ldexp(t.detach().to("cpu", torch.float64).numpy(), -exp).astype(np.int64)


def power_of_two_exponent(v: Any) -> int | None:
    """j where ``v == ±2**j`` (a Python number or a one-element tensor), else None."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v == 0:
        return None
    g = scalar_grid(v)
    return g.exp if g.bound == 1 else None


# --------------------------------------------------------------------------- the walk

_LAYOUT = frozenset(
    {
        "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
        "aten.transpose.int", "aten.t.default", "aten.unsqueeze.default", "aten.squeeze.dim",
        "aten.squeeze.dims", "aten.squeeze.default", "aten.expand.default", "aten.clone.default",
        "aten.alias.default", "aten.slice.Tensor", "aten.select.int", "aten.flatten.using_ints",
        "aten.unflatten.int", "aten.repeat.default",
    }
)  # fmt: skip
_SHAPE_FUNCS = (operator.mul, operator.add, operator.sub, operator.floordiv, operator.neg)
_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
# What a user meets most, named in the refusal.
_FLOAT_OPS = {
    "_softmax": "softmax", "gelu": "GELU", "native_layer_norm": "a float LayerNorm: use a qnorm norm kind",
    "_fused_rms_norm": "a float RMSNorm: use a qnorm norm kind", "exp": "exp", "sqrt": "sqrt",
    "rsqrt": "rsqrt", "tanh": "tanh", "sigmoid": "sigmoid", "erf": "erf", "log": "log",
    "_native_batch_norm_legit_no_training": "a float BatchNorm: fold it (qnorm.passes)",
}  # fmt: skip


def prove_exact(ep: torch.export.ExportedProgram) -> ExactnessReport:
    """Prove ``ep`` (decomposed, float32) exact on power-of-two grids; NotDeployableError if not."""
    walk = _Walk(ep)
    walk.run()
    if walk.problems:
        raise NotDeployableError(walk.problems)
    return walk.report


class _Walk:
    def __init__(self, ep: torch.export.ExportedProgram) -> None:
        self.ep = ep
        self.values: dict[fx.Node, Any] = {}
        self.problems: list[str] = []
        self.report = ExactnessReport()
        sig = ep.graph_signature
        self.consts = {
            **{k: ep.state_dict[v] for k, v in sig.inputs_to_parameters.items()},
            # a non-persistent buffer is exported among the constants, not the state dict
            **{k: ep.state_dict[v] if v in ep.state_dict else ep.constants[v] for k, v in sig.inputs_to_buffers.items()},
            **{k: ep.constants[v] for k, v in sig.inputs_to_lifted_tensor_constants.items()},
        }

    # ---- driving

    def run(self) -> None:
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                self.values[node] = self._placeholder(node)
            elif node.op == "output":
                self.report.outputs = [self._output(v) for v in _flat(node.args[0])]
            elif node.op == "call_function":
                self.values[node] = self._call(node)
            else:
                self._problem(node, f"unexpected graph node kind {node.op!r}")
                self.values[node] = BAD

    def _placeholder(self, node: fx.Node) -> Any:
        if node.name in self.consts:
            return Const(self.consts[node.name])
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype != torch.float32:
            self._problem(node, f"model input {node.name!r} has dtype {val.dtype}; the compiled model takes float32")
            return BAD
        return FREE

    def _output(self, v: Any) -> Grid | None:
        value = self.values.get(v) if isinstance(v, fx.Node) else None
        if isinstance(value, Const):
            return tensor_grid(value.value)
        return value if isinstance(value, Grid) else None

    def _call(self, node: fx.Node) -> Any:
        val = node.meta.get("val")
        if node.target in _SHAPE_FUNCS or val is None or isinstance(val, _SCALARS):
            return SHAPE  # sizes, asserts on sizes: no tensor data
        name = str(node.target)
        args = [self._resolve(a) for a in node.args]
        inputs_bad = any(a is BAD for a in _flat(args))
        if node.target is operator.getitem:  # an element of a multi-output op, which is never exact here
            return BAD if inputs_bad else self._problem(node, f"{_op(node)} of a multi-output op")
        handler = _HANDLERS.get(name)
        if handler is None and name not in _LAYOUT:
            # reported even after an upstream problem: every op the model would need is named
            hint = _FLOAT_OPS.get(_op(node).removeprefix("aten."), "")
            return self._problem(node, f"{_op(node)}{f' ({hint})' if hint else ''} has no exact float form here")
        if inputs_bad:
            return BAD
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
            produced = getattr(val, "dtype", type(val).__name__)
            return self._problem(node, f"{_op(node)} produces {produced}; only float32 is proven here")
        return self._layout(node, args) if handler is None else handler(self, node, args)

    def _resolve(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.values[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self._resolve(x) for x in a)
        return a

    # ---- helpers

    def _problem(self, node: fx.Node, message: str, where: str | None = None) -> _Bad:
        problem = f"{where or _where(node)}: {message}"
        if problem not in self.problems:
            self.problems.append(problem)
        return BAD

    def _grid(self, node: fx.Node, v: Any, what: str, limit: bool = True) -> Grid | None:
        """``v`` as a Grid bounded by 2^24 units (``limit``), or a problem (a float on no
        grid, NaN constants, unbounded, too large to compute with exactly)."""
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            g = scalar_grid(v)
        elif isinstance(v, Const):
            g = tensor_grid(v.value)
            if g is None:
                self._problem(node, f"{what} of {_op(node)} holds NaN or Inf")
                return None
        elif v is FREE:
            self._problem(node, f"{what} of {_op(node)} is a float on no power-of-two grid: the op would round")
            return None
        elif isinstance(v, Grid):
            g = v
        else:
            self._problem(node, f"{what} of {_op(node)} is a symbolic size, not a tensor")
            return None
        if g.bound is None:
            self._problem(node, f"{what} of {_op(node)} is not bounded (a round without a clamp)")
            return None
        if limit and g.bound > EXACT_LIMIT:
            bits = math.log2(g.bound)
            self._problem(node, f"{what} of {_op(node)} reaches 2^{bits:.2f} units of 2^{g.exp} (> 2^{EXACT_BITS})")
            return None
        return g

    def _checked(self, node: fx.Node, g: Grid, where: str | None = None, record: bool = True) -> Grid | _Bad:
        """``g`` if float32 holds it exactly (bound <= 2^24, exponent in range), else a problem."""
        assert g.bound is not None
        if g.bound > EXACT_LIMIT:
            return self._problem(
                node,
                f"{_op(node)} may reach 2^{math.log2(g.bound):.2f} units of 2^{g.exp} "
                f"(> 2^{EXACT_BITS}: float32 would round); use fewer bits, smaller weights or a requantization",
                where,
            )
        if g.bound and not (_MIN_EXP <= g.exp and g.exp + g.bound.bit_length() <= _MAX_EXP):
            return self._problem(node, f"{_op(node)} leaves float32's exponent range (grid 2^{g.exp})", where)
        if record:
            self.report.accumulators.append(Accumulator(where or _where(node), _op(node), g.exp, g.bound))
        return g

    # ---- ops

    def _layout(self, node: fx.Node, args: list[Any]) -> Any:
        x = args[0]
        if not isinstance(x, Const):
            return x
        try:  # the constant itself, moved (symbolic sizes are batch sizes: 1 gives its values)
            concrete = _concrete(node.args[1:])
            return Const(node.target(x.value, *concrete, **node.kwargs))
        except (RuntimeError, TypeError, ValueError):
            g = self._grid(node, x, "input")
            return BAD if g is None else g

    def _scale(self, node: fx.Node, x: Any, j: int) -> Any:
        """``x * 2**j``: exact for every value (within the exponent range)."""
        if x is FREE:
            return FREE
        g = self._grid(node, x, "input")
        return BAD if g is None else self._checked(node, Grid(g.exp + j, g.bound), record=False)

    def mul(self, node: fx.Node, args: list[Any]) -> Any:
        """Scaling by a scalar ±2^j (any input), else a product of two grids."""
        a, b = args[0], args[1]
        for x, s in ((a, b), (b, a)):
            if isinstance(s, (int, float)):
                j = power_of_two_exponent(s)
                if j is None:
                    return self._problem(node, f"multiplication by {s!r} (not a power of two) rounds")
                return self._scale(node, x, j)
        ga, gb = self._grid(node, a, "left operand"), self._grid(node, b, "right operand")
        if ga is None or gb is None:
            return BAD
        return self._checked(node, Grid(ga.exp + gb.exp, ga.bound * gb.bound), record=False)

    def div(self, node: fx.Node, args: list[Any]) -> Any:
        x, d = args[0], args[1]
        if node.kwargs.get("rounding_mode") is not None:
            return self._problem(node, f"{_op(node)} with rounding_mode={node.kwargs['rounding_mode']!r} is not exact")
        j = power_of_two_exponent(d.value if isinstance(d, Const) else d)
        if j is None:
            shown = d if isinstance(d, (int, float)) else "a tensor"
            return self._problem(
                node, f"division by {shown} (not a power of two: rounds, and compilers may use a reciprocal); "
                "use power-of-two scales",
            )  # fmt: skip
        return self._scale(node, x, -j)

    def add(self, node: fx.Node, args: list[Any]) -> Any:
        """``a + b`` or ``a - b`` on a common grid; a constant off the other's grid is an unquantized bias."""
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            return self._problem(node, f"{_op(node)} with alpha={alpha} is not supported")
        ga = self._grid(node, args[0], "left operand", limit=False)
        gb = self._grid(node, args[1], "right operand", limit=False)
        if ga is None or gb is None:
            return BAD
        for const, g, other in ((args[0], ga, gb), (args[1], gb, ga)):
            if isinstance(const, Const) and g.bound and g.exp < other.exp:
                return self._problem(node, _off_grid_bias(other.exp))
        exp = min(ga.exp, gb.exp)
        return self._checked(node, Grid(exp, ga.units(exp) + gb.units(exp)))

    def round(self, node: fx.Node, args: list[Any]) -> Any:
        """Round to integers (ties to even: torch.round, and TVM's nearbyint)."""
        x = args[0]
        if x is FREE:
            return Grid(0, None)
        if isinstance(x, Grid) and x.bound is None:
            return Grid(max(x.exp, 0), None)
        g = self._grid(node, x, "input")
        if g is None or g.exp >= 0:
            return BAD if g is None else g
        return Grid(0, -((-g.bound) >> -g.exp))  # |round(v)| <= ceil(max |v|)

    def clamp(self, node: fx.Node, args: list[Any]) -> Any:
        """Clamp to scalar limits: the result lies on the finer of the input's and the limits' grids."""
        x = args[0]
        lims = [v for v in (*args[1:3], node.kwargs.get("min"), node.kwargs.get("max")) if v is not None]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in lims):
            return self._problem(node, f"{_op(node)} with tensor limits is not supported")
        if x is FREE:
            return FREE
        g = x if isinstance(x, Grid) else self._grid(node, x, "input")
        if g is None:
            return BAD
        exp = min([g.exp, *(scalar_grid(v).exp for v in lims if v != 0)])
        bounds = [] if g.bound is None else [g.units(exp)]
        if len(lims) == 2:
            bounds.append(max(scalar_grid(v).units(exp) for v in lims))
        return Grid(exp, min(bounds) if bounds else None)

    def same_grid(self, node: fx.Node, args: list[Any]) -> Any:
        """relu, neg: every output is an input value, its negation or 0."""
        x = args[0]
        if x is FREE or isinstance(x, Grid):
            return x
        g = self._grid(node, x, "input")
        return BAD if g is None else g

    def mean(self, node: fx.Node, args: list[Any]) -> Any:
        return self._reduce(node, args, divide=True)

    def sum(self, node: fx.Node, args: list[Any]) -> Any:
        return self._reduce(node, args, divide=False)

    def _reduce(self, node: fx.Node, args: list[Any], divide: bool) -> Any:
        shape = node.args[0].meta["val"].shape
        dims = args[1] if len(args) > 1 and args[1] is not None else list(range(len(shape)))
        sizes = [shape[d] for d in dims]
        if not all(isinstance(s, int) for s in sizes):
            return self._problem(node, f"{_op(node)} over a symbolic (batch) dimension")
        n = math.prod(sizes)
        g = self._grid(node, args[0], "input")
        if g is None:
            return BAD
        if not divide:
            return self._checked(node, Grid(g.exp, g.bound * n))
        j = power_of_two_exponent(n)
        if j is None:
            return self._problem(node, f"mean over {n} elements divides by a non-power-of-two")
        return self._checked(node, Grid(g.exp - j, g.bound * n))

    def avg_pool2d(self, node: fx.Node, args: list[Any]) -> Any:
        kernel = list(args[1]) * (2 if len(args[1]) == 1 else 1)
        padding = args[3] if len(args) > 3 else 0
        ceil_mode = args[4] if len(args) > 4 else False
        count_include_pad = args[5] if len(args) > 5 else True
        divisor = args[6] if len(args) > 6 and args[6] is not None else math.prod(kernel)
        padded = any(padding) if isinstance(padding, (list, tuple)) else bool(padding)
        if ceil_mode or (padded and not count_include_pad):
            return self._problem(node, f"{_op(node)} with ceil_mode or uncounted padding divides by varying counts")
        j = power_of_two_exponent(divisor)
        if j is None:
            return self._problem(node, f"{_op(node)} divides by {divisor}, not a power of two")
        g = self._grid(node, args[0], "input")
        return BAD if g is None else self._checked(node, Grid(g.exp - j, g.bound * math.prod(kernel)))

    def mm(self, node: fx.Node, args: list[Any]) -> Any:
        return self._contract(node, args[0], args[1], None, axis=-2)

    def bmm(self, node: fx.Node, args: list[Any]) -> Any:
        return self._contract(node, args[0], args[1], None, axis=-2)

    def addmm(self, node: fx.Node, args: list[Any]) -> Any:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return self._problem(node, f"{_op(node)} with beta/alpha other than 1 is not supported")
        return self._contract(node, args[1], args[2], args[0], axis=-2)

    def convolution(self, node: fx.Node, args: list[Any]) -> Any:
        if args[6]:
            return self._problem(node, f"{_op(node)}: transposed convolution is not supported")
        return self._contract(node, args[0], args[1], args[2], axis=None)

    def _contract(self, node: fx.Node, x: Any, w: Any, bias: Any, axis: int | None) -> Any:
        """Bound of ``x @ w`` (``axis``: w's contracted axis) or a convolution (axis None).

        Per output: ``max|x| * sum |w| + |b|`` when w is a constant, else
        ``fan-in * max|x| * max|w| + max|b|``; the bias must lie on the product grid.
        """
        gx, gw = self._grid(node, x, "input"), self._grid(node, w, "weight", limit=False)
        if gx is None or gw is None:
            return BAD
        if gw.bound > _WEIGHT_LEVELS:
            return self._problem(
                node, f"the weights are not on a coarse power-of-two grid ({gw.bound.bit_length()}-bit integers times "
                f"2^{gw.exp}): a non-power-of-two weight scale? (use e.g. Int8WeightPerTensorFixedPoint)",
            )  # fmt: skip
        exp = gx.exp + gw.exp
        w_shape = node.args[1].meta["val"].shape
        if isinstance(w, Const):
            ints = np.abs(integers_on(w.value, gw.exp))
            reduce_axes = (ints.ndim + axis,) if axis is not None else tuple(range(1, ints.ndim))
            per_out = ints.sum(axis=reduce_axes) * gx.bound  # (..., N) or (O,)
        else:
            fan_in = w_shape[axis] if axis is not None else math.prod(w_shape[1:])
            if not isinstance(fan_in, int):
                return self._problem(node, f"{_op(node)} contracts a symbolic dimension")
            per_out = np.array([fan_in * gx.bound * gw.bound], dtype=np.int64)
        if bias is not None:
            gb = self._grid(node, bias, "bias", limit=False)
            if gb is None:
                return BAD
            if gb.bound and gb.exp < exp:
                return self._problem(node, _off_grid_bias(exp))
            b = np.abs(integers_on(bias.value, exp)) if isinstance(bias, Const) else np.array([gb.units(exp)])
            try:  # per output where the shapes line up (they do for linear and conv biases)
                per_out = per_out + b
            except ValueError:
                per_out = per_out.max() + b.max()
        return self._checked(node, Grid(exp, int(np.max(per_out))))

    def cat(self, node: fx.Node, args: list[Any]) -> Any:
        parts = args[0]
        if any(p is FREE for p in parts):
            return FREE
        grids = [self._grid(node, p, "input") for p in parts]
        if any(g is None for g in grids):
            return BAD
        exp = min(g.exp for g in grids)
        return Grid(exp, max(g.units(exp) for g in grids))

    def int_op(self, node: fx.Node, args: list[Any]) -> Any:
        info = int_op_info(node.args[1])
        where = f"{info.name} ({info.layer})"
        op = info.op
        sides = (("input", op.in_fmt), ("output", op.out_fmt))
        bad = [f"{side} scale {fmt.scale!r}" for side, fmt in sides if not fmt.is_power_of_two]
        if bad:
            return self._problem(
                node, f"{' and '.join(bad)} not a power of two (calibrate with InputQuantizer(pow2=True))", where
            )
        self.report.int_ops.append(where)
        return Grid(math.frexp(op.out_fmt.scale)[1] - 1, max(-op.out_fmt.lo, op.out_fmt.hi))


_HANDLERS = {
    "aten.mul.Tensor": _Walk.mul,
    "aten.mul.Scalar": _Walk.mul,
    "aten.div.Tensor": _Walk.div,
    "aten.div.Scalar": _Walk.div,
    "aten.add.Tensor": _Walk.add,
    "aten.add.Scalar": _Walk.add,
    "aten.sub.Tensor": _Walk.add,
    "aten.sub.Scalar": _Walk.add,
    "aten.round.default": _Walk.round,
    "aten.clamp.default": _Walk.clamp,
    "aten.relu.default": _Walk.same_grid,
    "aten.neg.default": _Walk.same_grid,
    "aten.mean.dim": _Walk.mean,
    "aten.sum.dim_IntList": _Walk.sum,
    "aten.avg_pool2d.default": _Walk.avg_pool2d,
    "aten.mm.default": _Walk.mm,
    "aten.bmm.default": _Walk.bmm,
    "aten.addmm.default": _Walk.addmm,
    "aten.convolution.default": _Walk.convolution,
    "aten.cat.default": _Walk.cat,
    "qnorm.int_op.default": _Walk.int_op,
}


def _off_grid_bias(exp: int) -> str:
    return (
        f"the bias is not on the accumulator's grid 2^{exp} (s_x * s_w): an unquantized float bias "
        "(quantize it, e.g. bias_quant=Int32Bias, or drop it)"
    )


def _op(node: fx.Node) -> str:
    return str(node.target).removesuffix(".default")


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    name = list(stack.values())[-1][0] if stack else ""
    return name or "the model"


def _flat(v: Any) -> list[Any]:
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flat(item)]
    return [v]


def _concrete(args: Any) -> Any:
    """Layout arguments with symbolic sizes replaced by 1 (a constant has no batch)."""
    if isinstance(args, (list, tuple)):
        return type(args)(_concrete(a) for a in args)
    return 1 if isinstance(args, fx.Node) else args


def input_format(ep: torch.export.ExportedProgram) -> QFormat | None:
    """The format the model input is first quantized to, if a FakeQuant's steps come first.

    Reads the ``x / s -> round -> clamp(lo, hi)`` chain that a frozen quantizer
    exports to; None when the input meets something else first.
    """
    found = input_quantizer(ep)
    if found is None:
        return None
    scale, lo, hi = found
    signed = lo < 0
    return QFormat(max(hi, -lo - 1).bit_length() + signed, scale, signed)


def input_quantizer(ep: torch.export.ExportedProgram) -> tuple[float, int, int] | None:
    """``(s, lo, hi)`` of the model's first quantizer ``clamp(round(x / s), lo, hi)``
    (``round`` ties to even, as ``torch.round``), or None when the input meets
    something else first.  The integers ``lo .. hi`` are what the model computes on:
    a narrow-range quantizer's ``lo`` is above its format's."""
    user = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    node = user[0] if user else None
    steps: list[fx.Node] = []
    while node is not None and len(steps) < 3:
        consumers = [u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)]  # not sym_size
        node = consumers[0] if len(consumers) == 1 else None
        if node is not None and str(node.target) not in _LAYOUT:
            steps.append(node)
    if [str(n.target) for n in steps] != ["aten.div.Tensor", "aten.round.default", "aten.clamp.default"]:
        return None
    scale, (lo, hi) = steps[0].args[1], steps[2].args[1:3]
    if not isinstance(scale, float) or not all(isinstance(v, int) for v in (lo, hi)):
        return None
    return scale, lo, hi
