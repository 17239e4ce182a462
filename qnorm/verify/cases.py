"""The op × config catalogue that ``qnorm verify`` checks on every backend.

A :class:`Case` is a name, a golden op family and a JSON-ready ``config``; it
builds its golden op deterministically: float parameters drawn from a generator
seeded by the case name (so adding a case changes no other case), then the op's
own ``from_float``.  The config is what the golden store records next to the
vectors, so a changed catalogue entry is detected rather than silently compared
against vectors of a different op.

Float parameters are float32 values (held in float64): the QAT layers keep their
parameters and running statistics in float32 buffers, and only float32-exact
parameters let a layer's ``golden()`` be the very op of the case.

Coverage: every op family; int4, int8 and int16 inputs; N = 1, small
non-powers of two, 64 and 768; partial RMSNorm; 1- and 2-term shift norms;
non-default tie rules; γ < 0 and γ = 0 channels; hard/soft reset, leak, ``>=``
and ``>`` for the spiking neurons; int8 (table) and int16 (segments) GELU and
SiLU with power-of-two and dyadic scales; softmax over int8 and int16 logits with
uint8 / int16 probabilities, causal and padding masks.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qnorm.errors import UsageError
from qnorm.fixedpoint import Dyadic
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops.activation import IntGELU, IntSiLU
from qnorm.ops.base import IntOp
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold
from qnorm.ops.softmax import IntSoftmax
from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig, MPBNNeuron
from qnorm.qformat import QFormat

# Input layouts: a row normalization reads rows of N (last axis); a BN op maps every
# element of a (rows, C) array by its channel's parameters; a neuron runs a
# (T, B, C) current train, time first.
ROWS, CHANNELS, TIME = "rows", "channels", "time"


@dataclass(frozen=True)
class Case:
    """One named op configuration; ``config`` holds everything :meth:`build` reads."""

    name: str
    op: str  # the golden op's ``name``: the family
    config: Mapping[str, Any] = field(hash=False)

    @property
    def layout(self) -> str:
        return _FAMILIES[self.op].layout

    @property
    def in_fmt(self) -> QFormat:
        return fmt_from(self.config["in"])

    @property
    def width(self) -> int:
        """Elements per vector: N for a norm, C for a BN op, T for a neuron (its time series)."""
        cfg = self.config
        return cfg["steps"] if self.layout == TIME else cfg["n"] if self.layout == ROWS else cfg["channels"]

    def derived(self, name: str, **change: Any) -> Case:
        """This case under another name with some config entries changed (a wider row,
        more channels): the name seeds its parameters, so the same name gives the same op."""
        return Case(name, self.op, {**self.config, **change})

    @property
    def seed(self) -> int:
        """A stable per-case seed (crc32 is the same on every platform and Python run)."""
        return zlib.crc32(self.name.encode())

    def build(self) -> IntOp:
        return _FAMILIES[self.op].build(self.config, np.random.default_rng(self.seed))

    @property
    def definition(self) -> int:
        """The version of the integer definition this case's op computes."""
        return _FAMILIES[self.op].op.definition

    def summary(self) -> str:
        """The config on one line: formats as ``int8/0.05`` (bits and scale), the rest ``key=value``."""
        return " ".join(f"{key}={_summary_value(value)}" for key, value in self.config.items())


def _summary_value(value: Any) -> str:
    if isinstance(value, Mapping):  # a format spec
        return f"{'int' if value['signed'] else 'uint'}{value['bits']}/{value['scale']:g}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- formats


def fmt(bits: int, scale: float, signed: bool = True) -> dict[str, Any]:
    return {"bits": bits, "scale": scale, "signed": signed}


def fmt_from(spec: Mapping[str, Any]) -> QFormat:
    return QFormat(spec["bits"], spec["scale"], spec["signed"])


INT4 = fmt(4, 0.25)
INT8 = fmt(8, 0.05)
INT16 = fmt(16, 0.0005)
NORM_OUT = fmt(8, 2.0**-5)  # int8 over [-4, 4): normalized values with gamma ~ 1
RELU4 = fmt(4, 0.25, signed=False)  # a 16-level quantized ReLU on [0, 3.75]
SIGNED8 = fmt(8, 2.0**-5)
SIGNED3 = fmt(3, 0.5)  # 8 levels: a short multi-threshold with negative levels
PROB8 = fmt(8, 2.0**-8, signed=False)  # probabilities in [0, 255/256]
PROB16 = fmt(16, 2.0**-15)  # int16 probabilities in [0, 1)


# --------------------------------------------------------------------------- float parameters


