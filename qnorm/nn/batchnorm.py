"""BatchNorm in the QAT layers: exact integer batch statistics and the shared BN layer base.

:func:`batch_stats` computes per-channel statistics from the exact integer sums of the
quantized input (all-reduced over the ranks under torch.distributed);
:class:`BNQATModule` holds the BN parameters and running statistics that
:class:`~qnorm.nn.MPBNLIF` and :class:`~qnorm.nn.BNQuantAct` share.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qnorm.nn.base import IntInference, QATModule, param_array
from qnorm.nn.quantizer import InputQuantizer
from qnorm.nn.sync import all_reduce_max, distributed, synced_batch_norm
from qnorm.ops.bnfold import RationalBN, check_bn_stats, real_params


@dataclass(frozen=True, eq=False)
class BatchStats:
    """Per-channel BN statistics in real units (float64): what normalizes, what is tracked."""

    mean: np.ndarray
    var: np.ndarray  # biased: the batch is normalized with it
    var_unbiased: np.ndarray  # the running variance tracks it (as torch BN)


def batch_stats(ints: torch.Tensor, scale: float, *, sync: bool = False, group: Any = None) -> BatchStats:
    """BN statistics of integers (channels on the last axis, ``real = int * scale``).

    With n values per channel, ``S = sum x`` and ``V = n sum x^2 - S^2`` are exact
    integers; the mean is the float64 nearest ``S s / n`` and the variance the float64
    nearest ``V s^2 / n^2`` (unbiased: ``/ (n (n - 1))``), by Python's correctly rounded
    int / int division.  So the statistics, and the integer constants derived from
    them, are the same on every device and for every reduction order.

    ``sync``: first all-reduce (sum) the exact integers ``S``, ``sum x^2`` and ``n``
    over the ranks of ``group`` (torch.distributed, default the world; plus one
    all-reduce max of ``max |x|`` for the overflow check), so every rank gets the
    statistics of the global batch, bit for bit those of the concatenated batch
    (integer sums do not depend on the order).  Every check runs after the
    reductions, on global values, so all ranks accept or refuse together.
    """
    flat = ints.reshape(-1, ints.shape[-1])
    n, c = flat.shape
    peak = flat.abs().max() if flat.numel() else flat.new_zeros(())
    sums, squares = flat.sum(0), (flat * flat).sum(0)  # squares may wrap: then the check below refuses
    if sync:
        peak = all_reduce_max(peak, group)
        packed = torch.cat([sums, squares, flat.new_tensor([n])])
        dist.all_reduce(packed, group=group)
        sums, squares, n = packed[:c], packed[c: 2 * c], int(packed[-1])
    if n < 2:
        raise ValueError(f"BatchNorm in training needs more than one value per channel, got {n}")
    peak = int(peak)
    if peak * peak * n >= 1 << 63:
        raise ValueError(f"batch too large for exact int64 statistics: {n} values up to |{peak}| per channel")
    sums, squares = sums.tolist(), squares.tolist()
    num, den = float(scale).as_integer_ratio()
    dev = [n * q - s * s for s, q in zip(sums, squares, strict=True)]
    return BatchStats(
        mean=np.array([s * num / (n * den) for s in sums]),
        var=np.array([v * num * num / (n * n * den * den) for v in dev]),
        var_unbiased=np.array([v * num * num / (n * (n - 1) * den * den) for v in dev]),
    )


def rational_bn_constants(bn: RationalBN) -> dict[str, Any]:
    """The integer fields of a RationalBN, for metadata."""
    return {
        "gamma_m": bn.gamma_m,
        "gamma_shift": bn.gamma_shift,
        "mean_q": bn.mean_q,
        "std_q": bn.std_q,
        "frac_bits": bn.frac_bits,
        "beta_q": bn.beta_q,
        "out_frac_bits": bn.out_frac_bits,
    }


class BNQATModule(QATModule):
    """Per-channel BatchNorm state shared by the BN-based QAT layers.

    ``weight`` (gamma) and ``bias`` (beta) are learnable floats; ``running_mean`` and
    ``running_var`` track the batch statistics of the *quantized* integers seen in
    training (:func:`batch_stats`), ``r <- (1 - momentum) r + momentum b`` computed in
    float64 on the host, unbiased variance, as torch BN.  ``eps`` is in real units of
    the variance.  ``gamma_bits``/``frac_bits``/``out_frac_bits`` are the precision of
    the derived :class:`~qnorm.ops.bnfold.RationalBN` constants.

    Under ``torch.distributed`` the batch statistics are those of the global batch
    (:meth:`training_stats`: the exact integer sums are all-reduced over
    ``process_group``, default the world; ``sync_stats = False`` keeps them per rank),
    so the running statistics stay bitwise identical across replicas.

    BN only enters a firing or quantization decision in these layers, so every one of
    them folds (:meth:`fold`) into an integer-threshold module with identical outputs:
    what deployment and export run in its place.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self,
        channels: int,
        input_quant: InputQuantizer,
        return_quant_tensor: bool,
        *,
        eps: float,
        momentum: float,
        gamma_bits: int,
        frac_bits: int,
        out_frac_bits: int,
    ) -> None:
        super().__init__(channels, input_quant, return_quant_tensor)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        self.eps, self.momentum = float(eps), float(momentum)
        self.gamma_bits, self.frac_bits, self.out_frac_bits = gamma_bits, frac_bits, out_frac_bits
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
        self.sync_stats, self.process_group = True, None  # see training_stats

    @abc.abstractmethod
    def fold(self) -> IntInference:
        """The integer-threshold module equal to the eval-mode (running statistics) layer."""

    def running_stats(self) -> BatchStats:
        var = param_array(self.running_var)
        return BatchStats(param_array(self.running_mean), var, var)

    def update_running_stats(self, stats: BatchStats) -> None:
        keep, m = 1.0 - self.momentum, self.momentum
        self.running_mean.copy_(torch.from_numpy(keep * param_array(self.running_mean) + m * stats.mean))
        self.running_var.copy_(torch.from_numpy(keep * param_array(self.running_var) + m * stats.var_unbiased))
        self.num_batches_tracked.add_(1)

    def bn_params(self, stats: BatchStats) -> dict[str, np.ndarray]:
        """Validated float64 gamma, beta, mean, var, eps (NaN/Inf and var < 0 refused by name)."""
        p = real_params(
            gamma=param_array(self.weight), beta=param_array(self.bias), mean=stats.mean, var=stats.var,
            eps=np.full(self.channels, self.eps),
        )  # fmt: skip
        check_bn_stats(p["var"], p["eps"])
        return p

    def rational(self, p: dict[str, np.ndarray], in_scale: float, out_scale: float) -> RationalBN:
        return RationalBN.from_float(
            p["gamma"], p["beta"], p["mean"], p["var"], p["eps"], in_scale, out_scale,
            self.gamma_bits, self.frac_bits, self.out_frac_bits,
        )  # fmt: skip

    def training_stats(self, ints: torch.Tensor, scale: float) -> BatchStats:
        """:func:`batch_stats` of channel-last integers, over all ranks under torch.distributed.

        In training with an initialized process group (and ``sync_stats``), the exact
        integer sums are all-reduced first: every replica normalizes with the global
        batch statistics and applies the identical running-statistics update, like
        ``SyncBatchNorm`` (exactly, since the sums are integers).
        """
        return batch_stats(ints, scale, sync=self.syncing(), group=self.process_group)

    def syncing(self) -> bool:
        """Whether this forward's batch statistics span the ranks (training, process group, ``sync_stats``)."""
        return self.training and self.sync_stats and distributed()

    def surrogate_bn(
        self,
        h: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor,
        running: tuple[torch.Tensor, torch.Tensor] | None,
        sync: bool = False,
    ) -> torch.Tensor:
        """Float BN of (N, C, ...) ``h``: batch statistics if ``running`` is None (training).

        ``sync`` (the forward's :meth:`syncing`, captured when it ran): the batch
        statistics span all ranks, as the integer forward's did, and so does their
        gradient (:func:`~qnorm.nn.sync.synced_batch_norm`).
        """
        if running is None and sync:
            return synced_batch_norm(h, w.to(h.dtype), b.to(h.dtype), self.eps, self.process_group)
        rm, rv = (None, None) if running is None else (r.to(h.dtype) for r in running)
        return F.batch_norm(h, rm, rv, w.to(h.dtype), b.to(h.dtype), running is None, 0.0, self.eps)

    def frozen_running(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Running statistics for an eval-mode surrogate (a copy: backward runs later), None in training."""
        return None if self.training else (self.running_mean.detach().clone(), self.running_var.detach().clone())

    def _config_metadata(self) -> dict[str, Any]:
        return {
            "eps": self.eps,
            "momentum": self.momentum,
            "gamma_bits": self.gamma_bits,
            "frac_bits": self.frac_bits,
            "out_frac_bits": self.out_frac_bits,
        }
