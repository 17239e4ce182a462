"""The IntSoftmax kernel: row max, table exponentials, row sum, one reciprocal, per-element product.

How :meth:`IntSoftmax._forward` maps to TIR (``rows`` symbolic, N static):

1. **Row max** over the kept columns: a TE max reduction (``row_max``).
2. **Exponentials** ``t = T_sum[m − x]`` (the sum's terms, F + G bits) and
   ``e = T[m − x]`` (the output's, F bits): loads from the op's own tables, passed
   as kernel arguments (``term_table`` and ``exp_table``, or ``exp_lo`` /
   ``exp_hi`` for two digits, whose product is shifted twice with the same
   :func:`~qnorm.fixedpoint.rshift_round`); masked columns give 0.
   Mirrored from :meth:`IntSoftmax.exp` (the op reads its tables as whole numpy
   vectors, here an entry is one load), and computed in each pass — t for the
   row sum, e for the output — instead of stored: a subtraction and a load cost
   less than a row of scratch.
3. **Row sum** (``row_sum``) in the narrowest exact accumulator, then the op's own
   per-row code on TIR, cut into per-row stages: the leading-one position of
   :meth:`IntSoftmax.divisor` once (``sum_bits``), then
   :meth:`IntSoftmax.reciprocal_of` (S's mantissa, one division) and the output
   shift.
4. **Per element**, in the datapath's lanes (``cfg.lanes``: int32 for int8 in and
   out): ``e · r``, the rounding shift, saturation — the fixedpoint calls of
   ``_forward``.

The names the stages record while the kernel is built must be the op's
range-report names, in order: a stage added to the op fails loudly here.
"""

from __future__ import annotations

from typing import Any

from tvm import te, tirx

from compilers.tvm.kernels._base import (
    ChannelConst,
    Kernel,
    check_mirrored_stages,
    fmt_dtype,
    int_dtype,
    load64,
    load_as,
)
from compilers.tvm.kernels._stage import row_staged_compute
from compilers.tvm.primitives import staged_compute
from compilers.tvm.schedules import CPU, Schedule
from qnorm.fixedpoint import bit_length, land, rshift_round, saturate, select
from qnorm.ops.base import record
from qnorm.ops.softmax import DIGIT_BITS, IntSoftmax


def softmax_kernel(op: IntSoftmax, schedule: Schedule = CPU) -> Kernel:
    """``main(x, *tables, out)`` for one softmax instance: x (rows, N) → out (rows, N)."""
    mirrored = ("_forward", "exp", "reciprocal")  # what the stages below mirror or split
    if any(getattr(type(op), name) is not getattr(IntSoftmax, name) for name in mirrored):
        raise NotImplementedError(f"{type(op).__name__} overrides a stage that softmax_kernel does not mirror")
    cfg, rep = op.config, op.ranges()
    n, dt = cfg.n, f"int{cfg.lanes}"
    names = ("term_table", "exp_table") if cfg.digits == 1 else ("exp_lo", "exp_hi")
    consts = [ChannelConst(name, t) for name, t in zip(names, op.tables, strict=True)]
    tables = [c.placeholder() for c in consts]
    trace: dict[str, Any] = {}

    rows = te.var("rows", "int64")
    x = te.placeholder((rows, n), fmt_dtype(cfg.in_fmt), name="x")
    lo = cfg.in_fmt.lo

    def keep(r: Any, c: Any) -> Any:
        """The op's :meth:`IntSoftmax.keep` for one element (None: no mask)."""
        cond = None
        if cfg.padding:
            cond = load_as(x, dt, r, c) > lo
        if cfg.causal:
            # reduction axes are int32, row and column axes int64: compare in int64
            r64, c64 = tirx.Cast("int64", r), tirx.Cast("int64", c)
            causal = c64 <= tirx.floormod(r64, cfg.query_len) + cfg.causal_offset
            cond = causal if cond is None else land(cond, causal)
        return cond

    def masked(cond: Any, value: Any, other: int) -> Any:
        return value if cond is None else select(cond, value, tirx.const(other, str(value.ty)))

    k = te.reduce_axis((0, n), name="k")
    top = te.compute((rows,), lambda r: te.max(masked(keep(r, k), load_as(x, dt, r, k), lo), axis=k), name="row_max")
    trace["max"] = top

    def exp(r: Any, c: Any, tr: Any = None) -> tuple[Any, Any]:
        """Mirror of ``_forward``'s d and :meth:`IntSoftmax.exp`: (the sum's term, e),
        masked columns 0.  Each pass uses one of them, so a pass loads one table."""
        cond = keep(r, c)
        d = record(tr, "diff", masked(cond, load_as(top, dt, r) - load_as(x, dt, r, c), 0))
        if cfg.digits == 1:
            term = record(tr, "sum_term", load_as(tables[0], dt, d))
            e = record(tr, "exp", load_as(tables[1], dt, d))
        else:
            low = load_as(tables[0], dt, d & ((1 << DIGIT_BITS) - 1))
            both = record(tr, "exp_product", low * load_as(tables[1], dt, d >> DIGIT_BITS))
            term = record(tr, "sum_term", rshift_round(both, cfg.sum_frac_bits))
            e = record(tr, "exp", rshift_round(both, cfg.sum_frac_bits + cfg.sum_guard))
        return masked(cond, term, 0), masked(cond, e, 0)

    row, col = tirx.Var("r", "int64"), tirx.Var("c", "int64")
    exp(row, col, trace)  # the trace names, in order
    acc = int_dtype(rep["exp_sum"])
    j = te.reduce_axis((0, n), name="j")
    total = te.compute((rows,), lambda r: te.sum(exp(r, j)[0].astype(acc), axis=j), name="row_sum")
    trace["exp_sum"] = total

    op.reciprocal(load64(total, row), trace)  # the trace names, in order
    # the leading-one search once per row, shared by r and the shift
    lead = staged_compute((rows,), lambda r: bit_length(op.divisor(load64(total, r)), op._sum_bits), "sum_bits")

    def reciprocal(r: Any) -> tuple[Any, Any]:
        return op.reciprocal_of(op.divisor(load64(total, r)), load64(lead, r), None)

    recip = staged_compute((rows,), lambda r: reciprocal(r)[0], "recip")
    shift = staged_compute((rows,), lambda r: reciprocal(r)[1], "out_shift")

    def element(r: Any, c: Any) -> Any:
        prod = record(trace, "prob_product", exp(r, c)[1] * recip[r].astype(dt))
        y = record(trace, "y", rshift_round(prod, shift[r].astype(dt), cfg.rounding))
        out = record(trace, "out", saturate(y, cfg.out_fmt.bits, cfg.out_fmt.signed))
        return out.astype(fmt_dtype(cfg.out_fmt))

    out = row_staged_compute(rows, n, element, "out")
    check_mirrored_stages("IntSoftmax", list(rep.items), list(trace), "softmax_kernel")
    return Kernel.rowwise(op, schedule, x, tables, out, consts, fmt_dtype(cfg.in_fmt), fmt_dtype(cfg.out_fmt), (n,))