def f32(a: np.ndarray) -> np.ndarray:
    """Round to float32 and widen back: exactly what a float32 parameter buffer holds."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def gains(rng: np.random.Generator, n: int, spread: float) -> np.ndarray:
    """γ ~ N(1, spread), with a negative channel and a zero channel where there is room."""
    g = rng.normal(1.0, spread, n)
    if n >= 2:
        g[0] = -abs(g[0])
    if n >= 3:
        g[1] = 0.0
    return f32(g)


def _bn_params(cfg: Mapping[str, Any], rng: np.random.Generator, beta_mean: float) -> dict[str, Any]:
    """BN statistics spread over the input's real range (mean within ±1/4 of it)."""
    c, span = cfg["channels"], fmt_from(cfg["in"]).hi * cfg["in"]["scale"]
    gamma = gains(rng, c, 0.5)
    if c == 1 and cfg.get("negative_gamma"):
        gamma = -np.abs(gamma)
    return {
        "gamma": gamma,
        "beta": f32(rng.normal(beta_mean, 0.5, c)),
        "mean": f32(rng.normal(0.0, span / 4, c)),
        "var": f32(rng.uniform((span / 8) ** 2, (span / 2) ** 2, c)),
        "eps": 1e-5,
    }


# --------------------------------------------------------------------------- builders


def _build_norm(
    cls: Any, extra: tuple[str, ...], has_beta: bool = True
) -> Callable[[Mapping[str, Any], np.random.Generator], IntOp]:
    """``has_beta`` False: RMSNorm, which (like nn.RMSNorm and qnorm.nn.IntRMSNorm) has no β."""

    def build(cfg: Mapping[str, Any], rng: np.random.Generator) -> IntOp:
        n = cfg["n"]
        gamma = gains(rng, n, 0.3)
        beta = f32(rng.normal(0.0, 0.2, n)) if has_beta else None
        kwargs = {k: cfg[k] for k in extra if k in cfg}
        return cls.from_float(
            gamma, beta, cfg["eps"], fmt_from(cfg["in"]), fmt_from(cfg["out"]), rounding=cfg["rounding"], **kwargs
        )

    return build


def _build_bn(cls: Any) -> Callable[[Mapping[str, Any], np.random.Generator], IntOp]:
    def build(cfg: Mapping[str, Any], rng: np.random.Generator) -> IntOp:
        out = fmt_from(cfg["out"])
        # centre beta in the activation's range so every level is reached
        p = _bn_params(cfg, rng, beta_mean=(out.lo + out.hi) / 2 * out.scale)
        return cls.from_float(**p, cfg=BNActConfig(fmt_from(cfg["in"]), out, cfg["rounding"]))

    return build


def _build_lif(cls: Any) -> Callable[[Mapping[str, Any], np.random.Generator], IntOp]:
    def build(cfg: Mapping[str, Any], rng: np.random.Generator) -> IntOp:
        leak = None if cfg["leak"] is None else Dyadic.from_float(cfg["leak"], 16)
        lif = LIFConfig(
            fmt_from(cfg["in"]),
            membrane_bits=cfg["membrane_bits"],
            leak=leak,
            reset=cfg["reset"],
            comparator=cfg["comparator"],
            saturate=cfg["saturate"],
        )
        return cls.from_float(**_bn_params(cfg, rng, beta_mean=0.0), v_th=cfg["v_th"], cfg=lif)

    return build


def _build_activation(cls: Any) -> Callable[[Mapping[str, Any], np.random.Generator], IntOp]:
    """An activation has no parameters: its formats and rounding are the whole op."""

    def build(cfg: Mapping[str, Any], rng: np.random.Generator) -> IntOp:
        return cls.of(fmt_from(cfg["in"]), fmt_from(cfg["out"]), cfg["rounding"])

    return build
def _build_softmax(cfg: Mapping[str, Any], rng: np.random.Generator) -> IntOp:
    """No float parameters: the config is the op (masks included)."""
    options = {k: cfg[k] for k in ("causal", "causal_offset", "query_len", "padding") if k in cfg}
    return IntSoftmax.build(cfg["n"], fmt_from(cfg["in"]), fmt_from(cfg["out"]), rounding=cfg["rounding"], **options)


@dataclass(frozen=True)
class Family:
    layout: str
    build: Callable[[Mapping[str, Any], np.random.Generator], IntOp]
    op: type[IntOp]


