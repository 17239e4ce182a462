"""The backends ``qnorm verify`` compares with the golden model, in a registry keyed by name.

A :class:`Backend` says whether it can run on this machine (``unavailable()``:
None, or the reason it cannot) and, per op, returns a :class:`Runner` mapping
op-layout integer inputs to integer outputs, or raises :class:`Unsupported`
(this op has no implementation on the backend yet: a SKIP with the reason,
never a silent pass), :class:`Refused` (the target's declared widths cannot run
the op exactly: ``refused`` with the reason) or :class:`NotRun` (built for
hardware this machine does not have: ``compiled``).  Anything else a backend raises is a failure.

Built in:

* ``golden`` — the numpy golden model itself (``op.forward``).  It computes the
  expected outputs of every other column, so its own column checks the stored
  golden vectors only: the regression check of qnorm/data/golden.
* ``qat`` — the PyTorch QAT path: the :mod:`qnorm.nn` layer of the op's family
  (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm, BNQuantAct and its fold
  MultiThresholdAct, MPBNLIF and its fold FoldedMPBNLIF), built from the op's
  float parameters and options in eval mode.  Its ``golden()`` must equal the
  op's integer config and constants (else FAIL: the layer's derivation drifted),
  and its float32 forward on the dequantized input must be exactly an integer
  times the output scale; those integers are compared.  Where the layer cannot
  hold the op (a β on RMSNorm, per-neuron parameters, ...) the op's own
  ``_forward`` runs on torch int64 tensors, which is what every layer computes.
* ``x86_64`` — the TVM CPU kernels of :mod:`compilers.tvm.kernels`
  (``kernel_for(op).build(target)``), imported lazily.

Target names come from ``qnorm.targets.known_targets()``; a target without a
registered backend shows as SKIP ("backend not implemented").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qnorm import nn as qnn
from qnorm.analysis import TargetLimitError, check_target
from qnorm.extras import missing
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops._normcore import NormOp
from qnorm.ops.base import IntOp
from qnorm.ops.multithreshold import BNQuant, MultiThreshold
from qnorm.ops.spiking import FoldedLIFNeuron, MPBNNeuron
from qnorm.targets import Target, load_target

NOT_IMPLEMENTED = "backend not implemented"
LAYER_DTYPE = torch.float32  # the QAT layers' parameter dtype, so the dtype they are fed in training


class Unsupported(Exception):
    """The backend has no implementation for this op (reported as SKIP with the reason)."""


class NotRun(Exception):
    """The backend built the op's kernel but cannot run it here (its cell: ``compiled``, with the reason)."""


class Refused(Exception):
    """The target's declared widths cannot run this op exactly (reported as ``refused``
    with the reason: refusing is the contract, so neither a pass nor a FAIL)."""


def refuse_beyond_limits(op: IntOp, target: Target) -> None:
    """Raise :class:`Refused` if ``target``'s accumulator or multiplier widths cannot
    run ``op`` exactly (:func:`qnorm.analysis.check_target`); every compiled backend
    calls it before building."""
    try:
        check_target(op, target)
    except TargetLimitError as err:
        raise Refused(str(err)) from None


class BackendError(Exception):
    """A backend ran but broke its contract (reported as FAIL with the message)."""


@dataclass(frozen=True, eq=False)
class Runner:
    """Integer inputs (op layout) to integer outputs; ``via`` says how (for the report)."""

    run: Callable[[np.ndarray], np.ndarray]
    via: str


def _available() -> str | None:
    return None


@dataclass(frozen=True, eq=False)
class Backend:
    name: str
    description: str
    prepare: Callable[[IntOp], Runner]
    unavailable: Callable[[], str | None] = _available
    stream: bool = True  # False: only the stored golden vectors (the reference itself)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    del _REGISTRY[name]


def get(name: str) -> Backend | None:
    return _REGISTRY.get(name)


def registered() -> list[str]:
    return list(_REGISTRY)


# --------------------------------------------------------------------------- golden


register(
    Backend(
        "golden",
        "numpy golden model (qnorm.ops): the reference; checks the stored golden vectors",
        lambda op: Runner(op.forward, "numpy golden model"),
        stream=False,
    )
)


# --------------------------------------------------------------------------- qat


class _NoLayer(Exception):
    """The qnorm.nn layer of the family cannot hold this op (the QAT path is then the op body)."""


