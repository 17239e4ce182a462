"""MPBN LIF neuron for QAT: integer membrane, exact BN firing rule, surrogate gradient.

:class:`MPBNLIF` is the trainable form of :class:`~qnorm.ops.spiking.MPBNNeuron`.
Input currents ``(T, B, C)`` or ``(T, B, C, *spatial)`` (time first, channels on dim 2)
are quantized to the membrane LSB; per neuron, t = 1..T:

    pre_t  = saturate(leak(post_{t-1}) + I_t)                post_0 = u_rest
    s_t    = [BN(pre_t) >= V_th]   (or >)                    BN per channel
    post_t = u_rest if s_t else pre_t                        (hard reset)
    post_t = saturate(pre_t - R) if s_t else pre_t           (soft reset)

**Forward** (bit-exact): in eval, the golden ``MPBNNeuron`` built from the running
statistics runs its own body on int64 tensors.  In training each step normalizes with
the batch statistics of that step's integer membrane (over batch and spatial
positions, as a BatchNorm called once per step; over all ranks under
torch.distributed), so step t fires by the golden neuron built from step t's
statistics; the running statistics are updated once per step.  The loop in
:meth:`MPBNLIF._train_steps` is the golden neuron's own public step
(``LIFConfig.charge``, ``neuron.fires``, ``neuron.reset``: the calls its
``_forward`` makes) with the neuron swapped per step.

**Backward**: the float MPBN LIF on the dequantized input with the float gamma/beta
(back-propagation through time), with the Heaviside's derivative replaced by the
arctan surrogate (SpikingJelly's ``ATan``):

    d s / d z  ~  alpha / 2 / (1 + (pi/2 alpha z)^2),   z = BN(u) - V_th

The reset is not detached (the gradient flows through it, as in the float baseline
``qnorm.train.models.MPBNLIF``); the soft-reset amount R is the integer neuron's
(times the input scale), a constant; saturation clamps with zero gradient outside.
Under torch.distributed the float BN's batch statistics span the ranks, as the
integer forward's do (:func:`~qnorm.nn.sync.synced_batch_norm`).

:meth:`MPBNLIF.fold` gives :class:`FoldedMPBNLIF`: one integer threshold per channel
(``u >= theta``, or ``u <= theta`` for gamma < 0, constant for gamma = 0) with spike
trains identical to the unfolded neuron's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from qnorm import fixedpoint as fp
from qnorm.analysis import OverflowRiskError
from qnorm.fixedpoint import Dyadic
from qnorm.nn.base import IntInference, from_op_layout, to_op_layout
from qnorm.nn.batchnorm import BatchStats, BNQATModule, rational_bn_constants
from qnorm.nn.quantizer import InputQuantizer
from qnorm.nn.surrogate import Output
from qnorm.ops.base import IntOp
from qnorm.ops.bnfold import FloatBN
from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig, MPBNNeuron, quantize_threshold
from qnorm.qformat import QFormat


class ATanSpike(torch.autograd.Function):
    """Heaviside forward (``z >= 0``, or ``z > 0`` if strict); arctan surrogate backward."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, alpha: float, strict: bool) -> torch.Tensor:
        ctx.save_for_backward(z)
        ctx.alpha = alpha
        return (z > 0 if strict else z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (z,) = ctx.saved_tensors
        a = ctx.alpha
        return grad * (a / 2) / (1 + (math.pi / 2 * a * z) ** 2), None, None


def _check_membrane(cfg: LIFConfig, u: torch.Tensor, name: str, step: int) -> None:
    """Without saturation a training run must stay in the membrane width (thresholds move per step)."""
    lo, hi = cfg.membrane_range
    if u.numel() and (int(u.min()) < lo or int(u.max()) > hi):
        raise OverflowRiskError(
            f"mpbn_lif training: {name!r} reached [{int(u.min())}, {int(u.max())}] at time step {step}, "
            f"outside the {cfg.membrane_bits}-bit membrane range [{lo}, {hi}]; enable saturate=True"
        )


class MPBNLIF(BNQATModule):
    """Multi-step LIF with membrane-potential BN before firing (see the module docstring).

    ``v_th``: firing threshold on the BN output (real units, fixed).  ``leak``: lambda
    in [0, 1] as a float (made a 16-bit :class:`~qnorm.fixedpoint.Dyadic`), a Dyadic,
    or None (no leak).  ``membrane_bits``/``saturate``: the membrane word; saturation
    (default) keeps every run in range, without it the range analysis must prove
    ``max_steps`` steps fit.  ``in_fmt``: fixed current format, or None to calibrate an
    ``in_bits`` signed scale in training (a power of two with ``pow2``, as a compiled model
    needs).  ``alpha``: arctan surrogate sharpness.
    Output: spikes 0/1 as float (scale 1), or an IntQuantTensor (2-bit unsigned word).
    """

    channel_dim = 2
    min_ndim = 3

    def __init__(
        self,
        channels: int,
        *,
        v_th: float = 1.0,
        leak: float | Dyadic | None = 0.5,
        reset: str = "hard",
        comparator: str = ">=",
        u_rest: int = 0,
        membrane_bits: int = 16,
        saturate: bool = True,
        max_steps: int = 256,
        in_fmt: QFormat | None = None,
        in_bits: int = 8,
        eps: float = 1e-5,
        momentum: float = 0.1,
        pow2: bool = False,
        alpha: float = 2.0,
        gamma_bits: int = 16,
        frac_bits: int = 8,
        out_frac_bits: int = 8,
        return_quant_tensor: bool = False,
    ) -> None:
        quant = InputQuantizer(in_fmt, bits=in_bits, signed=True, momentum=momentum, pow2=pow2)
        super().__init__(
            channels, quant, return_quant_tensor, eps=eps, momentum=momentum,
            gamma_bits=gamma_bits, frac_bits=frac_bits, out_frac_bits=out_frac_bits,
        )  # fmt: skip
        if isinstance(leak, (int, float)) and not isinstance(leak, bool):
            leak = Dyadic.from_float(float(leak), 16)
        if not (isinstance(v_th, (int, float)) and math.isfinite(v_th)):
            raise ValueError(f"v_th must be a finite number, got {v_th!r}")
        if not (isinstance(alpha, (int, float)) and alpha > 0):
            raise ValueError(f"alpha must be a positive number, got {alpha!r}")
        self.v_th, self.alpha = float(v_th), float(alpha)
        self.dynamics = dict(
            leak=leak, reset=reset, comparator=comparator, u_rest=u_rest,
            membrane_bits=membrane_bits, saturate=saturate, max_steps=max_steps,
        )  # fmt: skip
        self.lif_config(QFormat(in_bits, 1.0))  # validates the dynamics now, not at the first forward

    def lif_config(self, in_fmt: QFormat) -> LIFConfig:
        return LIFConfig(in_fmt, **self.dynamics)

    def golden(self, in_fmt: QFormat | None = None, stats: BatchStats | None = None) -> MPBNNeuron:
        """The golden neuron for the current gamma/beta and ``stats`` (default: running).

        Same parameters and reference as ``MPBNNeuron.from_float`` (tested field by field).
        """
        cfg = self.lif_config(self.input_format(in_fmt))
        p = self.bn_params(stats if stats is not None else self.running_stats())
        bn = self.rational(p, cfg.in_fmt.scale, 1.0)
        v_th = np.full(bn.shape, self.v_th)
        vq = quantize_threshold(v_th, self.out_frac_bits)
        return MPBNNeuron.from_rational(cfg, bn, vq, reference=FloatBN(**p), v_th=v_th)

    def forward(self, x: torch.Tensor | Any) -> Output:
        q = self.quantize_input(x)
        u = to_op_layout(q.ints, self.channel_dim)  # (T, B, *spatial, C): the golden layout
        if self.training:
            spikes, neurons = self._train_steps(u, q.fmt)
        else:
            op = self.golden(q.fmt)
            spikes, neurons = op._forward(u, None), [op] * u.shape[0]
        cfg = self.lif_config(q.fmt)
        resets = [torch.from_numpy(n.params.reset_sub * q.fmt.scale) for n in neurons]
        running, sync = self.frozen_running(), self.syncing()

        def surrogate(xd: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self._float_lif(xd, w, b, cfg, running, resets, sync)

        out_fmt = MPBNNeuron.out_fmt
        return self.finish(q, from_op_layout(spikes, self.channel_dim), out_fmt, surrogate, (self.weight, self.bias))

    def _train_steps(self, u: torch.Tensor, fmt: QFormat) -> tuple[torch.Tensor, list[MPBNNeuron]]:
        """The golden dynamics with step t firing by the neuron of step t's batch statistics."""
        cfg = self.lif_config(fmt)
        spikes, neurons, state = u * 0, [], None
        for t in range(u.shape[0]):
            cur = u[t]
            pre = cfg.charge(cfg.rest_like(cur) if state is None else state, cur)
            if not cfg.saturate:
                _check_membrane(cfg, pre, "membrane", t + 1)
            stats = self.training_stats(pre, fmt.scale)
            self.update_running_stats(stats)
            op = self.golden(fmt, stats)
            fire = op.fires(pre)
            state = op.reset(pre, fire)
            if not cfg.saturate:
                _check_membrane(cfg, state, "membrane_reset", t + 1)
            spikes[t] = fp.select(fire, 1, 0)
            neurons.append(op)
        return spikes, neurons

    def _float_lif(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor,
        cfg: LIFConfig,
        running: tuple[torch.Tensor, torch.Tensor] | None,
        resets: list[torch.Tensor],
        sync: bool = False,
    ) -> torch.Tensor:
        """The float neuron (real units) whose gradient the layer uses; spikes (T, B, C, ...)."""
        scale = cfg.in_fmt.scale
        lam = 1.0 if cfg.leak is None else float(cfg.leak.value)
        lo, hi = (v * scale for v in cfg.membrane_range)
        rest = cfg.u_rest * scale
        per_channel = (-1,) + (1,) * (x.dim() - 3)  # broadcast (C,) over (B, C, *spatial)
        u = torch.full_like(x[0], rest)
        out = []
        for t in range(x.shape[0]):
            h = lam * u + x[t]
            h = h.clamp(lo, hi) if cfg.saturate else h
            z = self.surrogate_bn(h, w, b, running, sync)
            s = ATanSpike.apply(z - self.v_th, self.alpha, cfg.comparator == ">")
            if cfg.reset == "hard":
                u = h * (1 - s) + rest * s
            else:
                u = h - s * resets[t].to(x.device, x.dtype).view(per_channel)
                u = u.clamp(lo, hi) if cfg.saturate else u
            out.append(s)
        return torch.stack(out) if out else x * 0

    def fold(self) -> FoldedMPBNLIF:
        """The folded neuron for the eval-mode (running statistics) parameters."""
        return FoldedMPBNLIF(self.golden().fold(), self.channels, self.return_quant_tensor)

    def _constants(self, op: IntOp) -> dict[str, Any]:
        return {
            **rational_bn_constants(op.params.bn),
            "v_th_q": op.params.v_th_q,
            "reset_sub": op.params.reset_sub,
            **_dynamics_constants(op),
        }

    def _config_metadata(self) -> dict[str, Any]:
        return {**super()._config_metadata(), "v_th": self.v_th, "surrogate": "atan", "alpha": self.alpha}

    def extra_repr(self) -> str:
        d = self.dynamics
        leak, reset, comparator = d["leak"], d["reset"], d["comparator"]
        return f"{self.channels}, v_th={self.v_th}, leak={leak}, reset={reset}, comparator={comparator!r}"


def _dynamics_constants(op: IntOp) -> dict[str, Any]:
    cfg, event = op.cfg, op.event
    return {
        "leak": None if cfg.leak is None else {"m": cfg.leak.m, "s": cfg.leak.s},
        "reset": cfg.reset,
        "comparator": cfg.comparator,
        "u_rest": cfg.u_rest,
        "membrane_bits": cfg.membrane_bits,
        "saturate": cfg.saturate,
        "theta": event.theta,
        "negative": event.negative,
        "rounding": fp.DEFAULT_ROUND,
    }


class FoldedMPBNLIF(IntInference):
    """Folded MPBN LIF: fire iff ``u >= theta`` (``u <= theta`` where gamma < 0) per channel.

    Inference only; input currents ``(T, B, C, *spatial)``, float (quantized with the
    fixed format the thresholds were derived for) or an IntQuantTensor of that format.
    """

    channel_dim = 2
    min_ndim = 3
    op: FoldedLIFNeuron

    def _constants(self, op: IntOp) -> dict[str, Any]:
        return {"reset_sub": op.params.reset_sub, **_dynamics_constants(op)}
