"""The QAT norms' per-row stage and element chain as one compiled loop (numba, where installed).

:class:`~qnorm.nn.elementchain.ElementChain` runs stages 1–3 with the golden op's own
numpy functions: ~50 calls on per-row vectors, each a few microseconds of dispatch,
so on a QAT batch (512 rows of 32) the calls, not the arithmetic, are the cost.  Here
the same integers come from one loop per row, compiled by numba: the statistic
(:class:`~qnorm.ops._normcore.RowStageForm`, the op's own description of its
``_statistic`` and ``_inverse``), ε and the exponent split
(:func:`~qnorm.ops._normcore.split_exponent`), the inverse, the row's multiplier and
offset (:func:`~qnorm.ops._normcore.row_affine_parts`) and the element chain of
:mod:`qnorm.nn.elementchain` with its folded rounding halves, all under the half-up
rule and in int64 (every value proven to fit by the op's range analysis; the chain's
int32 lanes hold the same values).  A second writing of the definition, so it is held
to the golden op's integers by ``tests/test_nn_norm_fastpath.py`` on rows at the
analysis' extremes for every op, lane width and format, and by property tests.

Only ops whose ``row_stage_form`` is defined where their ``_statistic`` and
``_inverse`` are (a subclass that overrides either without describing it falls back
to the numpy stages).  The loop is compiled once per process and argument types
(at the first call: the norm loop 1.05 s, the quantizer 0.17 s; numba's on-disk cache
is not used: it loads pickles).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qnorm.extras import missing
from qnorm.fixedpoint import Round
from qnorm.ops._normcore import NormOp, z_shift_base

STATISTICS = {"variance": 0, "centered_abs": 1, "prefix_squares": 2}
INVERSES = {"rsqrt": 0, "reciprocal": 1, "pow2_table": 2}

def available() -> bool:
    """Whether numba (the ``fast`` extra) is installed and imports: the loops run only then.

    Imported at the first call (a QAT layer's first forward), not with qnorm: it takes
    ~0.3 s.  A numba that is installed but does not import (say, built for another
    numpy) counts as missing."""
    return _numba() is not None


@functools.cache
def _numba() -> Any:
    if missing("numba") is not None:
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


def _defined_in(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in vars(k))


def describes_itself(op: NormOp) -> bool:
    """Whether ``op``'s row stage form comes from the class that defines its statistic and
    inverse (or a subclass of both): else the form may describe another definition."""
    return _describes_itself(type(op))


@functools.cache
def _describes_itself(cls: type) -> bool:
    form_cls = _defined_in(cls, "row_stage_form")
    return all(issubclass(form_cls, _defined_in(cls, name)) for name in ("_statistic", "_inverse", "row_inverse"))


@dataclass(frozen=True, eq=False)
class RowKernel:
    """What the compiled row loop takes from an op's structure (every op at one structure
    shares it; the per-channel window, gains, biases and the output shift are arguments
    of :func:`run_rows`): the Shift norm's table, the stage scalars, the output range."""

    thresholds: np.ndarray
    steps: np.ndarray
    scalars: tuple[int, ...]
    out_lo: int
    out_hi: int


# Host code that calls numba: under torch.compile each entry point that traced code reaches
# runs as an opaque call (Dynamo cannot trace a compiled loop, and would trace past its
# functools caches).  The norm layers reach these through one such call of their own.
@torch.compiler.disable
def row_kernel(op: NormOp) -> RowKernel | None:
    """The compiled loop's part of ``op``'s structure, or None where the loop does not
    apply: numba missing, no form, or another tie rule than half up (the caller runs the
    golden stages)."""
    cfg = op.config
    form = op.row_stage_form()
    if form is None or not available() or not describes_itself(op) or cfg.rounding is not Round.HALF_UP:
        return None
    scalars = (
        STATISTICS[form.statistic], INVERSES[form.inverse], form.prefix, cfg.p, cfg.p * cfg.eps_shift, cfg.eps,
        cfg.mant_bits, form.frac_bits, form.base, z_shift_base(cfg), op._mult_shift, cfg.centered,
    )  # fmt: skip
    thresholds = np.asarray(form.thresholds, dtype=np.int64)
    return RowKernel(thresholds, np.asarray(form.steps, dtype=np.int64), scalars, cfg.out_fmt.lo, cfg.out_fmt.hi)


def run_rows(kernel: RowKernel, x: np.ndarray, out: np.ndarray, lo: np.ndarray, hi: np.ndarray, off: np.ndarray,
             gain: np.ndarray, bias: np.ndarray, shift: int, scale: float | None = None) -> None:  # fmt: skip
    """The op's output integers of the int64 rows ``x`` (2-D, N columns) written into
    ``out`` (its shape), with the element chain's per-channel window ``lo``, ``hi``,
    ``off``, gain and bias (the output rounding's half folded in) and the output shift.
    ``out`` holds the integers (an integer array, ``scale`` None) or, a float32/float64
    array, each integer times ``scale`` as torch forms it (the scale in that dtype, one
    IEEE multiply: an integer below 2^24 times a float32 is exact in float64, so
    rounding that product once to float32 is the float32 product)."""
    factor = np.ones(1, dtype=out.dtype) if scale is None else np.full(1, scale, dtype=out.dtype)
    _kernel(_rows)(
        x, out, kernel.thresholds, kernel.steps, lo, hi, off, gain, bias, *kernel.scalars, shift, kernel.out_lo,
        kernel.out_hi, factor,
    )  # fmt: skip


