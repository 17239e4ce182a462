"""A QAT norm's per-step derivation as compiled loops (numba, where installed).

Every training step moves γ and β, so the layer derives its golden op again
(:meth:`~qnorm.ops._normcore.ChannelRule.op`).  The structure (the config's widths,
ε, the row analysis) is kept per rule and F_z; what is left per step is per channel:
γ's multipliers and their shared shift (``_quantize_gain``), β in accumulator units
clipped where the output saturates (``_output_bias``), the output window
(:func:`~qnorm.ops._normcore.output_window`) and stage 4's hulls
(:func:`~qnorm.ops._normcore.channel_hulls`).  In numpy that is ~60 calls on
N-element vectors: ~110 µs at N = 32 in a warm loop, several times that inside a
training step, whose forward and backward leave the caches cold.

* :func:`channel_ints` forms those integers in one loop over the channels (a
  :data:`~qnorm.ops._normcore.ChannelWriter`, handed to ``ChannelRule.op``); the op
  still runs its range checks on the window and hulls it is given.
* :class:`StepDeriver` goes further for a training layer: from γ itself it checks
  that the step keeps its structure (the same F_z) and forms the same integers, and
  its :class:`StepChain` runs the op's row loop on them without assembling a
  ``NormOp`` (the layer forms one when asked, from the same floats).

A second writing of the definition, so it declines — and the numpy part runs —
wherever that part takes another road: a non-finite value, a gain that does not fit
its multiplier, a β whose rounding is left to exact rationals (a near-tie against a
non-power-of-two output scale, or a value past 2^62), windows past 60 bits (the
numpy part's Python-int arrays), and for the deriver γ asking for another F_z or a
stage outside the lanes.  ``tests/test_nn_jitderive.py`` holds both to the numpy
part and to ``from_float`` on drawn γ, β, formats and training steps, ties, near-ties
and edges included.

The gain rule is the op's own, as data (``NormOp.gain_form``: one shared shift of
dyadic multipliers, or ShiftLayerNorm's signed powers of two); an op whose
``_quantize_gain`` is defined below the class that names its form is left to numpy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from qnorm.analysis import SAFE_INT64_BITS, Interval
from qnorm.fixedpoint import bits_for
from qnorm.nn.jitchain import RowKernel, _defined_in, _kernel, _numba, run_rows
from qnorm.nn.quantizer import NUMPY_FLOATS, exact_scaled
from qnorm.ops._normcore import (
    GUARD_BITS,
    STRUCTURE_CACHE_SIZE,
    ChannelInts,
    ChannelRule,
    ChannelStructure,
    NormOp,
    OutputWindow,
    StageHulls,
)
from qnorm.ops.shiftnorm import SQRT2

GAIN_FORMS = {"dyadic": 0, "pow2": 1}
FORMED = 0  # the kernel's first status slot where it formed the integers (else 1: it declined)
SCALED_GAINS = np.zeros(1)  # the kernel's gamma_rule for gains already scaled (channel_ints)


@functools.cache
def describes_its_gains(op_cls: type[NormOp]) -> bool:
    """Whether ``op_cls``'s ``gain_form`` comes from the class that defines its
    ``_quantize_gain`` (or a subclass of it): else the form may describe another rule."""
    return issubclass(_defined_in(op_cls, "gain_form"), _defined_in(op_cls, "_quantize_gain"))


@dataclass(frozen=True, eq=False)
class _StructureArgs:
    """The kernel's arguments that belong to a structure, packed (few arguments: each costs
    the call its own type check): the integer scalars, the float ones, z's bounds per
    channel (row 0 lo, row 1 hi)."""

    ints: np.ndarray  # gain form, mult_bits, max_shift, pow2 output scale, out lo, out hi, max |z|
    floats: np.ndarray  # the output scale, sqrt(2) (ShiftLayerNorm's rounding of log2)
    z: np.ndarray


# Bounded as the structures themselves are (a calibrating layer forms a new one each time
# its format moves): an unbounded cache would keep every one alive for the process.
@functools.lru_cache(maxsize=STRUCTURE_CACHE_SIZE)
def _structure_args(st: ChannelStructure) -> _StructureArgs | None:
    """:class:`_StructureArgs` of ``st`` (kept for recent structures), or None where this
    writing does not apply to it."""
    op_cls, cfg = st.op_cls, st.config
    form = GAIN_FORMS.get(op_cls.gain_form)
    if form is None or not describes_its_gains(op_cls) or not 2 <= st.mult_bits <= 32:
        return None
    z = np.empty((2, cfg.n), dtype=np.int64)
    for start, stop, iv in st.row.channel_z:
        if max(-iv.lo, iv.hi) >= 1 << 62:
            return None
        z[0, start:stop], z[1, start:stop] = iv.lo, iv.hi
    fmt = cfg.out_fmt
    pow2_scale = math.frexp(fmt.scale)[0] == 0.5
    ints = np.array([form, st.mult_bits, st.max_shift, pow2_scale, fmt.lo, fmt.hi, st.z_abs], dtype=np.int64)
    return _StructureArgs(ints, np.array([fmt.scale, SQRT2], dtype=np.float64), z)


@torch.compiler.disable
def channel_ints(st: ChannelStructure, scaled: np.ndarray, beta: np.ndarray) -> ChannelInts | None:
    """The per-channel integers, output window and hulls ``ChannelRule.op``'s numpy part
    forms for the scaled gains ``scaled`` (γ G / s_out 2^-F_z) and β, or None where this
    writing does not apply (numba missing, a gain form it does not know, or one of the
    roads left to the numpy part: module docstring)."""
    args = _structure_args(st) if _numba() is not None else None
    if args is None:
        return None
    out = np.empty((6, st.config.n), dtype=np.int64)  # gain, bias, the window's lo, hi, off, bias
    status = np.zeros(8, dtype=np.int64)
    _kernel(_channels)(
        np.ascontiguousarray(scaled, dtype=np.float64), np.ascontiguousarray(beta, dtype=np.float64), SCALED_GAINS,
        args.ints, args.floats, args.z, out, status,
    )  # fmt: skip
    if status[0] != FORMED:
        return None
    gain, bias, lo, hi, off, wbias = out
    shift, zc_lo, zc_hi, sc_lo, sc_hi, acc_lo, acc_hi = status[1:].tolist()
    return ChannelInts(
        gain=tuple(gain.tolist()),
        shift=shift,
        bias=tuple(bias.tolist()),
        window=OutputWindow(lo=lo, hi=hi, off=off, bias=wbias),
        hulls=StageHulls(Interval(zc_lo, zc_hi), Interval(sc_lo, sc_hi), Interval(acc_lo, acc_hi)),
    )


@dataclass(frozen=True, eq=False)
class StepChain:
    """One training step's integers without assembling its op: the compiled row loop with
    the per-channel integers :class:`StepDeriver` formed (the window, gains, and biases
    with the output rounding's half folded in, in the element chain's lanes) and the
    output shift."""

    kernel: RowKernel
    np_dtype: type
    lo: np.ndarray
    hi: np.ndarray
    off: np.ndarray
    gain: np.ndarray
    bias: np.ndarray
    shift: int

    def __call__(self, ints: torch.Tensor) -> torch.Tensor:
        """The op's integers for int64 CPU ``ints`` (rows on the last axis, inside its input
        format), in the chain's lanes: equal to ``ElementChain(op)(ints)``."""
        return torch.from_numpy(self._run(ints, self.np_dtype, None))

    def values(self, ints: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """``self(ints).to(dtype) * scale`` as torch forms it (:meth:`ElementChain.values`)."""
        if dtype in NUMPY_FLOATS:
            return torch.from_numpy(self._run(ints, NUMPY_FLOATS[dtype], scale))
        return exact_scaled(self(ints), dtype, scale)

    def _run(self, ints: torch.Tensor, dtype: type, scale: float | None) -> np.ndarray:
        x = ints.contiguous().numpy()
        out = np.empty(x.shape, dtype=dtype)
        n = self.lo.shape[0]
        rows = x.astype(np.int64, copy=False).reshape(-1, n)
        run_rows(self.kernel, rows, out.reshape(-1, n), self.lo, self.hi, self.off, self.gain, self.bias, self.shift,
                 scale)  # fmt: skip
        return out


class StepDeriver:
    """A training layer's derivation at one structure, compiled end to end.

    Built from an op its rule formed (:meth:`ChannelRule.op`) and that op's chain.  Each
    step, one compiled call scales γ as the rule does, checks that it asks for the same
    F_z (so the same structure), and forms the gains, shift, biases and output window
    (:func:`channel_ints`' loop); the result is a :class:`StepChain`, the op's integers
    without the op.  The op's own range checks are not run again: its row stages passed
    them at this structure when the first op was assembled, and of stage 4 the outputs
    y and out need no more bits than acc and the output format, so the op accepts
    exactly when zc, scaled and acc fit ``min(63, lanes − 1)`` bits — checked here, and
    where they do not (or the loop declines, or F_z moves) None sends the layer back to
    ``ChannelRule.op``, which refuses or forms what it always did."""

    def __init__(self, rule: ChannelRule, op: NormOp, kernel: RowKernel, np_dtype: type) -> None:
        st = op.structure
        cfg = st.config
        self.rule, self.structure = rule, st
        self._args = _structure_args(st)
        self._kernel = kernel
        self._np_dtype = np_dtype
        self._gamma_rule = np.array(
            [1.0, rule.gain_factor, rule.out_scale, rule.inv_frac_bits, GUARD_BITS, cfg.frac_bits], dtype=np.float64
        )
        self._limit = min(SAFE_INT64_BITS, cfg.lanes - 1)

    @classmethod
    def of(cls, rule: ChannelRule, op: NormOp, kernel: RowKernel | None, np_dtype: type) -> StepDeriver | None:
        """The deriver at ``op``'s structure, or None where it does not apply: an op formed
        elsewhere than by ``rule``, no compiled row loop (``kernel`` None), an explicit F_z,
        a structure the loop does not take."""
        st = op.structure
        if st is None or kernel is None or rule.frac_bits is not None or st.op_cls is not rule.op_cls:
            return None
        if _numba() is None or _structure_args(st) is None:
            return None
        return cls(rule, op, kernel, np_dtype)

    def __call__(self, gamma: np.ndarray, beta: np.ndarray) -> StepChain | None:
        """The step chain of float64 γ and β (N each), or None (class docstring)."""
        args = self._args
        out = np.empty((6, gamma.shape[0]), dtype=np.int64)  # gain, bias, the window's lo, hi, off, bias
        status = np.zeros(8, dtype=np.int64)
        _kernel(_channels)(gamma, beta, self._gamma_rule, args.ints, args.floats, args.z, out, status)
        if status[0] != FORMED:
            return None
        shift, zc_lo, zc_hi, sc_lo, sc_hi, acc_lo, acc_hi = status[1:].tolist()
        if max(bits_for(zc_lo, zc_hi), bits_for(sc_lo, sc_hi), bits_for(acc_lo, acc_hi)) > self._limit:
            return None
        out[5] += (1 << shift) >> 1
        lanes = out if self._np_dtype is np.int64 else out.astype(self._np_dtype)  # the element chain's lanes
        return StepChain(self._kernel, self._np_dtype, lanes[2], lanes[3], lanes[4], lanes[0], lanes[5], shift)


def _channels(values, beta, gamma_rule, ints, floats, zb, out, status):  # noqa: ANN001, C901
    """The loop :func:`channel_ints` and :class:`StepDeriver` compile; ``status[0]`` stays 1
    where it declines (the numpy part decides), γ asking for another F_z included.

    ``gamma_rule[0]`` 0: ``values`` are the scaled gains.  1: ``values`` are γ, scaled
    here as ``ChannelRule.op`` does (``real = γ · G / s_out``, F_z by
    ``default_frac_bits``, ``real · 2^-F_z``), with G, s_out, F_r, the guard bits and
    the structure's F_z in ``gamma_rule[1:]``."""
    form, mult_bits, max_shift, pow2_scale = ints[0], ints[1], ints[2], ints[3]
    out_lo, out_hi, z_abs = ints[4], ints[5], ints[6]
    scale, sqrt2 = floats[0], floats[1]
    z_lo, z_hi = zb[0], zb[1]
    gain, bias, lo, hi, off, wbias = out[0], out[1], out[2], out[3], out[4], out[5]
    # Every rounding is fixedpoint.round_float's half-up rule, written out: q = floor(t),
    # plus one where t − q >= 1/2 (exact below 2^52).
    n = values.shape[0]
    status[0] = 1
    for c in range(n):
        if not (np.isfinite(values[c]) and np.isfinite(beta[c])):
            return
    scaled = values
    if gamma_rule[0] == 1:
        real = np.empty(n, dtype=np.float64)
        big = 0.0
        for c in range(n):
            real[c] = values[c] * gamma_rule[1] / gamma_rule[2]
            big = max(big, abs(real[c]))
        if not np.isfinite(big):
            return
        want = gamma_rule[4]  # default_frac_bits: ceil_log2(max |real|) + guard bits, within [0, F_r]
        if big > 0:
            f, k = math.frexp(big)
            want += k - 1 if f == 0.5 else k
        if min(max(want, 0.0), gamma_rule[3]) != gamma_rule[5]:
            return
        for c in range(n):
            real[c] = math.ldexp(real[c], -np.int64(gamma_rule[5]))
        scaled = real
    # γ's multipliers and their shared shift s
    if form == 0:  # fixedpoint.dyadic_vector: s from the largest |g| (Dyadic.from_float), then round(g 2^s)
        big = 0.0
        for c in range(n):
            big = max(big, abs(scaled[c]))
        s = 0
        if big > 0:
            limit = 1 << (mult_bits - 1)
            q = np.floor(big)
            if abs(q + 1.0 if big - q >= 0.5 else q) >= limit:
                return
            s = min(max_shift, max(mult_bits - 1 - math.frexp(big)[1], 0))
            t = math.ldexp(big, s)
            q = np.floor(t)
            if abs(q + 1.0 if t - q >= 0.5 else q) >= limit:
                s -= 1
        for c in range(n):
            t = math.ldexp(scaled[c], s)
            q = np.floor(t)
            gain[c] = np.int64(q + 1.0 if t - q >= 0.5 else q)
    else:  # ShiftLayerNorm._quantize_gain: ±2^(round(log2 |g|) + s), flushed to 0 below the grid
        top = -(1 << 62)
        logs = np.zeros(n, dtype=np.int64)
        for c in range(n):
            if scaled[c] != 0:
                f, e = math.frexp(abs(scaled[c]))
                logs[c] = e - 1 + (1 if 2 * f >= sqrt2 else 0)
                top = max(top, logs[c])
        s = 0
        if top > -(1 << 62):
            s = min(max_shift, mult_bits - 2 - top)
            if s < 0:
                return
        for c in range(n):
            l2 = logs[c] + s
            if scaled[c] == 0 or l2 < 0:
                gain[c] = 0
            else:
                gain[c] = (np.int64(1) << l2) if scaled[c] > 0 else -(np.int64(1) << l2)
    m_abs = np.int64(0)
    for c in range(n):
        m_abs = max(m_abs, abs(gain[c]))
    # β in accumulator units, clipped where the output saturates (_output_bias; its exact roads declined)
    top_acc, bot_acc = np.int64(out_hi + 1) << s, np.int64(out_lo - 1) << s
    reach_limit = (np.int64(1) << 62) - max(top_acc, -bot_acc)
    if m_abs != 0 and z_abs > (reach_limit - 1) // m_abs:
        return
    for c in range(n):
        t = math.ldexp(beta[c], s) / scale
        size = abs(t)
        if pow2_scale:
            if not size < 2.0**62:
                return
        else:
            frac = t - np.floor(t)
            if not (size < 2.0**36 and abs(frac - 0.5) > math.ldexp(size + 1.0, -40)):
                return
        q = np.floor(t)
        reach = abs(gain[c]) * z_abs
        bias[c] = min(max(np.int64(q + 1.0 if t - q >= 0.5 else q), bot_acc - reach), top_acc + reach)
    # the output window (output_window), declined past 60 bits
    zw_abs = np.int64(0)
    b_abs = np.int64(0)
    for c in range(n):
        zw_abs = max(zw_abs, max(-z_lo[c], z_hi[c]))
        b_abs = max(b_abs, abs(bias[c]))
    wide_limit = (np.int64(1) << 60) - m_abs
    if max(top_acc, -bot_acc, b_abs, zw_abs) >= wide_limit or (m_abs != 0 and zw_abs > (wide_limit - 1) // m_abs):
        return
    for c in range(n):
        m, b0 = gain[c], bias[c]
        if m == 0:
            lo[c], hi[c], off[c], wbias[c] = 0, 0, 0, b0
            continue
        o = -(b0 // m)
        b = b0 + o * m
        if m > 0:
            wl, wh = (bot_acc - b) // m, -((b - top_acc) // m)
        else:
            wl, wh = (top_acc - b) // m, -((b - bot_acc) // m)
        fl, fh = z_lo[c] - o, z_hi[c] - o
        wlo, whi = max(wl, fl), min(wh, fh)
        if wlo > whi:  # a constant channel: the bias alone saturates
            lo[c], hi[c], off[c] = 0, 0, 0
            wbias[c] = top_acc if (m > 0) == (fl > wh) else bot_acc
        else:
            lo[c], hi[c], off[c], wbias[c] = wlo + o, whi + o, o, b
    # stage 4's hulls (channel_hulls)
    for c in range(n):
        wl, wh = lo[c] - off[c], hi[c] - off[c]
        p, q = wl * gain[c], wh * gain[c]
        s_lo, s_hi = min(p, q), max(p, q)
        if c == 0:
            status[2], status[3], status[4], status[5] = wl, wh, s_lo, s_hi
            status[6], status[7] = s_lo + wbias[c], s_hi + wbias[c]
        else:
            status[2], status[3] = min(status[2], wl), max(status[3], wh)
            status[4], status[5] = min(status[4], s_lo), max(status[5], s_hi)
            status[6], status[7] = min(status[6], s_lo + wbias[c]), max(status[7], s_hi + wbias[c])
    status[1] = s
    status[0] = FORMED
