"""Integer normalization layers for QAT: bit-exact integer forward, float surrogate backward.

:class:`IntLayerNorm`, :class:`L1LayerNorm`, :class:`ShiftLayerNorm` and
:class:`IntRMSNorm` are the trainable forms of the golden ops of the same names in
:mod:`qnorm.ops`; all normalize the last axis of ``(..., N)`` and are drop-in
replacements for ``nn.LayerNorm(N)`` / ``nn.RMSNorm(N)`` (same leading constructor
arguments, same ``weight``/``bias``/``eps`` attributes).

**Forward** (bit-exact, :mod:`qnorm.nn._qat`: the recipe): the input is quantized (a fixed
``in_fmt``, a per-tensor scale calibrated in training, or a Brevitas
``IntQuantTensor``'s own integers); the golden op is re-derived from the current
float γ, β, ε in every forward, as its own ``from_float`` derives it (γ into
per-channel dyadic multipliers — powers of two for ShiftLayerNorm — and β into
accumulator units, so a training step's parameter update is seen by the next
forward; while γ, β, ε and the formats are unchanged, as in eval, the last derivation
is reused); the op's integers come from :class:`~qnorm.nn.elementchain.ElementChain`
(the op's own per-row stages and its per-element chain fused, in int32 where proven,
or with the ``fast`` extra one compiled loop of both; tested equal to the golden
body), inside :func:`qnorm.fixedpoint.proven_ranges` (the op's range analysis covers
every input of its format, so the per-call operand checks are skipped), and the
output is ``golden_ints * out_fmt.scale`` in the input's float dtype, exactly.  With
the ``fast`` extra a CPU training step does the derivation's per-channel part and the
integers in compiled loops, without assembling the op (:mod:`qnorm.nn.jitderive`: the
same integers as ``from_float``'s op, tested; ``golden()`` forms the op when asked).

**Backward**: the vector-Jacobian product of the float op the integer op
approximates, at the dequantized input with the float γ, β, clipped to the output
format's range (a straight-through estimator that is zero where the output
saturates, as for Brevitas' activation quantizers); the input quantizer passes the
gradient where it did not clip.  The surrogate is evaluated in the forward's own graph
and its value replaced by the exact output (:func:`~qnorm.nn.surrogate.surrogate_in_graph`:
the gradients of :func:`~qnorm.nn.surrogate.exact_forward`, without a second autograd
pass in the backward).  Per layer the surrogate is

* IntLayerNorm, ShiftLayerNorm: ``F.layer_norm``.  For ShiftLayerNorm this is a
  straight-through estimator over the power-of-two approximation as well: the
  gradient ignores that 1/σ and γ are rounded to (one- or two-term) powers of two,
  and γ gets the gradient of the continuous γ it is rounded from;
* L1LayerNorm: the true L1 norm ``γ (x − μ) / (sqrt(π/2) MAD + ε) + β``,
  ``MAD = mean |x − μ|`` (the op's float reference, written in torch);
* IntRMSNorm: ``F.rms_norm``; with ``partial = p < 1`` the partial RMS norm whose
  mean square comes from the first ``k = ceil(p N)`` elements of each row.

The L1 and RMS surrogates are several torch operations each (torch's CPU ``rms_norm``
is composite), so on the CPU their gradients come from compiled loops instead
(:mod:`qnorm.nn.jitsurrogate`, with the ``fast`` extra): the same VJP with its sums in
float64, one autograd node where the torch graph has half a dozen to a dozen.

With ``eps = 0`` the surrogates take one unit of the golden op's statistic as their ε
(:func:`surrogate_eps`): the float op is 0/0 on a row of equal values, which the
integer op handles, and its NaN gradient would reach every parameter.

The layers are the norm kinds ``int_ln``, ``l1``, ``shift``, ``shift1`` (one-term
mantissa) and ``int_rms`` of :mod:`qnorm.nn.kinds`, by which models and conversions
choose them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qnorm import ops
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.nn import jitderive
from qnorm.nn.base import QATModule, param_array, require_qformat
from qnorm.nn.elementchain import ElementChain
from qnorm.nn.jitsurrogate import SQRT_HALF_PI, l1_surrogate_in_graph, rms_surrogate_in_graph
from qnorm.nn.quantizer import InputQuantizer, QuantizedInput, is_quant_tensor
from qnorm.nn.surrogate import Output, Surrogate, clip_surrogate, surrogate_in_graph, to_output
from qnorm.ops._normcore import DEFAULT_OUT, ChannelRule, ChannelWriter, FloatParams, NormConfig, NormOp
from qnorm.qformat import QFormat


def _channels(normalized_shape: int | Sequence[int]) -> int:
    """nn.LayerNorm's ``normalized_shape`` restricted to what the golden ops do: one axis."""
    if isinstance(normalized_shape, Sequence):
        if len(normalized_shape) != 1:
            raise ValueError(
                f"qnorm norm layers normalize the last axis only; normalized_shape must be an int or a "
                f"1-element sequence, got {tuple(normalized_shape)}"
            )
        normalized_shape = normalized_shape[0]
    if isinstance(normalized_shape, bool) or not isinstance(normalized_shape, int) or normalized_shape < 1:
        raise ValueError(f"normalized_shape must be a positive integer, got {normalized_shape!r}")
    return normalized_shape


