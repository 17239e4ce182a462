"""Kernels for the row normalizations (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm).

How :meth:`NormOp._forward`'s stages map to TIR (``rows`` symbolic, N static):

1. **Statistic** — the op's own ``_statistic`` runs on :class:`~._rows.Rows`:
   its ``row_sum`` calls become TE reductions (``row_sum*`` stages, one value
   per row, narrow accumulators), the numerator stays an inline per-element
   expression; then ``_normcore.add_eps`` (ε with its guard bits) as is.
2. **Split and inverse** (per row) — the op's ``split_exponent`` and
   ``_inverse`` called on TIR loads, cut into per-row stages by
   :func:`~compilers.tvm.primitives.staged_compute` (bit_length and rsqrt are
   DAGs that would otherwise explode).  A tuple inverse (ShiftLayerNorm's
   value, hi, lo, sign) becomes one stage per component.
3. **Normalize** (per element) — the op's ``shift_numerator`` and ``_product``,
   then ``z = rshift_round(prod, F_r − F_z)``: that line is ``_forward``'s own
   glue, restated with the same fixedpoint call.  Shift amounts derived from
   the row's exponent are staged once per row (:func:`~._stage.row_staged_compute`).
4. **Affine output** (per element) — mirrors ``NormOp._output`` and the op's
   ``_scale`` with the fixedpoint calls they make; mirrored, not called, because
   they read the per-channel constants through ``_xp.const_like`` as whole numpy
   vectors, and here a channel's constant is one load from an argument buffer.

Mirrored stages are guarded twice: a kernel is refused for an op class that
overrides ``_forward``, ``_output`` or ``_scale`` with code this module has not
mirrored, and the names the stage functions record while the kernel is built
must be exactly the op's range-report names, in order — a stage added to
``NormOp._forward`` (as ``add_eps`` was) fails loudly instead of going missing.

Where a multiply follows, its operands (num_scaled and the inverse before
``_product``, z before ``_scale``) pass through :func:`~._base.fit` with the
op's own proven ranges (``op.ranges()``): 32×32→64-bit products.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tvm import te

from compilers.tvm.kernels._base import ChannelConst, Kernel, fit, fmt_dtype, load64
from compilers.tvm.kernels._rows import ProvenTrace, Rows
from compilers.tvm.kernels._stage import row_staged_compute
from compilers.tvm.primitives import staged_compute
from compilers.tvm.schedules import CPU, Schedule
from qnorm.analysis import Interval
from qnorm.fixedpoint import rshift_round, saturate
from qnorm.ops._normcore import NormOp, add_eps, shift_numerator, split_exponent
from qnorm.ops.base import record
from qnorm.ops.shiftnorm import ShiftLayerNorm, signed_term


def _scale_multiply(z: Any, c: Any, consts: dict[str, te.Tensor]) -> Any:
    """Mirror of ``NormOp._scale``: ``z * m_c``."""
    return z * load64(consts["gain"], c)


def _scale_shift(z: Any, c: Any, consts: dict[str, te.Tensor]) -> Any:
    """Mirror of ``ShiftLayerNorm._scale``: ``z << l_c``, then the op's own
    ``signed_term`` with the channel's negate and keep masks."""
    mag = z << load64(consts["log2"], c)
    return signed_term(mag, load64(consts["neg"], c), load64(consts["keep"], c))


# Each mirrored ``_scale``: the function, the per-channel constants it reads, and
# whether it multiplies (a multiplier's operands are worth narrowing, a shift's not).
_SCALES: dict[Any, tuple[Callable[..., Any], Callable[[NormOp], dict[str, Any]], bool]] = {
    NormOp._scale: (_scale_multiply, lambda op: {"gain": op.config.gain}, True),
    ShiftLayerNorm._scale: (
        _scale_shift,
        lambda op: {"log2": op._log2, "neg": op._neg, "keep": op._keep},
        False,
    ),
}


def _keep(v: Any, iv: Interval) -> Any:
    return v


