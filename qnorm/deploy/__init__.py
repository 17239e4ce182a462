"""Deploying a trained qnorm model: freeze it, export it, prove a compiled float graph exact.

* :func:`freeze` (:mod:`.freeze`): an eval-mode copy that ``torch.export`` traces, with
  every Brevitas quantizer a plain fake-quant and every qnorm layer one ``qnorm::int_op``;
  :func:`integer_ops` lists those layers' golden ops (per-layer back ends: HLS).
* :func:`export` (:mod:`.export`): the frozen model as a decomposed ExportedProgram
  with a dynamic batch dimension.
* :func:`prove_exact` (:mod:`.exactness`): the static check that every float tensor in
  that program lies on a power-of-two grid below 2^24 units, so that *any* compiler
  computes it exactly; otherwise :class:`NotDeployableError` listing every problem.
* :func:`model_spec` (:mod:`.spec`): the JSON a model is rebuilt from, for models
  whose family registered a describer (:func:`register_spec`).

Torch only: compiling the program is :mod:`compilers.tvm.graph`'s job.
"""

from qnorm.deploy.exactness import (
    ExactnessReport,
    NotDeployableError,
    input_format,
    input_quantizer,
    prove_exact,
)
from qnorm.deploy.export import export
from qnorm.deploy.freeze import freeze, integer_ops
from qnorm.deploy.spec import model_spec, register_spec

__all__ = [
    "ExactnessReport",
    "NotDeployableError",
    "export",
    "freeze",
    "input_format",
    "input_quantizer",
    "integer_ops",
    "model_spec",
    "prove_exact",
    "register_spec",
]
