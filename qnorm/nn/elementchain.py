"""The QAT norm layers' fast exact forward on the CPU: the golden op's integers in fewer steps.

A norm's integer body (:meth:`qnorm.ops._normcore.NormOp._forward`) on torch int64
tensors costs ~60 eager operations, most of them on per-row vectors of a few hundred
values, where each torch call's fixed cost dominates.  :class:`ElementChain` splits
the same computation where the cost lies:

* **Per row, on numpy**: the golden op's own stages 1–3 (:meth:`NormOp.row_inverse`
  and :func:`row_affine_parts`) on the input's int64 array — a CPU tensor and its
  numpy view share memory, and a numpy call on a few hundred values costs a
  microsecond where a torch call costs several.  These are the definition's own
  functions, so the per-row constants are the golden op's by construction.
* **Per element, on numpy too, fused under the default rounding (half up)**: the
  rounding half of ``z = round((x·a − c) / 2^K)`` and of ``y = round(acc / 2^s)``
  is folded into the row offset and the channel bias (``(v + 2^(K−1)) >> K`` is
  half up, exactly), so the chain is

      z = ((x·a0 − (c0 − h_K)) >> K) << up,   zc = clamp(z, lo_c, hi_c) − off_c,
      y = sat((zc·m_c + (b_c + h_s)) >> s)

  with ``a = a0·2^up``, ``c = c0·2^up`` (:func:`row_affine_parts`: K = 0 wherever
  up > 0, so this is ``rshift_round(x·a − c, K)``) and the output window of the
  op (:class:`~qnorm.ops._normcore.OutputWindow`).  ShiftLayerNorm's ``·m_c`` is its
  shift-and-negate by ±2^l, the same integer.
* **Lanes**: int32 where every operand and result is proven below 2^31 — the
  window stages by the op's own lane check (``lanes = 32``: each fits 31 bits), the
  row stage by the bound :func:`_row_stage_bound` proves from the op's range report
  — else int64.  int32 halves the memory each step touches.  The result is handed
  back as a torch tensor sharing the array's memory.

* **Compiled, where the ``fast`` extra is installed**: stages 1–3 and this chain as
  one loop per row (:mod:`qnorm.nn.jitchain`, numba): the same integers without the
  ~50 numpy calls per batch (262 → 38 µs on 512 rows of 32, IntLayerNorm).  That loop
  is a second writing of stages 1–3, held to the golden op by the tests below.

Other tie rules, and devices other than the CPU, run the golden body itself (numpy
on the CPU, torch elsewhere).  ``tests/test_nn_norm_fastpath.py`` checks both paths
against the golden op on rows reaching the analysis' extremes and on drawn configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qnorm import fixedpoint as fp
from qnorm.fixedpoint import Round
from qnorm.nn.jitchain import RowKernel, row_kernel, run_rows
from qnorm.nn.quantizer import NUMPY_FLOATS, exact_scaled
from qnorm.ops._normcore import NormOp, row_affine_parts

INT32_LIMIT = 1 << 31


def _row_stage_bound(op: NormOp) -> int:
    """A bound on every value of the row stage ``x·a0``, ``c0 − h_K`` and their
    difference, from the op's range report.

    ``a0 = round(N_c · r / 2^j_r) <= N_c · r_max`` (N_c = N for a centered numerator,
    else 1; exact at j_r = 0, at most N_c r / 2 + 1 <= N_c r for j_r >= 1, r > 1);
    ``c0 = a0·m + round(D·a0/N)`` with ``m = floor(Σx / N)`` in the input's range and
    ``0 <= D < N``, so ``|c0| <= a0 (X + 1)`` with X = max |x|; the half
    ``h_K < 2^K_max``.  A row shift of 31 or more counts as too wide for int32 (a
    shift by the lane width or more is not a plain arithmetic shift everywhere).
    """
    cfg = op.config
    rep = dict(type(op).row_analysis(cfg).items)  # cached per row key: no analysis runs here
    a0 = rep[op.inverse_name].hi * cfg.num_mult
    x = max(-cfg.in_fmt.lo, cfg.in_fmt.hi)
    k_max = rep["z_shift"].hi
    if k_max >= 31:
        return INT32_LIMIT
    c0 = a0 * (x + 1) + (1 << k_max) if cfg.centered else 1 << k_max
    return x * a0 + c0


@dataclass(frozen=True, eq=False)
class _RowPlan:
    """What a chain takes from its op's structure, the same for every op at one
    (:attr:`~qnorm.ops._normcore.NormOp.structure`): the lanes, the tie rule's fusion,
    the output range and the compiled loop's part (None: the numpy stages)."""

    dtype: torch.dtype
    np_dtype: type
    fused_rounding: bool
    out: tuple[Any, Any]
    kernel: RowKernel | None


