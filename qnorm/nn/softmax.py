"""Integer softmax layer for QAT: bit-exact integer forward, float softmax backward.

:class:`IntSoftmax` is the trainable form of :class:`qnorm.ops.softmax.IntSoftmax`:
softmax over the last axis of ``(..., N)`` logits (attention scores), the drop-in
for ``torch.softmax(x, dim=-1)``.

**Forward** (bit-exact, the recipe of :mod:`qnorm.nn._qat`): the logits are quantized
(a fixed ``in_fmt``, a per-tensor scale calibrated in training — a power of two with
``pow2=True`` — or a Brevitas ``IntQuantTensor``'s own integers), the golden op of
that format is derived (its exp tables depend on the input scale only, so it is
cached per config), its integer body runs on int64 tensors and the output is
``golden_ints * out_fmt.scale`` exactly.

**Masks.**  ``causal=True`` masks as the op does (row q of a ``(…, query_len, N)``
score matrix keeps the columns ``<= q + causal_offset``).  With ``padding=True`` the
lowest code of the input format marks a padded key (−∞): a logit that saturates
there (``masked_fill(mask, -1e4)`` before the layer, say) is padding; ``forward(x,
lengths=…)`` (valid keys per row) or ``forward(x, key_mask=…)`` (True where a key is
kept) sets that code itself and keeps every real logit at lo + 1 or above
(:func:`qnorm.ops.softmax.mask_padding`).

**Backward**: the float softmax's vector-Jacobian product at the dequantized
logits, over the kept columns (masked columns get zero gradient), times the input
quantizer's straight-through mask (zero where it clipped).  The output's own
rounding and saturation are not differentiated (straight-through).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qnorm import fixedpoint as fp
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.nn.base import QATModule
from qnorm.nn.quantizer import InputQuantizer
from qnorm.nn.surrogate import Output
from qnorm.ops import softmax as ops_softmax
from qnorm.qformat import QFormat

DEFAULT_OUT = QFormat(8, 2.0**-8, False)  # uint8 probabilities in [0, 255/256]


# Under torch.compile the op is looked up, not traced: Dynamo would trace past the
# cache into the derivation (and warn that it skips the cache).
@torch.compiler.disable
@functools.lru_cache(maxsize=64)
def _op(config: ops_softmax.SoftmaxConfig) -> ops_softmax.IntSoftmax:
    """One op per config: deriving its tables costs ~0.1 ms per entry where float64 is unsure."""
    return ops_softmax.IntSoftmax(config)


class IntSoftmax(QATModule):
    """Softmax over the last axis of ``(..., n)`` with an exact integer forward (module docstring)."""

    channel_dim, min_ndim = -1, 1

    def __init__(
        self,
        n: int,
        out_fmt: QFormat = DEFAULT_OUT,
        in_fmt: QFormat | None = None,
        *,
        bits: int = 8,
        pow2: bool = False,
        causal: bool = False,
        causal_offset: int = 0,
        query_len: int | None = None,
        padding: bool = False,
        rounding: Round | str = DEFAULT_ROUND,
        return_quant_tensor: bool = False,
    ) -> None:
        super().__init__(n, InputQuantizer(in_fmt, bits=bits, signed=True, pow2=pow2), return_quant_tensor)
        self.out_fmt = out_fmt
        self.options = {
            "causal": causal,
            "causal_offset": causal_offset,
            "query_len": query_len,
            "padding": padding,
            "rounding": Round.parse(rounding),
        }
        # refuse a bad config now, not at the first forward
        ops_softmax.SoftmaxConfig(n, in_fmt or QFormat(bits, 1.0), out_fmt, **self.options)

    def golden(self, in_fmt: QFormat | None = None) -> ops_softmax.IntSoftmax:
        """The golden op of the current input format (``in_fmt`` overrides it)."""
        return _op(ops_softmax.SoftmaxConfig(self.channels, self.input_format(in_fmt), self.out_fmt, **self.options))

    def _constants(self, op: Any) -> dict[str, Any]:
        cfg = op.config
        return {"tables": list(op.tables), "exp_bits": cfg.exp_bits, "inv_bits": cfg.inv_bits, "lanes": cfg.lanes}

    def _config_metadata(self) -> dict[str, Any]:
        return {**self.options, "rounding": self.options["rounding"].value}

    def forward(
        self, x: torch.Tensor | Any, lengths: torch.Tensor | None = None, key_mask: torch.Tensor | None = None
    ) -> Output:
        """``x``: logits ``(..., n)``; ``lengths`` / ``key_mask``: padding (``padding=True`` only)."""
        if (lengths is not None or key_mask is not None) and not self.options["padding"]:
            raise ValueError("lengths / key_mask mark padded keys: build the layer with padding=True")
        q = self.quantize_input(x)
        op = self.golden(q.fmt)
        ints = q.ints
        if lengths is not None or key_mask is not None:
            ints = ops_softmax.mask_padding(ints, q.fmt, lengths, key_mask)
        with fp.proven_ranges():  # op exists: its analysis covers every input of its format
            out = self.run_golden(op, ints)
        keep = op.keep(ints, q.fmt.lo)

        def surrogate(xd: torch.Tensor) -> torch.Tensor:
            if keep is None:
                return torch.softmax(xd, dim=-1)
            # a finite floor, not −inf: a fully masked row stays NaN-free (its output is 0 anyway)
            p = torch.softmax(xd.masked_fill(~keep, torch.finfo(xd.dtype).min), dim=-1)
            return torch.where(keep, p, torch.zeros_like(p))

        return self.finish(q, out, op.out_fmt, surrogate, ())