_FAMILIES: dict[str, Family] = {
    IntLayerNorm.name: Family(ROWS, _build_norm(IntLayerNorm, ()), IntLayerNorm),
    L1LayerNorm.name: Family(ROWS, _build_norm(L1LayerNorm, ()), L1LayerNorm),
    ShiftLayerNorm.name: Family(ROWS, _build_norm(ShiftLayerNorm, ("mantissa_terms",)), ShiftLayerNorm),
    IntRMSNorm.name: Family(ROWS, _build_norm(IntRMSNorm, ("partial",), has_beta=False), IntRMSNorm),
    BNQuant.name: Family(CHANNELS, _build_bn(BNQuant), BNQuant),
    MultiThreshold.name: Family(CHANNELS, _build_bn(MultiThreshold), MultiThreshold),
    MPBNNeuron.name: Family(TIME, _build_lif(MPBNNeuron), MPBNNeuron),
    FoldedLIFNeuron.name: Family(TIME, _build_lif(FoldedLIFNeuron), FoldedLIFNeuron),
    IntGELU.name: Family(CHANNELS, _build_activation(IntGELU), IntGELU),
    IntSiLU.name: Family(CHANNELS, _build_activation(IntSiLU), IntSiLU),
    IntSoftmax.name: Family(ROWS, _build_softmax, IntSoftmax),
}


# --------------------------------------------------------------------------- the catalogue


def _norm(op: str, in_name: str, n: int, rounding: str = "half_up", **extra: Any) -> Case:
    in_spec = {"int4": INT4, "int8": INT8, "int16": INT16}[in_name]
    tags = [f"{k[0]}{_tag(v)}" for k, v in extra.items()] + ([rounding] if rounding != "half_up" else [])
    name = ".".join([op, in_name, f"n{n}", *tags])
    return Case(name, op, {"in": in_spec, "out": NORM_OUT, "n": n, "eps": 1e-5, "rounding": rounding, **extra})


def _tag(v: Any) -> str:
    """A value for a case name without dots: 0.25 -> ``025``, 2 -> ``2``."""
    return f"{v:g}".replace(".", "")


def _bn(op: str, in_name: str, out_name: str, channels: int, rounding: str = "half_up", **extra: Any) -> Case:
    in_spec = {"int4": fmt(4, 0.5), "int8": INT8}[in_name]
    out_spec = {"relu4": RELU4, "s8": SIGNED8, "s3": SIGNED3}[out_name]
    tags = [k for k, v in extra.items() if v] + ([rounding] if rounding != "half_up" else [])
    name = ".".join([op, in_name, f"c{channels}", out_name, *tags])
    return Case(name, op, {"in": in_spec, "out": out_spec, "channels": channels, "rounding": rounding, **extra})


def _lif(op: str, in_name: str, channels: int, reset: str, comparator: str, leak: float | None) -> Case:
    in_spec = {"int4": fmt(4, 0.25), "int8": fmt(8, 0.02)}[in_name]
    tags = [reset, "ge" if comparator == ">=" else "gt", "noleak" if leak is None else f"leak{_tag(leak)}"]
    name = ".".join([op, in_name, f"c{channels}", *tags])
    cfg = {
        "in": in_spec,
        "channels": channels,
        "steps": 16,
        "reset": reset,
        "comparator": comparator,
        "leak": leak,
        "membrane_bits": 16,
        "saturate": True,
        "v_th": 1.0,
    }
    return Case(name, op, cfg)


# Activation formats: power-of-two scales (shift-only requantization around them) and
# dyadic ones (any float scale; 0.05 and 3/128 are not powers of two).
ACT_FORMATS = {
    "s8": fmt(8, 2.0**-4),  # int8 over [-8, 8)
    "s16": fmt(16, 2.0**-11),  # int16 over [-16, 16)
    "d8": INT8,
    "d8out": fmt(8, 3 / 128),
    "d16": INT16,
    "d16out": fmt(16, 0.0007),
}
ACTIVATION_ROW = 16  # elements per vector: the activation kernels' row (compilers.tvm.kernels.activation)


def _activation(op: str, in_name: str, out_name: str, rounding: str = "half_up") -> Case:
    name = ".".join([op, in_name, out_name, *([rounding] if rounding != "half_up" else [])])
    cfg = {"in": ACT_FORMATS[in_name], "out": ACT_FORMATS[out_name], "channels": ACTIVATION_ROW, "rounding": rounding}
    return Case(name, op, cfg)
def _softmax(in_name: str, scale: float, n: int, out: dict[str, Any], **masks: Any) -> Case:
    """A softmax over rows of n logits; masks: ``causal`` (a T = n square score matrix) or ``padding``."""
    bits = {"int8": 8, "int16": 16}[in_name]
    tags = [k for k, v in masks.items() if v is True]
    name = ".".join([IntSoftmax.name, in_name, f"n{n}", *tags])
    return Case(name, IntSoftmax.name, {"in": fmt(bits, scale), "out": out, "n": n, "rounding": "half_up", **masks})