def norm_kernel(op: NormOp, schedule: Schedule = CPU) -> Kernel:
    """``main(x, *consts, out)`` for one norm instance: x (rows, N) → out (rows, N)."""
    cls = type(op)
    if (
        cls._forward is not NormOp._forward
        or cls._output is not NormOp._output
        or cls._scale not in _SCALES
    ):
        raise NotImplementedError(
            f"{cls.__name__} overrides a NormOp stage that norm_kernel does not mirror"
        )
    scale, scale_consts, scale_multiplies = _SCALES[cls._scale]
    # fit() only where a multiply follows: around a shift its casts are pure cost
    # (ShiftLayerNorm measured about 10 % slower with them)
    product_operand = fit if cls._product is NormOp._product else _keep
    scale_operand = fit if scale_multiplies else _keep
    cfg, rep = op.config, op.ranges()
    n = cfg.n
    consts = [ChannelConst(k, v) for k, v in {**scale_consts(op), "bias": cfg.bias}.items()]
    bufs = {c.name: c.placeholder() for c in consts}
    # What the op's stage functions record, in order: checked against op.ranges() below.
    # Recorded rows take the op's proven bounds (L1's Σ|N·x − S| then sums in int32).
    trace = ProvenTrace(rep.items)

    rows = te.var("rows", "int64")
    x = te.placeholder((rows, n), fmt_dtype(cfg.in_fmt), name="x")

    # 1. statistic: the op's own code on symbolic rows, then ε
    s, num = op._statistic(Rows.of_tensor(x, Interval(cfg.in_fmt.lo, cfg.in_fmt.hi)), trace)
    w = add_eps(s, cfg, trace)
    stat = te.compute((rows,), lambda r: w.at(r, 0), name="stat")

    # 2. per row: W = M 2^(p e), then the inverse of M
    def split(r: Any) -> tuple[Any, Any]:
        return split_exponent(load64(stat, r), cfg, op._stat_bits, trace)

    exp = staged_compute((rows,), lambda r: split(r)[0], "exp")
    mant = staged_compute((rows,), lambda r: split(r)[1], "mant")
    parts = op._inverse(load64(mant, 0), trace)  # its arity (and its trace name, in order)
    if isinstance(parts, tuple):  # one stage per component (ShiftLayerNorm: value, hi, lo, sign)
        stages = [
            staged_compute(
                (rows,), _component(lambda r: op._inverse(load64(mant, r), None), i), f"inv{i}"
            )
            for i in range(len(parts))
        ]

        def inv_of(r: Any) -> Any:
            return tuple(load64(t, r) for t in stages)

    else:
        inv = staged_compute((rows,), lambda r: op._inverse(load64(mant, r), None), "inv")

        def inv_of(r: Any) -> Any:
            return product_operand(load64(inv, r), rep[op.inverse_name])

    # 3. + 4. per element: NormOp._forward from the numerator on, then _output
    def element(r: Any, c: Any) -> Any:
        u = shift_numerator(num.at(r, c).astype("int64"), load64(exp, r), cfg, trace)
        u = product_operand(u, rep["num_scaled"])
        prod = record(trace, "prod", op._product(u, inv_of(r), trace))
        z = record(trace, "z", rshift_round(prod, cfg.inv_frac_bits - cfg.frac_bits, cfg.rounding))
        scaled = record(trace, "scaled", scale(scale_operand(z, rep["z"]), c, bufs))
        acc = record(trace, "acc", scaled + load64(bufs["bias"], c))
        y = record(trace, "y", rshift_round(acc, cfg.shift, cfg.rounding))
        out = record(trace, "out", saturate(y, cfg.out_fmt.bits, cfg.out_fmt.signed))
        return out.astype(fmt_dtype(cfg.out_fmt))

    out = row_staged_compute(rows, n, element, "out")
    if list(trace) != list(rep.items):
        raise NotImplementedError(
            f"{cls.__name__}'s stages {list(rep.items)} differ from the kernel's {list(trace)}: "
            "the op's forward changed; update norm_kernel"
        )
    func = te.create_prim_func([x, *bufs.values(), out])
    return Kernel(
        op=op,
        mod=schedule.rowwise(func, "out"),
        consts=tuple(c.array() for c in consts),
        in_dtype=fmt_dtype(cfg.in_fmt),
        out_dtype=fmt_dtype(cfg.out_fmt),
        row_shape=(n,),
    )


def _component(f: Callable[[Any], tuple[Any, ...]], i: int) -> Callable[[Any], Any]:
    """Component ``i`` of a per-row stage function returning a tuple."""
    return lambda r: f(r)[i]
