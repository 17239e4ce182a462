"""Shared machinery of the qnorm QAT layers: exact integer forward, surrogate backward.

Every layer in :mod:`qnorm.nn` follows one recipe; each step has its module, and this
one gathers their names (the layers and the other packages import from here):

* :mod:`qnorm.nn.quantizer` — step 1, the input side;
* :mod:`qnorm.nn.base` — steps 2 and 3: the module bases (:class:`IntModule`,
  :class:`QATModule`, :class:`IntInference`), the golden op's derivation inputs and
  metadata;
* :mod:`qnorm.nn.surrogate` — steps 4 and 5: exact forward, surrogate backward, output;
* :mod:`qnorm.nn.batchnorm` — exact integer batch statistics and :class:`BNQATModule`;
* :mod:`qnorm.nn.sync` — the torch.distributed all-reduces.

The recipe:

1. **Input -> integers.**  :class:`InputQuantizer` turns a float tensor (quantized with a
   fixed :class:`~qnorm.qformat.QFormat`, or with a per-tensor scale calibrated from a
   running max-abs in training and frozen in eval) or a Brevitas ``IntQuantTensor``
   (Brevitas' own integers ``qt.int()`` and per-tensor ``qt.scale``) into a
   :class:`QuantizedInput`: int64 integers, their format, and the dequantized value.
2. **Golden op** for the current float parameters, re-derived deterministically in every
   forward with the op's own derivation (``layer.golden()`` returns it).
3. **Exact forward**: the golden op's own ``_forward`` body, run on torch int64 tensors
   (:mod:`qnorm.fixedpoint` and :mod:`qnorm.ops._xp` run unchanged on them), so the
   result equals ``golden_op.forward(x_int)`` by construction, not by a second
   implementation.  The norm layers run the op's own per-row stages on numpy and a
   fused int32 element chain instead (:mod:`qnorm.nn.elementchain`, tested equal), or,
   with the ``fast`` extra, both as one compiled loop (:mod:`qnorm.nn.jitchain`, a
   second writing of those stages, tested equal), and in a training step derive the
   op's per-channel integers in a compiled loop too (:mod:`qnorm.nn.jitderive`).
   The float output is ``ints.to(dtype) * out_scale`` in the input's float dtype:
   exactly what the golden integers mean.
4. **Backward**: :func:`exact_forward` wraps (3) in a custom autograd Function whose
   backward is the vector-Jacobian product of the layer's differentiable float
   *surrogate*, evaluated at the dequantized input with the float parameters; the
   input quantizer contributes a straight-through estimator that is zero where it
   clipped.  (``y_float + (y_q - y_float).detach()`` is avoided on purpose: that sum
   is rounded in float arithmetic and is not bit-identical to ``y_q``.)  The norm
   layers build the same surrogate in the forward's graph and swap its value for the
   exact one (:func:`exact_forward_in_graph`: the same gradients, one autograd pass;
   :func:`surrogate_in_graph` where the exact values are already formed); the L1 and
   RMS norms' VJPs come from compiled loops on the CPU (:mod:`qnorm.nn.jitsurrogate`,
   the same gradients up to float rounding).
5. **Output**: a float tensor, or an ``IntQuantTensor`` (zero point 0) with
   ``return_quant_tensor=True``, so a layer sits between Brevitas layers without glue.

**Data-parallel training.**  With ``torch.distributed`` initialized, a training
forward reduces what it learns from the batch over the ranks: the calibrating
quantizer's batch max |x| (all-reduce max), and the BN layers' exact integer sums
``S``, ``sum x^2`` and the count (all-reduce sum, :func:`batch_stats`), whose float
surrogate then normalizes over the ranks too (:func:`synced_batch_norm`).  So every
replica computes the statistics of the global batch, bit for bit those of one
process on the concatenated batch, and the buffers never diverge.

**Why int64 and not float.**  Float arithmetic is exact only while every intermediate
(products, BN numerators, membrane potentials, ...) stays below 2^24 in magnitude
(float32) or 2^53 (float64).  The golden ops' intermediates (e.g. ``P x + Q`` of a
rational BN) need far more bits, so the layers compute in ``compute_dtype = int64``;
every golden op runs ``ranges().check()`` at construction, which proves each
intermediate fits int64 for every input its formats admit.

A norm layer built on this module (see :class:`QATModule`)::

    class IntLayerNorm(QATModule):
        channel_dim, min_ndim = -1, 1        # the golden op normalizes the last axis
        def __init__(self, n, out_fmt, in_fmt=None, eps=1e-5):
            super().__init__(n, InputQuantizer(in_fmt), return_quant_tensor=False)
            self.out_fmt, self.eps = out_fmt, eps
            self.weight, self.bias = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))
        def golden(self, in_fmt=None):
            fmt = self.input_format(in_fmt)
            return ops.IntLayerNorm.from_float(param_array(self.weight), param_array(self.bias),
                                               self.eps, fmt, self.out_fmt)
        def _constants(self, op):
            return {"gain": op.config.gain, "shift": op.config.shift, "bias": op.config.bias}
        def forward(self, x):
            q = self.quantize_input(x)
            op = self.golden(q.fmt)
            ints = self.run_golden(op, q.ints)
            surrogate = lambda xd, w, b: F.layer_norm(xd, (self.channels,), w.to(xd.dtype), b.to(xd.dtype), self.eps)
            return self.finish(q, ints, op.out_fmt, surrogate, (self.weight, self.bias))
"""

from qnorm.nn.base import (
    IntInference,
    IntModule,
    QATModule,
    fmt_metadata,
    from_op_layout,
    jsonable,
    param_array,
    to_op_layout,
)
from qnorm.nn.batchnorm import BatchStats, BNQATModule, batch_stats, rational_bn_constants
from qnorm.nn.quantizer import (
    COMPUTE_DTYPE,
    InputQuantizer,
    QuantizedInput,
    check_finite_float,
    from_quant_tensor,
    is_quant_tensor,
    power_of_two_ceil,
    quantize_float,
    quantized_input,
)
from qnorm.nn.surrogate import (
    Output,
    Surrogate,
    exact_forward,
    exact_forward_in_graph,
    surrogate_in_graph,
    to_output,
)
from qnorm.nn.sync import all_reduce_max, distributed, synced_batch_norm, synced_moments

__all__ = [
    "COMPUTE_DTYPE",
    "BNQATModule",
    "BatchStats",
    "InputQuantizer",
    "IntInference",
    "IntModule",
    "Output",
    "QATModule",
    "QuantizedInput",
    "Surrogate",
    "all_reduce_max",
    "batch_stats",
    "check_finite_float",
    "distributed",
    "exact_forward",
    "exact_forward_in_graph",
    "fmt_metadata",
    "from_op_layout",
    "from_quant_tensor",
    "is_quant_tensor",
    "jsonable",
    "param_array",
    "power_of_two_ceil",
    "quantize_float",
    "quantized_input",
    "rational_bn_constants",
    "surrogate_in_graph",
    "synced_batch_norm",
    "synced_moments",
    "to_op_layout",
    "to_output",
]