def _catalogue() -> tuple[Case, ...]:
    ln, l1, sh, rms = IntLayerNorm.name, L1LayerNorm.name, ShiftLayerNorm.name, IntRMSNorm.name
    cases = [
        _norm(ln, "int8", 64),
        _norm(ln, "int8", 768),
        _norm(ln, "int8", 1),
        _norm(ln, "int8", 7, "half_even"),
        _norm(ln, "int4", 64),
        _norm(ln, "int4", 4),  # 16^4 rows: exhaustive
        _norm(ln, "int16", 48),
        _norm(ln, "int8", 2048),  # Σx leaves 18 bits: S² in two products (qnorm.ops.layernorm.square_of_sum)
        _norm(l1, "int8", 64),
        _norm(l1, "int8", 768),  # rows long enough for the x86 kernels' vpsadbw sums (compilers.tvm.x86_rowsums)
        _norm(l1, "int8", 1),
        _norm(l1, "int4", 7, "trunc"),
        _norm(sh, "int8", 64, mantissa_terms=1),
        _norm(sh, "int8", 64, mantissa_terms=2),
        _norm(sh, "int8", 1, mantissa_terms=2),
        _norm(sh, "int4", 7, "half_away", mantissa_terms=2),
        _norm(rms, "int8", 64),
        _norm(rms, "int8", 64, partial=0.25),
        _norm(rms, "int8", 1),
        _norm(rms, "int8", 2, "half_even"),  # 256^2 rows: exhaustive
        _norm(rms, "int4", 7, "floor", partial=0.5),
    ]
    for op in (BNQuant.name, MultiThreshold.name):
        cases += [
            _bn(op, "int8", "relu4", 16),
            _bn(op, "int4", "relu4", 16, "half_even"),
            _bn(op, "int8", "s3", 16, "floor"),
            _bn(op, "int8", "relu4", 1, negative_gamma=True),
        ]
    cases.append(_bn(BNQuant.name, "int8", "s8", 16, "half_away"))  # 256 levels: BNQuant only
    for op in (MPBNNeuron.name, FoldedLIFNeuron.name):
        cases += [
            _lif(op, "int8", 16, "hard", ">=", 0.875),
            _lif(op, "int8", 16, "soft", ">", None),
            _lif(op, "int4", 8, "soft", ">=", 0.5),
        ]
    for op in (IntGELU.name, IntSiLU.name):
        cases += [_activation(op, "s8", "s8"), _activation(op, "s16", "s16")]
    cases += [
        _activation(IntGELU.name, "d8", "d8out", "half_even"),
        _activation(IntSiLU.name, "d16", "d16out", "floor"),
    ]
    cases += [
        _softmax("int8", 0.05, 64, PROB8),  # a dyadic logit scale
        _softmax("int8", 2.0**-4, 197, PROB8),  # ViT-B/16: 196 patches + class token
        _softmax("int16", 2.0**-10, 64, PROB16),
        _softmax("int8", 2.0**-3, 16, PROB8, causal=True),
        _softmax("int8", 0.1, 32, PROB8, padding=True),  # x == -128 is a padded key
    ]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise RuntimeError(f"duplicate case names in the catalogue: {sorted(n for n in names if names.count(n) > 1)}")
    return tuple(cases)


CASES: tuple[Case, ...] = _catalogue()


def case_named(name: str) -> Case:
    for case in CASES:
        if case.name == name:
            return case
    raise UsageError(f"unknown case {name!r} (qnorm verify --list shows the {len(CASES)} cases)")


def matching(pattern: str) -> list[Case]:
    """The cases whose name matches the glob ``pattern``; a pattern matching none is a
    :class:`UsageError` (a mistyped glob must not shrink a run silently)."""
    chosen = [c for c in CASES if fnmatch.fnmatchcase(c.name, pattern)]
    if not chosen:
        raise UsageError(f"no case matches {pattern!r} (qnorm verify --list shows the {len(CASES)} cases)")
    return chosen


def select_cases(patterns: list[str] | None) -> list[Case]:
    """Cases whose name matches any glob pattern, in catalogue order (all when
    ``patterns`` is empty); every pattern must match a case."""
    if not patterns:
        return list(CASES)
    chosen = {c.name for p in patterns for c in matching(p)}
    return [c for c in CASES if c.name in chosen]


__all__ = ["CASES", "CHANNELS", "ROWS", "TIME", "Case", "case_named", "matching", "select_cases"]