@torch.compiler.disable
def quantize(x: np.ndarray, scale: float, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The QAT input quantizer's three results for finite float32/float64 ``x`` in one
    compiled pass: the integers of :meth:`QFormat.quantize_with_mask` (``x / scale`` in
    float64, rounded half up, saturated) as int64, ``ints · scale`` in ``x``'s dtype (the
    product torch forms: both factors in that dtype, one IEEE multiply) and the
    straight-through mask (1 where ``x / scale`` lies in [lo, hi], else 0) in that dtype.
    None without numba."""
    if not available():
        return None
    flat = np.ascontiguousarray(x).reshape(-1)
    ints = np.empty(flat.shape, dtype=np.int64)
    dequant, mask = np.empty_like(flat), np.empty_like(flat)
    _kernel(_quantize)(flat, float(scale), float(lo), float(hi), np.full(1, scale, dtype=flat.dtype), ints, dequant, mask)
    return ints.reshape(x.shape), dequant.reshape(x.shape), mask.reshape(x.shape)


def _quantize(x, scale, lo, hi, scale_as_x, ints, dequant, mask):  # noqa: ANN001
    """The loop :func:`quantize` compiles (``QFormat._round_scaled``'s steps, per element)."""
    s = scale_as_x[0]
    for i in range(x.shape[0]):
        t = np.float64(x[i]) / scale
        mask[i] = 1.0 if (t >= lo and t <= hi) else 0.0
        t = min(max(t, lo - 1.0), hi + 1.0)
        q = np.floor(t)
        if t - q >= 0.5:  # exact: |t| < 2^52
            q += 1.0
        k = np.int64(min(max(q, lo), hi))
        ints[i] = k
        # from the integer, as torch converts it (so -0.0 becomes 0; exact below 2^24)
        dequant[i] = k
        dequant[i] = dequant[i] * s


@functools.cache
def _kernel(loop: Callable[..., None]) -> Any:
    """``loop`` compiled, at its first use (once per argument types)."""
    return _numba().njit(cache=False, nogil=True)(loop)


@functools.cache
def _reassociating_kernel(loop: Callable[..., None]) -> Any:
    """``loop`` compiled with its float additions and multiplications free to reassociate,
    so that LLVM vectorizes its float64 sums (a sum in one register is bound by the
    adder's latency): for float loops whose results are held to a tolerance, never for
    the exact integer ones.  No other fast-math freedom: NaN, infinities and signed
    zeros keep their meaning, and nothing is contracted into a fused multiply-add."""
    return _numba().njit(cache=False, nogil=True, fastmath={"reassoc"})(loop)


def _rows(x, out, thresholds, steps, lo, hi, off, gain, bias, statistic, inverse, prefix, p, pg, eps,  # noqa: ANN001
          mant_bits, frac_bits, base, zbase, mult_shift, centered, shift, out_lo, out_hi, factor):  # fmt: skip
    """The loop :func:`run_rows` runs: every row's stages 1–3, then its elements."""
    rows, n = x.shape
    for i in range(rows):
        # stage 1: the statistic, then W = S·2^(p g) + ε_int (W = 0 counts as 1)
        s1 = np.int64(0)
        acc = np.int64(0)
        for j in range(n):
            v = x[i, j]
            s1 += v
            if j < prefix:
                acc += v * v
        if statistic == 1:
            acc = np.int64(0)
            for j in range(n):
                d = n * x[i, j] - s1
                acc += d if d >= 0 else -d
        elif statistic == 0:
            acc = n * acc - s1 * s1
        w = (acc << pg) + eps
        if w <= 0:
            w = np.int64(1)
        # stage 2: W = M·2^(p e) (W's bit length: one step per bit, at most 62), then M's inverse r
        bits = 0
        rest = w
        while rest > 0:
            rest >>= 1
            bits += 1
        e = (bits - mant_bits) >> (p - 1)
        up = e if e > 0 else 0
        m = (w >> (up << (p - 1))) << ((up - e) << (p - 1))
        if inverse == 0:  # 2^F / sqrt(M), half up: one division and one isqrt
            num = np.int64(1) << (2 * frac_bits)
            q = num // m
            rem = num - q * m
            r = np.int64(np.sqrt(np.float64(q)))  # q < 2^61: a float estimate, made exact
            while r * r > q:
                r -= 1
            while (r + 1) * (r + 1) <= q:
                r += 1
            k = q - r * r - r
            if k > 0 or (k == 0 and rem >= ((m + 3) >> 2)):
                r += 1
        elif inverse == 1:  # 2^F / (2M + 1), half up
            d = m + m + 1
            num = np.int64(1) << frac_bits
            r = num // d
            if 2 * (num - r * d) >= d:
                r += 1
        else:
            r = np.int64(base)
            for t in range(thresholds.shape[0]):
                if m >= thresholds[t]:
                    r += steps[t]
        # stage 3: a = a0·2^up, c = c0·2^up, z's shift K (row_affine_parts, half up)
        k0 = e + zbase
        jr = min(max(k0, 0), mult_shift)
        up = min(max(jr - k0, 0), 62)
        a0 = ((r * n if centered else r) + ((np.int64(1) << jr) >> 1)) >> jr
        c0 = np.int64(0)
        if centered:
            mean = s1 // n
            dev = (s1 - mean * n) * a0
            c0 = dev // n
            if 2 * (dev - c0 * n) >= n:
                c0 += 1
            c0 += a0 * mean
        k = k0 - jr + up
        offset = c0 - ((np.int64(1) << k) >> 1)
        # stage 4 per element: the element chain, its rounding halves folded in
        for j in range(n):
            z = ((x[i, j] * a0 - offset) >> k) << up
            z = min(max(z, lo[j]), hi[j])
            y = ((z - off[j]) * gain[j] + bias[j]) >> shift
            out[i, j] = min(max(y, out_lo), out_hi) * factor[0]