def _layer_output_ints(y: torch.Tensor, scale: float) -> np.ndarray:
    """The integers a QAT output stands for; it must be exactly ``ints * scale``."""
    ints = torch.round(y / scale)
    if not torch.equal(ints * scale, y):
        bad = torch.nonzero(ints * scale != y)[0].tolist()
        raise BackendError(f"layer output {float(y[tuple(bad)])!r} at {bad} is not an integer multiple of {scale!r}")
    return ints.to(torch.int64).numpy()


def _integer_fields(op: IntOp) -> dict[str, Any]:
    """What defines an op's integer behaviour: the config and integer constants golden() must match."""
    if isinstance(op, NormOp):
        return {"config": op.config}
    if isinstance(op, (BNQuant, MultiThreshold)):
        bn, fields = op.bn, {"cfg": op.cfg}
    else:
        bn, fields = op.params.bn, {"cfg": op.cfg, "v_th_q": op.params.v_th_q, "reset_sub": op.params.reset_sub}
    for name in ("gamma_m", "gamma_shift", "mean_q", "std_q", "frac_bits", "beta_q", "out_frac_bits"):
        fields[name] = getattr(bn, name)
    if isinstance(op, MultiThreshold):
        fields.update(thresholds=op.thresholds, negative=op.negative)
    return fields


def _first_difference(a: IntOp, b: IntOp) -> str | None:
    fa, fb = _integer_fields(a), _integer_fields(b)
    for name, va in fa.items():
        vb = fb[name]
        same = np.array_equal(va, vb) if isinstance(va, np.ndarray) else va == vb
        if not same:
            return name
    return None


def _uniform(values: np.ndarray, what: str) -> float:
    flat = np.unique(np.asarray(values, dtype=np.float64))
    if flat.size != 1:
        raise _NoLayer(f"per-channel {what} (the layer has one)")
    return float(flat[0])


def _per_channel(shape: tuple[int, ...]) -> int:
    if len(shape) != 1:
        raise _NoLayer(f"parameter shape {shape} (the layer is per channel)")
    return shape[0]


def _norm_layer(op: NormOp) -> torch.nn.Module:
    """The qnorm.nn norm layer of the op's class with its γ, β, ε, formats and options."""
    cfg, p = op.config, op.params
    cls = _NORM_LAYERS[type(op)]
    options: dict[str, Any] = {"partial": cfg.partial} if isinstance(op, IntRMSNorm) else {}
    if isinstance(op, IntRMSNorm):
        if np.any(p.beta != 0):
            raise _NoLayer("the op has a nonzero β, the layer has none")
    else:
        options["bias"] = True
    if isinstance(op, ShiftLayerNorm):
        options["mantissa_terms"] = cfg.mantissa_terms
    layer = cls(cfg.n, p.eps, out_fmt=op.out_fmt, in_fmt=op.in_fmt, rounding=cfg.rounding, **options)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(p.gamma))
        if layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(p.beta))
    return layer.eval()


def _bn_layer(op: BNQuant | MultiThreshold) -> torch.nn.Module:
    """BNQuantAct holding the op's float BN parameters (eval mode: running statistics)."""
    ref, bn = op.reference, op.bn
    layer = qnn.BNQuantAct(
        _per_channel(bn.shape), op.out_fmt, in_fmt=op.in_fmt, rounding=op.cfg.mode, eps=_uniform(ref.eps, "eps"),
        frac_bits=bn.frac_bits, out_frac_bits=bn.out_frac_bits,
    )  # fmt: skip
    _load_bn_state(layer, ref)
    return layer.eval()


def _lif_layer(op: MPBNNeuron | FoldedLIFNeuron) -> torch.nn.Module:
    """MPBNLIF holding the op's float parameters and dynamics (eval mode)."""
    ref, bn, cfg = op.reference, op.params.bn, op.cfg
    layer = qnn.MPBNLIF(
        _per_channel(bn.shape), v_th=_uniform(ref.v_th, "v_th"), leak=cfg.leak, reset=cfg.reset,
        comparator=cfg.comparator, u_rest=cfg.u_rest, membrane_bits=cfg.membrane_bits, saturate=cfg.saturate,
        max_steps=cfg.max_steps, in_fmt=cfg.in_fmt, eps=_uniform(ref.bn.eps, "eps"), frac_bits=bn.frac_bits,
        out_frac_bits=bn.out_frac_bits,
    )  # fmt: skip
    _load_bn_state(layer, ref.bn)
    return layer.eval()