@functools.lru_cache(maxsize=64)
def _prove_config(
    op_cls: type[NormOp], n: int, eps: float, fmt: QFormat, out_fmt: QFormat, rounding: Round, options: tuple
) -> None:
    """``op_cls.from_float`` with unit γ (raises for a config it refuses).  Cached: a
    model's norms mostly share a config, and one derivation costs ~5-20 ms at N = 768-4096."""
    op_cls.from_float(np.ones(n), None, eps, fmt, out_fmt, rounding=rounding, **dict(options))


@functools.lru_cache(maxsize=64)
def _channel_rule(
    op_cls: type[NormOp], n: int, eps: float, fmt: QFormat, out_fmt: QFormat, rounding: Round, options: tuple
) -> ChannelRule:
    """``op_cls.channel_rule`` of a layer's arguments, cached: a model's norms share a few,
    and the calibrated input scale settles within a few steps."""
    return op_cls.channel_rule(n, eps, fmt, out_fmt, rounding=rounding, **dict(options))


def surrogate_eps(config: NormConfig, eps: float) -> float:
    """The ε of the surrogate's float op: the layer's, or where that is 0, one unit of the
    golden op's statistic in real units (``1 / eps_exact(1)``: ε is linear in it).

    With ε = 0 the float op divides by its statistic, which is 0 on a row whose values
    are all equal (all zero for RMSNorm, or its first k for partial RMSNorm): its value
    and every gradient through it would be NaN, and the optimizer would write NaN into
    γ, β and every layer before.  The integer op has no such row: a statistic of 0
    counts as 1 (:func:`~qnorm.ops._normcore.split_exponent`), so one unit is the
    smallest statistic it divides by, and the surrogate's gradient stays finite where
    the integer output is defined.  A row whose statistic is W units gets 1/W of it
    added: little on any row that is not nearly constant."""
    return eps if eps > 0 else float(1 / config.eps_exact(1.0))


