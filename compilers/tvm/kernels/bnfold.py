"""Kernels for the BN-folding ops: MultiThreshold, BNQuant, and the MPBN LIF neurons.

All three families read per-channel integers that their golden ``_forward``
fetches with ``_xp.const_like`` as whole numpy arrays, so the element stages
are mirrored here with the same fixedpoint calls, reading one channel's value
from an argument buffer; the stages that take no per-channel constant (the
neuron's ``charge`` and hard ``reset``) are the op's own, called on TIR.
A kernel is refused for an op class whose mirrored method is overridden.

* **MultiThreshold** — ``count = Σ_j [x crosses t_j]`` as a TE reduction over
  the levels; :func:`~compilers.tvm.cpu.schedule_rowwise` runs it with the
  level loop outside and the channel loop vectorized (each lane counts its own
  channel).  Comparisons run in the narrowest type holding x and the
  thresholds (the folded thresholds are one bit wider than x: int16 for int8).
* **BNQuant** — ``clamp(div_round(P_c x + Q_c, Den_c))`` per element; the
  exact integer division has no SIMD instruction, so this kernel is scalar
  at heart (the folded MultiThreshold is the fast form of the same op).
* **Folded / unfolded LIF** — one kernel runs all T time steps: a loop over
  rows (the batch; the schedule's ``rows``: parallel on CPUs), time serial
  inside, the channels in the schedule's ``channels`` loops (vectorized on
  CPUs), the membrane of a row held in a row-local buffer.  Each step is three vector
  loops (integrate, spike, reset) through row buffers rather than one loop
  with local variables: TVM 0.27's vectorizer keeps a ``Let``-bound value
  inside a vectorized loop scalar (every lane gets lane 0's value), silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tvm import te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from compilers.tvm.kernels._base import (
    ChannelConst,
    Kernel,
    fmt_dtype,
    int_dtype,
    load64,
    wider,
)
from compilers.tvm.schedules import CPU, Schedule
from qnorm import fixedpoint as fp
from qnorm.analysis import Interval
from qnorm.ops.multithreshold import BNQuant, MultiThreshold
from qnorm.ops.spiking import FoldedLIFNeuron, MPBNNeuron, _LIFNeuron

SPIKE_DTYPE = "int8"  # the golden neuron returns int8 spikes


# --------------------------------------------------------------------------- BN + activation


def multithreshold_kernel(op: MultiThreshold, schedule: Schedule = CPU) -> Kernel:
    """``main(x, thresholds, negative, out)``: x (rows, C) → levels (rows, C)."""
    _require_forward(op, MultiThreshold)
    cfg, c_count = op.cfg, int(np.prod(op.bn.shape))
    levels = cfg.levels - 1
    # (L, C): one level's thresholds are contiguous across the vectorized channels
    thr = ChannelConst("thresholds", op.thresholds.reshape(c_count, levels).T)
    neg = ChannelConst("negative", op.negative.reshape(c_count).astype(np.int64))
    thr_t, neg_t = thr.placeholder(), neg.placeholder()
    in_dtype, out_dtype = fmt_dtype(cfg.in_fmt), fmt_dtype(cfg.out_fmt)
    count_iv = op.ranges()["count"]
    count_dtype = wider(int_dtype(count_iv), int_dtype(count_iv + cfg.out_fmt.lo))
    cmp_dtype = wider(in_dtype, thr.dtype)  # exact comparisons in the narrowest common type

    rows = te.var("rows", "int64")
    x = te.placeholder((rows, c_count), in_dtype, name="x")
    j = te.reduce_axis((0, levels), name="j")

    def crossed(r: Any, c: Any) -> Any:
        xv, t = x[r, c].astype(cmp_dtype), thr_t[j, c].astype(cmp_dtype)
        # constants typed like their operands: int32 ones would halve the vector lanes
        one, zero = tirx.const(1, count_dtype), tirx.const(0, count_dtype)
        negative = neg_t[c] == tirx.const(1, neg.dtype)
        return fp.select(fp.select(negative, xv <= t, xv >= t), one, zero)

    count = te.compute((rows, c_count), lambda r, c: te.sum(crossed(r, c), axis=j), name="count")
    out = te.compute(
        (rows, c_count), lambda r, c: (count[r, c] + cfg.out_fmt.lo).astype(out_dtype), name="out"
    )
    return Kernel.rowwise(op, schedule, x, [thr_t, neg_t], out, (thr, neg), in_dtype, out_dtype, op.bn.shape)


def bnquant_kernel(op: BNQuant, schedule: Schedule = CPU) -> Kernel:
    """``main(x, slope, offset, den, out)``: the exact rational BN + rounding + clamp."""
    _require_forward(op, BNQuant)
    cfg, c_count = op.cfg, int(np.prod(op.bn.shape))
    table = {"slope": op._slope, "offset": op._offset, "den": op._den}
    consts = [ChannelConst(k, v.reshape(c_count)) for k, v in table.items()]
    slope, offset, den = (c.placeholder() for c in consts)
    in_dtype, out_dtype = fmt_dtype(cfg.in_fmt), fmt_dtype(cfg.out_fmt)

    rows = te.var("rows", "int64")
    x = te.placeholder((rows, c_count), in_dtype, name="x")

    def element(r: Any, c: Any) -> Any:
        num = load64(x, r, c) * load64(slope, c) + load64(offset, c)
        level = fp.div_round(num, load64(den, c), cfg.mode)
        return fp.saturate(level, cfg.out_fmt.bits, cfg.out_fmt.signed).astype(out_dtype)

    out = te.compute((rows, c_count), element, name="out")
    return Kernel.rowwise(op, schedule, x, [slope, offset, den], out, consts, in_dtype, out_dtype, op.bn.shape)


# --------------------------------------------------------------------------- spiking neurons

Fires = Callable[[Any, Callable[[str], Any]], Any]


def _fires_folded(op: FoldedLIFNeuron) -> tuple[dict[str, np.ndarray], Fires]:
    """Mirror of ``FoldedLIFNeuron._fires``: ``u <= θ`` (γ < 0) or ``u >= θ``."""

    def fires(u: Any, ch: Callable[[str], Any]) -> Any:
        return fp.select(ch("negative") == 1, u <= ch("theta"), u >= ch("theta"))

    return {"theta": op.event.theta, "negative": op.event.negative.astype(np.int64)}, fires


def _fires_unfolded(op: MPBNNeuron) -> tuple[dict[str, np.ndarray], Fires]:
    """Mirror of ``MPBNNeuron._fires``: ``P u + Q >= V D 2^S`` (or ``>``)."""
    strict = op.cfg.comparator == ">"

    def fires(u: Any, ch: Callable[[str], Any]) -> Any:
        num = u * ch("slope") + ch("offset")
        return num > ch("bn_threshold") if strict else num >= ch("bn_threshold")

    return {"slope": op._slope, "offset": op._offset, "bn_threshold": op._bn_threshold}, fires


_FIRES: dict[Any, Callable[[Any], tuple[dict[str, np.ndarray], Fires]]] = {
    FoldedLIFNeuron._fires: _fires_folded,
    MPBNNeuron._fires: _fires_unfolded,
}


def lif_kernel(op: _LIFNeuron, schedule: Schedule = CPU) -> Kernel:
    """``main(x, *consts, spikes)``: currents (T, rows, C) → spikes (T, rows, C), T symbolic.

    Mirrors ``_LIFNeuron._forward``'s loop over T: the membrane starts at u_rest;
    per step ``pre = op.charge(state, I_t)`` (the op's own: clamp(leak + I)),
    fire (mirrored ``_fires``), spike, then ``op.reset`` (hard: the op's own; soft:
    mirrored, its R is per channel).
    """
    # MPBNNeuron._forward only adds a trace record to the shared dynamics
    cls = type(op)
    if (
        cls._forward not in (_LIFNeuron._forward, MPBNNeuron._forward)
        or cls.fires is not _LIFNeuron.fires
        or cls.reset is not _LIFNeuron.reset
        or cls._fires not in _FIRES
    ):
        raise NotImplementedError(
            f"{cls.__name__} overrides a neuron stage lif_kernel does not mirror"
        )
    cfg, c_count = op.cfg, int(np.prod(op.params.bn.shape))
    table, fires = _FIRES[cls._fires](op)
    consts = [ChannelConst(k, np.asarray(v).reshape(c_count)) for k, v in table.items()]
    if cfg.reset == "soft":
        consts.append(ChannelConst("reset_sub", op.params.reset_sub.reshape(c_count)))
    rep = op.ranges()
    state_dtype = int_dtype(rep["membrane_reset"].union(Interval.point(cfg.u_rest)))
    pre_dtype = int_dtype(rep["membrane"])
    in_dtype = fmt_dtype(cfg.in_fmt)

    with IRBuilder() as ib, T.prim_func():
        T.func_name("main")
        steps, rows = IRBuilder.name("steps", T.int64()), IRBuilder.name("rows", T.int64())
        handles = [T.arg(name, T.handle()) for name in ("x", *(c.name for c in consts), "spikes")]
        # Named buffers name main's parameters (TVM 0.27 leaves T.arg's names out):
        # GPU launch plans and the HLS top function refer to arguments by them.
        x = IRBuilder.name("x", T.match_buffer(handles[0], (steps, rows, c_count), in_dtype))
        bufs = {
            c.name: IRBuilder.name(c.name, T.match_buffer(h, (c_count,), c.dtype))
            for c, h in zip(consts, handles[1:-1], strict=True)
        }
        spikes = IRBuilder.name("spikes", T.match_buffer(handles[-1], (steps, rows, c_count), SPIKE_DTYPE))

        with schedule.rows(rows) as r:
            scope = schedule.scratch_scope
            state = IRBuilder.name("state", T.alloc_buffer((c_count,), state_dtype, scope=scope))
            pre = IRBuilder.name("pre", T.alloc_buffer((c_count,), pre_dtype, scope=scope))
            schedule.channels(
                c_count,
                lambda c: T.buffer_store(state, T.int64(cfg.u_rest).astype(state_dtype), [c]),
            )
            with T.serial(0, steps) as t:

                def integrate(c: Any) -> None:
                    u = op.charge(load64(state, c), load64(x, t, r, c))
                    T.buffer_store(pre, u.astype(pre_dtype), [c])

                def spike(c: Any) -> None:
                    fire = fires(load64(pre, c), _channel(bufs, c))
                    T.buffer_store(spikes, fp.select(fire, 1, 0).astype(SPIKE_DTYPE), [t, r, c])

                def reset(c: Any) -> None:
                    u, ch = load64(pre, c), _channel(bufs, c)
                    fire = fires(u, ch)
                    if cfg.reset == "hard":  # no per-channel constant: the op's own reset
                        nxt = op.reset(u, fire)
                    else:  # mirror of the soft branch of _LIFNeuron.reset (R per channel)
                        nxt = cfg.clamp(u - fp.select(fire, ch("reset_sub"), 0))
                    T.buffer_store(state, nxt.astype(state_dtype), [c])

                for body in (integrate, spike, reset):
                    schedule.channels(c_count, body)
    func = ib.get().with_attr("tirx.noalias", True)
    return Kernel(
        op,
        func,
        tuple(c.array() for c in consts),
        in_dtype,
        SPIKE_DTYPE,
        op.params.bn.shape,
        time_major=True,
        check_shape=op._check_input,
    )


def _channel(bufs: dict[str, Any], c: Any) -> Callable[[str], Any]:
    """A per-channel constant by name, as an int64 value of channel ``c``."""
    return lambda name: load64(bufs[name], c)


def _require_forward(op: Any, base: type) -> None:
    """Refuse an op class whose ``_forward`` (mirrored here) is not ``base``'s."""
    if type(op)._forward is not base._forward:
        raise NotImplementedError(
            f"{type(op).__name__}._forward overrides the {base.__name__} forward "
            "this kernel mirrors"
        )