def _load_bn_state(layer: torch.nn.Module, ref: Any) -> None:
    """Float BN parameters into the layer's float32 parameters and buffers."""
    with torch.no_grad():
        for dst, src in ((layer.weight, ref.gamma), (layer.bias, ref.beta)):
            dst.copy_(torch.from_numpy(src))
        layer.running_mean.copy_(torch.from_numpy(ref.mean))
        layer.running_var.copy_(torch.from_numpy(ref.var))


_NORM_LAYERS: dict[type, type] = {
    IntLayerNorm: qnn.IntLayerNorm,
    L1LayerNorm: qnn.L1LayerNorm,
    ShiftLayerNorm: qnn.ShiftLayerNorm,
    IntRMSNorm: qnn.IntRMSNorm,
}

# Golden op class -> (layer description, module factory) for families with a qnorm.nn layer.
_LAYERS: dict[type, tuple[str, Callable[[Any], torch.nn.Module]]] = {
    **{op_cls: (f"qnorm.nn.{layer.__name__}", _norm_layer) for op_cls, layer in _NORM_LAYERS.items()},
    BNQuant: ("qnorm.nn.BNQuantAct", _bn_layer),
    MultiThreshold: ("qnorm.nn.BNQuantAct(...).fold() = MultiThresholdAct", lambda op: _bn_layer(op).fold()),
    MPBNNeuron: ("qnorm.nn.MPBNLIF", _lif_layer),
    FoldedLIFNeuron: ("qnorm.nn.MPBNLIF(...).fold() = FoldedMPBNLIF", lambda op: _lif_layer(op).fold()),
}


def _op_body_runner(op: IntOp, why: str) -> Runner:
    """The golden op's own ``_forward`` on torch int64: what every QAT layer computes."""
    return Runner(
        lambda x: op._forward(torch.from_numpy(op.in_fmt.check(x)), None).numpy(),
        f"golden op body on torch int64 ({why})",
    )


def _qat_prepare(op: IntOp) -> Runner:
    found = _LAYERS.get(type(op))
    if found is None:
        return _op_body_runner(op, "no qnorm.nn layer for this family")
    desc, factory = found
    try:
        module = factory(op)
    except _NoLayer as why:
        return _op_body_runner(op, f"{desc} cannot hold this op: {why}")
    diff = _first_difference(module.golden(), op)
    if diff is not None:
        raise BackendError(f"{desc}.golden() differs from the case's op in {diff!r}")

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            y = module(torch.from_numpy(op.in_fmt.dequantize(x)).to(LAYER_DTYPE))
        return _layer_output_ints(y, op.out_fmt.scale)

    return Runner(run, f"{desc}, eval mode, float32 input")


register(Backend("qat", "PyTorch QAT path (qnorm.nn layers, or the op body on torch int64)", _qat_prepare))


# --------------------------------------------------------------------------- x86_64 (TVM)

_KERNELS = "compilers.tvm.kernels"


def _x86_unavailable() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"host is {platform.machine()}, not x86-64"
    if (reason := missing("tvm")) is not None:
        return reason
    try:
        present = importlib.util.find_spec(_KERNELS) is not None
    except ModuleNotFoundError:  # a parent package is missing
        present = False
    if not present:
        return f"unavailable: {_KERNELS} not present"
    if not hasattr(importlib.import_module(_KERNELS), "kernel_for"):
        return f"unavailable: {_KERNELS} has no kernel_for"
    return None


@functools.cache
def column_target(name: str) -> Target:
    """The target description of a column, loaded once per process (every backend's
    prepare and availability check reads it)."""
    return load_target(name)


def _x86_prepare(op: IntOp) -> Runner:
    kernels = importlib.import_module(_KERNELS)
    target = column_target("x86_64")
    refuse_beyond_limits(op, target)
    try:
        kernel = kernels.kernel_for(op)
    except NotImplementedError as err:
        raise Unsupported(str(err) or f"no kernel for {type(op).__name__}") from None
    compiled = kernel.build(target)
    return Runner(compiled, f"TVM llvm kernel, -mcpu={target.tvm_spec().get('mcpu')}")


register(Backend("x86_64", "TVM llvm kernels (compilers.tvm.kernels), run natively", _x86_prepare, _x86_unavailable))
import qnorm.verify.backend_cross  # noqa: E402,F401  (registers aarch64, riscv64)
import qnorm.verify.backend_hls  # noqa: E402,F401  (registers fpga-hls)
import qnorm.verify.backend_gpu  # noqa: E402,F401  (registers cuda, opencl)