class Integers(Protocol):
    """What forms an op's output from its int64 input integers (an ElementChain, a StepChain)."""

    def values(self, ints: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """The op's output integers times ``scale`` in float ``dtype``, as torch forms it."""


@dataclass(eq=False)
class _Derivation:
    """A layer's derivation for one set of floats and formats (``key``): its rule, the
    float γ and β it read, the op (None until asked for, where a step chain did without
    it), the op's config (the structure's, for a step chain) and the integers' chain."""

    key: tuple[Any, ...]
    rule: ChannelRule
    gamma: np.ndarray
    beta: np.ndarray | None
    op: NormOp | None
    config: NormConfig
    chain: Integers | None


class IntNorm(QATModule):
    """What the four norm layers share; a subclass names its golden op and float op.

    ``op_cls``: the golden op class; ``_op_options``: its extra ``from_float``
    arguments; ``_float_op``: the unquantized float op (the surrogate before the
    output clip), with ``w``/``b`` None when the layer has no γ/β.
    """

    channel_dim = -1
    min_ndim = 1
    op_cls: ClassVar[type[NormOp]]

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        out_fmt: QFormat = DEFAULT_OUT,
        in_fmt: QFormat | None = None,
        in_bits: int = 8,
        momentum: float = 0.1,
        pow2: bool = False,
        rounding: Round | str = DEFAULT_ROUND,
        return_quant_tensor: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        n = _channels(normalized_shape)
        require_qformat(out_fmt)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        quant = InputQuantizer(in_fmt, bits=in_bits, momentum=momentum, pow2=pow2)
        super().__init__(n, quant, return_quant_tensor)
        self.normalized_shape = (n,)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.out_fmt = out_fmt
        self.rounding = Round.parse(rounding)
        make = {"device": device, "dtype": dtype}
        # Registered even when absent (None), as nn.LayerNorm does: layer.weight / layer.bias always exist.
        self.register_parameter("weight", nn.Parameter(torch.ones(n, **make)) if elementwise_affine else None)
        self.register_parameter("bias", nn.Parameter(torch.zeros(n, **make)) if elementwise_affine and bias else None)
        self._prove_config()

    # ---- the golden op

    def _prove_config(self) -> None:
        """Derive the golden op once with unit γ and no β, so its range analysis refuses
        a config no input can run (e.g. ``OverflowRiskError`` for N = 65538 at 16 bits)
        here and not at the first forward.  A calibrated input's scale is not known yet:
        its width is proven at scale 1, and every forward's derivation checks the real one.
        Subclasses set their op options before this base constructor runs it."""
        quant = self.input_quant
        fmt = quant.fixed if quant.fixed is not None else QFormat(quant.bits, 1.0, quant.signed)
        options = tuple(sorted(self._op_options().items()))
        _prove_config(self.op_cls, self.channels, self.eps, fmt, self.out_fmt, self.rounding, options)

    def golden(self, in_fmt: QFormat | None = None) -> NormOp:
        """The golden op for the current γ, β, ε and input format (default: the quantizer's).

        ``from_float`` is a deterministic function of its arguments, so the last op
        is reused while they are unchanged (compared by value: γ and β bytes, the
        formats, ε, the rounding and the op options) — eval and frozen-parameter
        forwards skip the derivation; a training step's update re-derives it: from
        ``from_float``'s channel rule, kept while the formats, ε and options are
        unchanged, with the per-channel part compiled where the ``fast`` extra is
        installed (:mod:`qnorm.nn.jitderive`, tested equal to ``from_float``).
        """
        d = self._derive(self.input_format(in_fmt), lean=False)
        if d.op is None:  # a training forward's step chain needed none: formed now, from the same floats
            d.op = d.rule.op(FloatParams.checked(d.gamma, d.beta, self.eps), self._writer())
            d.config = d.op.config
        return d.op

    def _writer(self) -> ChannelWriter | None:
        """The compiled per-channel writer in training, where the layer derives every step
        (its first call compiles it, ~2 s); elsewhere a derivation runs once per set of
        parameters and the numpy part serves it."""
        return jitderive.channel_ints if self.training else None

    def _derive(self, fmt: QFormat, lean: bool) -> _Derivation:
        """The derivation for the current floats and ``fmt`` (the last one while they are
        unchanged).  ``lean``: a step chain without the op will do (a CPU forward), so the
        layer's :class:`~qnorm.nn.jitderive.StepDeriver` may form it; else, or where it
        declines, the op itself (``ChannelRule.op``)."""
        gamma = param_array(self.weight) if self.weight is not None else np.ones(self.channels)
        beta = param_array(self.bias) if self.bias is not None else None
        options = tuple(sorted(self._op_options().items()))
        key = (
            fmt, self.out_fmt, self.eps, self.rounding, options, gamma.tobytes(),
            None if beta is None else beta.tobytes(),
        )  # fmt: skip
        memo = getattr(self, "_derivation", None)
        if memo is not None and memo.key == key:
            return memo
        rule = _channel_rule(self.op_cls, self.channels, self.eps, fmt, self.out_fmt, self.rounding, options)
        deriver = getattr(self, "_deriver", None)
        chain = None
        if lean and deriver is not None and deriver.rule is rule:
            chain = deriver(gamma, np.zeros(self.channels) if beta is None else beta)
        if chain is not None:
            d = _Derivation(key, rule, gamma, beta, None, deriver.structure.config, chain)
        else:
            op = rule.op(FloatParams.checked(gamma, beta, self.eps), self._writer())
            d = _Derivation(key, rule, gamma, beta, op, op.config, None)
        self.__dict__["_derivation"] = d
        return d

    def _op_options(self) -> dict[str, Any]:
        return {}

    # ---- forward

    def forward(self, x: torch.Tensor | Any) -> Output:
        """``golden(fmt).forward(x_int) * out_fmt.scale`` exactly; surrogate gradient.

        The integers come from :class:`~qnorm.nn.elementchain.ElementChain`: the op's
        own per-row stages and its per-element chain fused (tested equal to the
        golden body), or in a training step on the CPU from the layer's
        :class:`~qnorm.nn.jitderive.StepDeriver` (the same integers, without assembling
        the op).  They run inside :func:`qnorm.fixedpoint.proven_ranges`: the op's range
        analysis passed for every input of ``q.fmt``, and ``q.ints`` lie in ``q.fmt``
        (the quantizer saturates; an IntQuantTensor's integers are checked against its
        declared width), so fixedpoint's per-call operand checks (two reductions each, a
        device sync each on a GPU) are skipped.
        """
        self._check_dtype(x)
        q = self.quantize_input(x)
        exact, config = self._golden_values(q)
        return to_output(self._with_gradient(exact, config, q), self.out_fmt, self.return_quant_tensor, self.training)

    def _with_gradient(self, exact: torch.Tensor, config: NormConfig, q: QuantizedInput) -> torch.Tensor:
        """``exact`` with the clipped surrogate's gradient at the dequantized input: from the
        layer's compiled loops where it has them and they apply, else the torch graph (also
        in a graph ``torch.compile`` traces: its compiler fuses the graph itself)."""
        params = tuple(p for p in (self.weight, self.bias) if p is not None)
        if not torch.is_grad_enabled() or not (q.value.requires_grad or any(p.requires_grad for p in params)):
            return exact  # eval and no_grad: no surrogate to form
        if not torch.compiler.is_compiling():
            y = self._compiled_gradient(exact, config, q)
            if y is not None:
                return y
        # fresh: the surrogate ends in clip_surrogate (_surrogate), whose backward reads only its input
        return surrogate_in_graph(exact, self._surrogate(config), q, params, fresh=True)

    def _compiled_gradient(self, exact: torch.Tensor, config: NormConfig, q: QuantizedInput) -> torch.Tensor | None:
        """``exact`` with the surrogate's gradient from compiled loops
        (:mod:`qnorm.nn.jitsurrogate`), or None: the torch graph serves."""
        return None

    # One opaque call under torch.compile for the derivation and the integers (numba inside);
    # the compiled loops it reaches need no guard of their own on this road.
    @torch.compiler.disable
    def _golden_values(self, q: QuantizedInput) -> tuple[torch.Tensor, NormConfig]:
        """The golden op's output integers of ``q`` times the output scale, in the input's
        float dtype (exactly as torch forms that product), and the op's config."""
        chain, config = self._integers(q.fmt, q.ints.device)
        return chain.values(q.ints, self.out_fmt.scale, q.value.dtype), config

    def _integers(self, fmt: QFormat, device: torch.device) -> tuple[Integers, NormConfig]:
        """What computes the golden op's integers of the current floats and ``fmt`` on
        ``device``'s int64 input, and the op's config (its formats and ε)."""
        cpu = device.type == "cpu"
        d = self._derive(fmt, lean=cpu)
        if d.chain is None or not (cpu or isinstance(d.chain, ElementChain)):
            if d.op is None:  # a step chain runs CPU input only (the layer moved since): the op's chain
                self.golden(fmt)
            chain = d.chain = ElementChain(d.op, like=getattr(self, "_last_chain", None))
            kernel = chain._compiled if chain.fused else None
            # the per-step state bypasses Module.__setattr__ (no parameter, buffer or module)
            self.__dict__["_last_chain"] = chain
            self.__dict__["_deriver"] = jitderive.StepDeriver.of(d.rule, d.op, kernel, chain.np_dtype)
        return d.chain, d.config

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The unquantized float op on ``x`` with the float γ, β, ε (no rounding, no clip)."""
        return self._float_op(x, self.weight, self.bias, self.eps)

    def _surrogate(self, config: NormConfig) -> Surrogate:
        lo, hi = self.out_fmt.real_range
        has_w, has_b = self.weight is not None, self.bias is not None
        eps = surrogate_eps(config, self.eps)

        def surrogate(xd: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
            w = params[0] if has_w else None
            b = params[has_w] if has_b else None
            return clip_surrogate(self._float_op(xd, w, b, eps), lo, hi)

        return surrogate

    def _float_op(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, w, b, eps)

    def _check_dtype(self, x: torch.Tensor | Any) -> None:
        """Refuse an input whose float dtype differs from γ's.

        The forward would still be exact (it runs in the input's dtype), but the
        surrogate would mix dtypes and the layer would train in a dtype its
        parameters are not in; nn.LayerNorm refuses the mix as well.
        """
        value = x.value if is_quant_tensor(x) else x
        w = self.weight  # None only without affine parameters: then any float dtype is fine
        if (
            w is not None
            and isinstance(value, torch.Tensor)
            and value.dtype.is_floating_point
            and value.dtype != w.dtype
        ):
            raise ValueError(
                f"input dtype {value.dtype} differs from {type(self).__name__}'s parameter dtype {w.dtype}; "
                f"convert one of them (e.g. layer.to({value.dtype}))"
            )

    # ---- metadata

    def _constants(self, op: NormOp) -> dict[str, Any]:
        return {f.name: getattr(op.config, f.name) for f in fields(op.config) if f.name not in ("in_fmt", "out_fmt")}

    def _config_metadata(self) -> dict[str, Any]:
        return {
            "eps": self.eps,
            "elementwise_affine": self.elementwise_affine,
            "bias": self.bias is not None,
            "rounding": self.rounding.value,
            **self._op_options(),
        }

    def extra_repr(self) -> str:
        opts = "".join(f", {k}={v}" for k, v in self._op_options().items())
        return (
            f"{self.channels}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"out_fmt={self.out_fmt}, rounding={self.rounding.value}{opts}"
        )


class IntLayerNorm(IntNorm):
    """Integer LayerNorm (exact integer rsqrt) over the last axis; surrogate ``F.layer_norm``.

    ``out_fmt``: the output format (default int8 covering ±4, the golden ops'
    default).  ``in_fmt``: a fixed input format, or None to calibrate an
    ``in_bits``-wide signed per-tensor scale in training (``momentum``: its moving
    average; ``pow2``: rounded up to a power of two, as a compiled model needs).
    ``rounding``: the tie rule of every rounding in the op (half up by
    default).  Output: a float tensor, or an IntQuantTensor with
    ``return_quant_tensor=True``.
    """

    op_cls = ops.IntLayerNorm


class L1LayerNorm(IntNorm):
    """L1 LayerNorm (mean absolute deviation, one reciprocal per row); arguments as IntLayerNorm.

    Surrogate: the true L1 norm ``γ (x − μ) / (sqrt(π/2) MAD + ε) + β``.
    """

    op_cls = ops.L1LayerNorm

    def _compiled_gradient(self, exact: torch.Tensor, config: NormConfig, q: QuantizedInput) -> torch.Tensor | None:
        """The true L1 norm's VJP in compiled loops (the torch graph's gradient up to float
        rounding, one autograd node where the graph has a dozen)."""
        eps = surrogate_eps(config, self.eps)
        return l1_surrogate_in_graph(exact, q, self.weight, self.bias, eps, *self.out_fmt.real_range)

    def _float_op(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
        x = x - x[..., :1]  # as the golden op's float reference: a row of equal values deviates by 0
        dev = x - x.mean(dim=-1, keepdim=True)
        y = dev / (SQRT_HALF_PI * dev.abs().mean(dim=-1, keepdim=True) + eps)
        y = y * w if w is not None else y
        return y + b if b is not None else y


class ShiftLayerNorm(IntNorm):
    """Shift-based LayerNorm (1/σ and γ as powers of two); arguments as IntLayerNorm plus
    ``mantissa_terms`` (1 or 2: terms of 1/sqrt of the variance's mantissa).

    Surrogate: plain ``F.layer_norm`` — the straight-through estimator ignores the
    power-of-two approximation of 1/σ and γ (module docstring).
    """

    op_cls = ops.ShiftLayerNorm

    def __init__(self, normalized_shape: int | Sequence[int], *args: Any, mantissa_terms: int = 2, **kw: Any) -> None:
        if mantissa_terms not in (1, 2):
            raise ValueError(f"mantissa_terms must be 1 or 2, got {mantissa_terms!r}")
        self.mantissa_terms = mantissa_terms  # first: the base constructor proves the config with it
        super().__init__(normalized_shape, *args, **kw)

    def _op_options(self) -> dict[str, Any]:
        return {"mantissa_terms": self.mantissa_terms}


class IntRMSNorm(IntNorm):
    """Integer RMSNorm ``γ x / sqrt(mean(x²) + ε)`` over the last axis, or partial RMSNorm.

    Mirrors ``nn.RMSNorm`` (no β; ``eps`` a number, default 1e-5, where torch's None
    would depend on the dtype).  ``partial = p`` in (0, 1]: the mean square is taken
    over the first ``prefix = ceil(p N)`` elements of each row and applied to all.
    Other arguments as :class:`IntLayerNorm`.  Surrogate: ``F.rms_norm``, or the
    partial RMS norm in torch.
    """

    op_cls = ops.IntRMSNorm

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        *,
        partial: float = 1.0,
        out_fmt: QFormat = DEFAULT_OUT,
        in_fmt: QFormat | None = None,
        in_bits: int = 8,
        momentum: float = 0.1,
        pow2: bool = False,
        rounding: Round | str = DEFAULT_ROUND,
        return_quant_tensor: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ValueError(f"partial must be a number in (0, 1], got {partial!r}")
        self.partial = float(partial)  # first: the base constructor proves the config with it
        super().__init__(
            normalized_shape, eps, elementwise_affine, False, out_fmt=out_fmt, in_fmt=in_fmt, in_bits=in_bits,
            momentum=momentum, pow2=pow2, rounding=rounding, return_quant_tensor=return_quant_tensor,
            device=device, dtype=dtype,
        )  # fmt: skip
        # k = ceil(p N) from the float's exact value: RMSNormConfig.prefix's rule (tested equal);
        # the float op needs it before any golden op exists (an uncalibrated layer).
        self.prefix = math.ceil(Fraction(self.partial) * self.channels)

    def _op_options(self) -> dict[str, Any]:
        return {"partial": self.partial}

    def _compiled_gradient(self, exact: torch.Tensor, config: NormConfig, q: QuantizedInput) -> torch.Tensor | None:
        """The (partial) RMS norm's VJP in compiled loops (torch's CPU ``rms_norm`` is half a
        dozen operations and autograd nodes; the same gradient up to float rounding)."""
        eps = surrogate_eps(config, self.eps)
        return rms_surrogate_in_graph(exact, q, self.weight, self.prefix, eps, *self.out_fmt.real_range)

    def _float_op(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
        if self.prefix == self.channels:
            return F.rms_norm(x, self.normalized_shape, w, eps)
        ms = (x[..., : self.prefix] ** 2).mean(dim=-1, keepdim=True)
        y = x / torch.sqrt(ms + eps)
        return y * w if w is not None else y
