"""Small digit classifiers that the qnorm norm layers and spiking neurons plug into.

Three models, all with int8 weights and int8 activation fake-quantization where a
linear or conv consumes a non-integer tensor:

* `DigitsTransformer`: row tokens -> 2 pre-norm encoder blocks -> mean-pool -> head.
  Every norm layer comes from `norm_factory(kind, dim)`. Float softmax and GELU
  (not deployable by `qnorm compile`), or with `integer=True` IntSoftmax attention
  and an IntGELU (or LLaMA-style gated IntSiLU) MLP on power-of-two grids: deployable.
* `DigitsMixer`: row tokens -> MLP-mixer blocks (token MLP, channel MLP, ReLU) ->
  mean-pool -> head, with power-of-two scales everywhere: deployable.
* `DigitsSNN`: direct-encoded convolutional spiking network. Every spiking neuron
  comes from `neuron_factory(kind, channels)`; `pow2=True` makes it deployable.

Deployable means every tensor between quantizers lies on a power-of-two grid:
Brevitas fixed-point quantizers (power-of-two scales), Int32Bias biases (scale
s_x * s_w: on the accumulator's grid), qnorm layers whose input quantizer
calibrates a power-of-two scale, ReLU, and means over power-of-two counts. Then a
compiled float graph reproduces the QAT model bit for bit (see `qnorm.deploy`).

The norm and neuron kinds are those of `qnorm.nn.kinds` (qnorm's layers and the float
references; this module adds its float neuron "float_mpbn_lif"). Extension:
`register_norm(kind, ctor)` / `register_neuron(kind, ctor)`. A norm ctor takes the
feature size and returns a module mapping (..., dim) -> (..., dim); a neuron ctor takes
the channel count and returns a multi-step module mapping spike-input currents of shape
(T, B, C, *spatial) to spikes of the same shape. A kind registered with
`deployable=True` also takes `pow2=True` (calibrate a power-of-two input scale); only
those kinds fit the deployable models.

`model_spec(model)` is the JSON a model is rebuilt from (`build_model`); it is
registered with `qnorm.deploy.spec`, so the compiler's cache keys describe these
models without importing this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import brevitas.nn as qnn
import torch
import torch.nn.functional as F
from brevitas.core.function_wrapper.ops_ste import CeilSte
from brevitas.inject.enum import RestrictValueType
from brevitas.quant import (
    Int8ActPerTensorFloatMinMaxInit,
    Int8WeightPerTensorFixedPoint,
    Int8WeightPerTensorFloat,
    Int32Bias,
)
from torch import nn

from qnorm.deploy.spec import register_spec
from qnorm.nn import kinds as layer_kinds
from qnorm.nn.activation import IntGELU, IntSiLU
from qnorm.nn.kinds import NEURON, NORM, Kind
from qnorm.nn.softmax import IntSoftmax

ModuleCtor = Callable[..., nn.Module]


def register_norm(kind: str, ctor: ModuleCtor, *, deployable: bool = False, replace: bool = False) -> None:
    """Make `norm_factory(kind, dim)` return `ctor(dim)` (a norm kind of `qnorm.nn.kinds`).

    `deployable`: `ctor(dim, pow2=True)` builds a layer that calibrates a power-of-two
    input scale, which the deployable models (the mixer) need.
    """
    layer_kinds.register(Kind(kind, NORM, ctor, deployable=deployable), replace=replace)


def norm_factory(kind: str, dim: int, *, pow2: bool = False) -> nn.Module:
    """Create a norm layer over the last dimension of size `dim` (`pow2`: deployable)."""
    return layer_kinds.build(kind, NORM, dim, pow2=pow2)


def norm_kinds(deployable: bool = False) -> list[str]:
    """Registered norm kinds; `deployable`: only those `norm_factory(..., pow2=True)` builds."""
    return layer_kinds.names(NORM, deployable=deployable)


def register_neuron(kind: str, ctor: ModuleCtor, *, deployable: bool = False, replace: bool = False) -> None:
    """Make `neuron_factory(kind, channels)` return `ctor(channels)`; `deployable` as in
    `register_norm`."""
    layer_kinds.register(Kind(kind, NEURON, ctor, deployable=deployable), replace=replace)


def neuron_factory(kind: str, channels: int, *, pow2: bool = False) -> nn.Module:
    """Create a multi-step spiking neuron layer with `channels` channels (dim 2)."""
    return layer_kinds.build(kind, NEURON, channels, pow2=pow2)


def neuron_kinds(deployable: bool = False) -> list[str]:
    """Registered neuron kinds; `deployable`: only those `neuron_factory(..., pow2=True)` builds."""
    return layer_kinds.names(NEURON, deployable=deployable)


class _ATanSpike(torch.autograd.Function):
    """Heaviside step forward (fires at z >= 0); arctan surrogate backward.

    d spike / dz ~= alpha / 2 / (1 + (pi/2 * alpha * z)^2), the derivative of
    atan(pi/2 * alpha * z) / pi + 1/2 (SpikingJelly's `ATan`, alpha = 2 there too).
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(z)
        ctx.alpha = alpha
        return (z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (z,) = ctx.saved_tensors
        alpha = ctx.alpha
        return grad * (alpha / 2) / (1 + (math.pi / 2 * alpha * z) ** 2), None


class MPBNLIF(nn.Module):
    """Multi-step LIF neuron with membrane-potential BatchNorm before the threshold.

    For t = 1..T, per channel (BN statistics over batch and spatial positions):
        h_t = decay * u_{t-1} + x_t        charge (u_0 = 0; decay 0.5 is a shift)
        s_t = [BN(h_t) >= v_threshold]     fire; BN sees the membrane, not the input
        u_t = h_t * (1 - s_t)              hard reset to 0
    BN only enters the firing decision and the reset acts on the un-normalized
    membrane, so at inference BN folds into a per-channel threshold on h_t (the
    integer MPBN neuron in qnorm relies on exactly this). One BN module is shared
    by all steps; in training each step normalizes with its own batch statistics
    and updates the running statistics once. The reset is not detached, so the
    gradient also flows through it. Surrogate: arctan (`_ATanSpike`).
    """

    def __init__(
        self, channels: int, decay: float = 0.5, v_threshold: float = 1.0, alpha: float = 2.0
    ) -> None:
        super().__init__()
        self.channels = channels
        self.decay = decay
        self.v_threshold = v_threshold
        self.alpha = alpha
        # BatchNorm1d over (B, C, L) covers conv (B, C, H, W) and linear (B, C) inputs
        # alike, and it is an ordinary _BatchNorm so SyncBatchNorm conversion sees it.
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.zeros_like(x[0])
        spikes = []
        for x_t in x:
            h = self.decay * u + x_t
            m = self.bn(h.reshape(h.shape[0], h.shape[1], -1)).view_as(h)
            s = _ATanSpike.apply(m - self.v_threshold, self.alpha)
            u = h * (1 - s)
            spikes.append(s)
        return torch.stack(spikes)

    def qnorm_metadata(self) -> dict[str, Any]:
        return {
            "neuron": "float_mpbn_lif",
            "decay": self.decay,
            "v_threshold": self.v_threshold,
            "fire": "bn(h) >= v_threshold",
            "reset": "hard_to_zero",
            "surrogate": "atan",
            "surrogate_alpha": self.alpha,
        }


register_neuron("float_mpbn_lif", MPBNLIF)


def _act_quant(act_range: float) -> qnn.QuantIdentity:
    # Learned per-tensor scale initialized from a fixed range instead of Brevitas'
    # default runtime-statistics init: the latter keeps rank-local statistics
    # buffers for its first 300 steps, which would make DDP replicas diverge.
    return qnn.QuantIdentity(
        act_quant=Int8ActPerTensorFloatMinMaxInit,
        min_val=-act_range,
        max_val=act_range,
        return_quant_tensor=False,
    )


def _linear(in_features: int, out_features: int) -> qnn.QuantLinear:
    return qnn.QuantLinear(
        in_features, out_features, bias=True, weight_quant=Int8WeightPerTensorFloat,
        return_quant_tensor=False,
    )


class Int8ActPerTensorPow2MinMaxInit(Int8ActPerTensorFloatMinMaxInit):
    """`Int8ActPerTensorFloatMinMaxInit` with its learned scale restricted to a power of two.

    Brevitas then learns log2 of the scale and rounds it up (`CeilSte`), as its
    `Int8ActPerTensorFixedPoint` does; the min/max init (not runtime statistics)
    keeps the reason given in `_act_quant`.
    """

    restrict_scaling_type = RestrictValueType.POWER_OF_TWO
    restrict_value_float_to_int_impl = CeilSte


def _pow2_act(act_range: float) -> Any:
    return Int8ActPerTensorPow2MinMaxInit.let(min_val=-act_range, max_val=act_range)


def _pow2_identity(act_range: float) -> qnn.QuantIdentity:
    """An int8 activation quantizer with a learned power-of-two scale."""
    return qnn.QuantIdentity(act_quant=_pow2_act(act_range), return_quant_tensor=False)


def pow2_linear(in_features: int, out_features: int, act_range: float) -> qnn.QuantLinear:
    """An int8 x int8 linear on power-of-two grids with a bias on the accumulator's grid:
    the Brevitas layer ``qnorm compile`` proves exact (also for models of your own).

    The layer quantizes its own input: Int32Bias needs the input scale, which a
    plain float input would not carry.
    """
    return qnn.QuantLinear(
        in_features, out_features, bias=True, input_quant=_pow2_act(act_range),
        weight_quant=Int8WeightPerTensorFixedPoint, bias_quant=Int32Bias, return_quant_tensor=False,
    )  # fmt: skip


MLP_KINDS = ("gelu", "swiglu")


@dataclass(frozen=True)
class TransformerConfig:
    norm: str = "float"
    tokens: int = 8
    token_features: int = 8
    dim: int = 32
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 2
    classes: int = 10
    act_range: float = 4.0
    # Integer attention (IntSoftmax) and MLP (IntGELU / IntSiLU), power-of-two scales
    # everywhere: deployable by `qnorm compile`.  False: float softmax and activation.
    integer: bool = False
    # "gelu": fc1 -> GELU -> fc2; "swiglu": LLaMA's gated MLP, fc2(SiLU(fc1(x)) * fc3(x)).
    mlp: str = "gelu"


class _SelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim {cfg.dim} is not divisible by heads {cfg.heads}")
        self.heads = cfg.heads
        self.qkv = _linear(cfg.dim, 3 * cfg.dim)
        self.context_quant = _act_quant(cfg.act_range)
        self.proj = _linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Softmax attention stays float: it is not one of the ops qnorm makes integer.
        context = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.proj(self.context_quant(context))


class _EncoderBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.dim
        self.norm1 = norm_factory(cfg.norm, cfg.dim)
        self.attn_quant = _act_quant(cfg.act_range)
        self.attn = _SelfAttention(cfg)
        self.norm2 = norm_factory(cfg.norm, cfg.dim)
        self.mlp_quant = _act_quant(cfg.act_range)
        self.fc1 = _linear(cfg.dim, hidden)
        self.hidden_quant = _act_quant(cfg.act_range)
        self.fc2 = _linear(hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_quant(self.norm1(x)))
        hidden = self.hidden_quant(F.gelu(self.fc1(self.mlp_quant(self.norm2(x)))))
        return x + self.fc2(hidden)


class _IntSelfAttention(nn.Module):
    """Multi-head attention whose every step is exact on power-of-two grids.

    q, k, v come from one pow2 linear and are each quantized to int8 on a power-of-two
    grid, so ``q @ kᵀ`` is exact on the grid s_q·s_k (head_dim·127² units, far below
    2^24).  The 1/sqrt(head_dim) factor is the nearest power of two (exact for a
    head_dim that is a power of 4; otherwise the learned query weights absorb the
    difference): a multiplication by a power of two is exact.  IntSoftmax quantizes
    the scores on its calibrated power-of-two grid and returns uint8 probabilities
    on 2^-8, so ``P @ v`` is exact on 2^-8·s_v (tokens·255·127 units).  The output
    projection quantizes the context itself.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim {cfg.dim} is not divisible by heads {cfg.heads}")
        self.heads = cfg.heads
        head_dim = cfg.dim // cfg.heads
        self.score_scale = 2.0 ** -round(math.log2(head_dim) / 2)
        self.qkv = pow2_linear(cfg.dim, 3 * cfg.dim, cfg.act_range)
        self.q_quant, self.k_quant, self.v_quant = (_pow2_identity(cfg.act_range) for _ in range(3))
        self.softmax = IntSoftmax(cfg.tokens, pow2=True)
        self.proj = pow2_linear(cfg.dim, cfg.dim, cfg.act_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = self.q_quant(q), self.k_quant(k), self.v_quant(v)
        probs = self.softmax((q @ k.transpose(-2, -1)) * self.score_scale)
        context = (probs @ v).transpose(1, 2).reshape(b, n, d)
        return self.proj(context)


class _IntMLP(nn.Module):
    """fc1 -> IntGELU -> fc2, or LLaMA's gated fc2(IntSiLU(fc1(x)) * gate(fc3(x))).

    The gate is quantized to int8 on a power-of-two grid so that its product with
    the int8 SiLU output stays exact (127² units); fc2 quantizes its input itself.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.mlp not in MLP_KINDS:
            raise ValueError(f"unknown transformer mlp {cfg.mlp!r}; expected one of {', '.join(MLP_KINDS)}")
        hidden = cfg.mlp_ratio * cfg.dim
        self.fc1 = pow2_linear(cfg.dim, hidden, cfg.act_range)
        self.act = IntGELU(pow2=True) if cfg.mlp == "gelu" else IntSiLU(pow2=True)
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.fc3 = pow2_linear(cfg.dim, hidden, cfg.act_range)
            self.gate_quant = _pow2_identity(cfg.act_range)
        self.fc2 = pow2_linear(hidden, cfg.dim, cfg.act_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc1(x))
        if self.gated:
            hidden = hidden * self.gate_quant(self.fc3(x))
        return self.fc2(hidden)


class _IntEncoderBlock(nn.Module):
    """Pre-norm block of the integer transformer: norms with power-of-two input scales."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm1 = norm_factory(cfg.norm, cfg.dim, pow2=True)
        self.attn = _IntSelfAttention(cfg)
        self.norm2 = norm_factory(cfg.norm, cfg.dim, pow2=True)
        self.mlp = _IntMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DigitsTransformer(nn.Module):
    """Pre-norm transformer over 8 row tokens of 8 pixels.

    The residual stream stays unquantized; activations are int8 fake-quantized right
    before every QuantLinear (model input, each norm output, attention context, MLP
    hidden, pooled features), so each linear is an int8 x int8 product.

    With ``config.integer`` it is integer-deployable end to end like the mixer:
    pow2 linears, norms calibrating power-of-two scales, integer attention
    (`_IntSelfAttention`) and MLP (`_IntMLP`: GELU, or LLaMA's gated SiLU with
    ``mlp="swiglu"``), and a position embedding that is a pow2 linear of the one-hot
    token index (a float parameter added to the stream would lie on no grid).
    Without it, softmax and GELU are float: the float baseline, which `qnorm compile`
    refuses.
    """

    kind = "transformer"
    input_layout = "tokens"

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        if config.integer:
            self._init_integer(config)
            return
        if config.mlp != "gelu":
            raise ValueError(f"the float transformer has a GELU MLP; mlp={config.mlp!r} needs integer=True")
        self.input_quant = _act_quant(config.act_range)
        self.embed = _linear(config.token_features, config.dim)
        self.pos = nn.Parameter(torch.zeros(1, config.tokens, config.dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(_EncoderBlock(config) for _ in range(config.depth))
        self.norm = norm_factory(config.norm, config.dim)
        self.head_quant = _act_quant(config.act_range)
        self.head = _linear(config.dim, config.classes)

    def _init_integer(self, config: TransformerConfig) -> None:
        self.embed = pow2_linear(config.token_features, config.dim, config.act_range)
        # The one-hot token indices the position embedding reads: a constant of the graph.
        self.register_buffer("positions", torch.eye(config.tokens))
        self.pos = pow2_linear(config.tokens, config.dim, 1.0)
        self.blocks = nn.ModuleList(_IntEncoderBlock(config) for _ in range(config.depth))
        self.norm = norm_factory(config.norm, config.dim, pow2=True)
        self.head = pow2_linear(config.dim, config.classes, config.act_range)

    def example_input(self, batch: int = 2) -> torch.Tensor:
        """Zeros shaped like a batch of its input (row tokens)."""
        return torch.zeros(batch, self.config.tokens, self.config.token_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.integer:
            h = self.embed(x) + self.pos(self.positions)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h).mean(dim=1))
        h = self.embed(self.input_quant(x)) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.head_quant(self.norm(h).mean(dim=1)))


@dataclass(frozen=True)
class MixerConfig:
    norm: str = "int_ln"
    tokens: int = 8
    token_features: int = 8
    dim: int = 32
    depth: int = 2
    token_hidden: int = 16
    channel_hidden: int = 64
    classes: int = 10
    act_range: float = 4.0


class _MixerBlock(nn.Module):
    """Pre-norm token MLP and channel MLP, each added to the residual stream."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        self.norm1 = norm_factory(cfg.norm, cfg.dim, pow2=True)
        self.token_fc1 = pow2_linear(cfg.tokens, cfg.token_hidden, cfg.act_range)
        self.token_fc2 = pow2_linear(cfg.token_hidden, cfg.tokens, cfg.act_range)
        self.norm2 = norm_factory(cfg.norm, cfg.dim, pow2=True)
        self.fc1 = pow2_linear(cfg.dim, cfg.channel_hidden, cfg.act_range)
        self.fc2 = pow2_linear(cfg.channel_hidden, cfg.dim, cfg.act_range)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mixed = self.token_fc2(F.relu(self.token_fc1(self.norm1(h).transpose(1, 2))))
        h = h + mixed.transpose(1, 2)
        return h + self.fc2(F.relu(self.fc1(self.norm2(h))))


class DigitsMixer(nn.Module):
    """MLP-mixer over 8 row tokens of 8 pixels, integer-deployable end to end.

    Every linear quantizes its input to int8 on a power-of-two grid and adds an
    Int32Bias; norms calibrate power-of-two input scales and output int8 on 2^-5;
    the only other ops are ReLU, residual additions and a mean over 8 tokens, all
    exact on power-of-two grids. So `qnorm compile` can prove the compiled model
    equal to this one (no softmax, no GELU: those have no exact float form).
    """

    kind = "mixer"
    input_layout = "tokens"

    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = pow2_linear(config.token_features, config.dim, config.act_range)
        self.blocks = nn.ModuleList(_MixerBlock(config) for _ in range(config.depth))
        self.norm = norm_factory(config.norm, config.dim, pow2=True)
        self.head = pow2_linear(config.dim, config.classes, config.act_range)

    def example_input(self, batch: int = 2) -> torch.Tensor:
        """Zeros shaped like a batch of its input (row tokens)."""
        return torch.zeros(batch, self.config.tokens, self.config.token_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


@dataclass(frozen=True)
class SNNConfig:
    neuron: str = "float_mpbn_lif"
    time_steps: int = 4
    channels: tuple[int, ...] = (16, 32)
    image_side: int = 8
    classes: int = 10
    act_range: float = 4.0
    pow2: bool = False  # power-of-two quantizers and a quantized readout bias: deployable


class DigitsSNN(nn.Module):
    """Convolutional SNN: [3x3 conv (no bias) -> spiking neuron] per stage -> readout.

    Direct encoding: the analog image is the input current of the first stage at
    every one of the T steps. Later convs see binary spikes, so they need no
    activation quantizer. The readout is a linear layer on 2x2-average-pooled spike
    rates (spike counts / 4T: an integer grid, again no quantizer needed).

    With `config.pow2` every scale is a power of two (input and readout activations,
    conv and readout weights, the neurons' calibrated input scales) and the readout
    quantizes its input and bias (Int32Bias): the integer-neuron kinds then fold to
    integer thresholds and compile exactly (`qnorm compile`).
    """

    kind = "snn"
    input_layout = "image"

    def __init__(self, config: SNNConfig) -> None:
        super().__init__()
        self.config = config
        pow2 = config.pow2
        self.input_quant = (
            _pow2_identity(config.act_range)
            if pow2 else _act_quant(config.act_range)
        )  # fmt: skip
        weight_quant = Int8WeightPerTensorFixedPoint if pow2 else Int8WeightPerTensorFloat
        self.convs = nn.ModuleList()
        self.neurons = nn.ModuleList()
        in_channels = 1
        for channels in config.channels:
            self.convs.append(
                qnn.QuantConv2d(
                    in_channels, channels, 3, padding=1, bias=False,
                    weight_quant=weight_quant, return_quant_tensor=False,
                )
            )
            self.neurons.append(neuron_factory(config.neuron, channels, pow2=pow2))
            in_channels = channels
        self.pool = nn.AvgPool2d(2)
        features = in_channels * (config.image_side // 2) ** 2
        # Spike rates lie in [0, 1]: the readout's input quantizer covers exactly that.
        self.readout = (
            pow2_linear(features, config.classes, 1.0) if pow2 else _linear(features, config.classes)
        )

    def example_input(self, batch: int = 2) -> torch.Tensor:
        """Zeros shaped like a batch of its input (one-channel images)."""
        return torch.zeros(batch, 1, self.config.image_side, self.config.image_side)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, batch = self.config.time_steps, x.shape[0]
        # The input is the same at every step, so the first conv runs once.
        current = self.convs[0](self.input_quant(x))
        spikes = self.neurons[0](current.unsqueeze(0).expand(steps, *current.shape))
        for conv, neuron in zip(self.convs[1:], self.neurons[1:], strict=True):
            # Convs are stateless: run all T steps as one batch of T*B images.
            spikes = neuron(conv(spikes.flatten(0, 1)).unflatten(0, (steps, batch)))
        return self.readout(self.pool(spikes.mean(dim=0)).flatten(1))


_MODELS: dict[str, tuple[type[nn.Module], type]] = {
    DigitsTransformer.kind: (DigitsTransformer, TransformerConfig),
    DigitsMixer.kind: (DigitsMixer, MixerConfig),
    DigitsSNN.kind: (DigitsSNN, SNNConfig),
}


def register_model(model_cls: type[nn.Module], config_cls: type, *, replace: bool = False) -> None:
    """Make models of ``model_cls`` savable, loadable and compilable like the zoo's.

    The protocol the zoo follows: ``model_cls.kind`` names the family (the checkpoint's
    spec records it), ``model_cls(config)`` builds a model from an instance of the
    dataclass ``config_cls``, the model keeps it as ``model.config``, and
    ``model.example_input(batch)`` returns a batch shaped like its input.  Register in
    the module that defines the class; ``qnorm compile/export CKPT --import MODULE``
    imports it before reading the checkpoint (a checkpoint is data: it never names
    code to run).
    """
    kind = getattr(model_cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{model_cls.__name__} needs a class attribute `kind` (the family's name)")
    if not is_dataclass(config_cls):
        raise ValueError(f"{config_cls.__name__} must be a dataclass (its fields are the checkpoint's spec)")
    if not callable(getattr(model_cls, "example_input", None)):
        raise ValueError(f"{model_cls.__name__} needs an example_input(batch) method (compile traces with it)")
    if kind in _MODELS and not replace and _MODELS[kind] != (model_cls, config_cls):
        raise ValueError(f"model kind {kind!r} is already registered ({_MODELS[kind][0].__name__})")
    _MODELS[kind] = (model_cls, config_cls)


def build_model(kind: str, **config: Any) -> nn.Module:
    """Build a registered model ("transformer", "mixer", "snn" or one of ``register_model``)
    from config fields (see the *Config dataclasses)."""
    if kind not in _MODELS:
        raise ValueError(
            f"unknown model kind {kind!r}; expected one of {sorted(_MODELS)} (a model of your own: "
            "register it with qnorm.train.models.register_model in a module, and name that module "
            "with --import MODULE)"
        )
    model_cls, config_cls = _MODELS[kind]
    names = {f.name for f in fields(config_cls)}
    unknown = sorted(set(config) - names)
    if unknown:
        raise ValueError(
            f"unknown {kind} config fields {unknown}; expected a subset of {sorted(names)}"
        )
    # JSON has no tuples: accept lists so a config read back from a checkpoint works.
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    return model_cls(config_cls(**values))


def model_spec(model: nn.Module) -> dict[str, Any]:
    """JSON-ready {"kind", "config"} from which `build_model` rebuilds `model`."""
    spec = _zoo_spec(model)
    if spec is None:
        raise TypeError(
            f"{type(model).__name__} is not a registered model: register its class with "
            "qnorm.train.models.register_model to save it"
        )
    return spec


def _zoo_spec(model: nn.Module) -> dict[str, Any] | None:
    if not isinstance(model, tuple(cls for cls, _ in _MODELS.values())):
        return None
    return {"kind": model.kind, "config": asdict(model.config)}


register_spec(_zoo_spec)