def _row_plan(op: NormOp) -> _RowPlan:
    cfg = op.config
    narrow = cfg.lanes == 32 and _row_stage_bound(op) < INT32_LIMIT
    dtype, np_dtype = (torch.int32, np.int32) if narrow else (torch.int64, np.int64)
    fused = cfg.rounding is Round.HALF_UP
    kernel = row_kernel(op) if fused else None
    return _RowPlan(dtype, np_dtype, fused, (np_dtype(cfg.out_fmt.lo), np_dtype(cfg.out_fmt.hi)), kernel)


class ElementChain:
    """The exact integer forward of one golden norm op, fused where it is proven equal.

    ``like``: the chain of an earlier op; where both ops share a structure (they differ
    only in their per-channel integers, as a training layer's ops of successive steps
    do) its structural part is reused, not formed again."""

    def __init__(self, op: NormOp, like: ElementChain | None = None) -> None:
        cfg = op.config
        self.op = op
        shared = like is not None and op.structure is not None and op.structure is like.op.structure
        plan = self._plan = like._plan if shared else _row_plan(op)
        self.dtype, self.np_dtype = plan.dtype, plan.np_dtype
        self._compiled: RowKernel | None = None  # the compiled loop (qnorm.nn.jitchain), where it applies
        win = op._window
        wide_window = any(v.dtype == object for v in (win.lo, win.hi, win.off, win.bias))
        self.fused = plan.fused_rounding and not wide_window
        if not self.fused:
            return
        half_s = (1 << cfg.shift) >> 1
        np_dtype = plan.np_dtype

        def channel(values: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(values, dtype=np.int64).astype(np_dtype, copy=False)

        self._lo, self._hi, self._off = channel(win.lo), channel(win.hi), channel(win.off)
        self._gain, self._bias = channel(op._gain), channel(win.bias + half_s)
        self._shift = np_dtype(cfg.shift)
        self._out = plan.out
        self._compiled = plan.kernel

    def values(self, ints: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """``self(ints).to(dtype) * scale`` as torch forms it; the compiled loop writes these
        floats itself (float32/float64), without the integers in between."""
        if self._compiled is not None and ints.device.type == "cpu" and dtype in NUMPY_FLOATS:
            return torch.from_numpy(self._run(ints, NUMPY_FLOATS[dtype], scale))
        return exact_scaled(self(ints), dtype, scale)

    def __call__(self, ints: torch.Tensor) -> torch.Tensor:
        """The op's integers for int64 ``ints`` (rows on the last axis, inside its
        input format): int32 or int64, equal to ``op._forward(ints)``."""
        if ints.device.type != "cpu":
            with fp.proven_ranges():
                return self.op._forward(ints, None)
        if self._compiled is not None:
            return torch.from_numpy(self._run(ints, self.np_dtype, None))
        x = ints.contiguous().numpy()
        with fp.proven_ranges():
            if not self.fused:
                return torch.from_numpy(self.op._forward(x, None))
            s1, r, e = self.op.row_inverse(x)
            a0, c0, up, k = row_affine_parts(s1, r, e, self.op.config, self.op._mult_shift, self.op._offset_split)
        return torch.from_numpy(self._elements(x, a0, c0, up, k))

    def _run(self, ints: torch.Tensor, dtype: type, scale: float | None) -> np.ndarray:
        """The compiled loop on CPU ``ints``: the integers in ``dtype`` (``scale`` None) or
        the integers times ``scale`` (a float dtype)."""
        x = ints.contiguous().numpy()
        out = np.empty(x.shape, dtype=dtype)
        n = self.op.config.n
        rows = x.astype(np.int64, copy=False).reshape(-1, n)
        run_rows(self._compiled, rows, out.reshape(-1, n), self._lo, self._hi, self._off, self._gain, self._bias,
                 self.op.config.shift, scale)  # fmt: skip
        return out

    def _elements(self, x: np.ndarray, a0: np.ndarray, c0: np.ndarray | int, up: np.ndarray,
                  k: np.ndarray) -> np.ndarray:  # fmt: skip
        """Stages 3 and 4 per element, the rounding halves folded into c0 and the bias.

        In place on one array, in numpy: on the few thousand values of a QAT batch each
        numpy step costs a few microseconds where a torch call costs tens.  Every value
        fits the lanes (proven), so the lanes' wrap-around never happens."""
        dt = self.np_dtype
        offset = c0 - ((np.int64(1) << k) >> 1)
        z = x.astype(dt)
        z *= a0.astype(dt)
        z -= offset.astype(dt)
        z >>= k.astype(dt)
        if up.any():
            z <<= up.astype(dt)
        np.maximum(z, self._lo, out=z)
        np.minimum(z, self._hi, out=z)
        z -= self._off
        z *= self._gain
        z += self._bias
        z >>= self._shift
        np.maximum(z, self._out[0], out=z)
        return np.minimum(z, self._out[1], out=z)
