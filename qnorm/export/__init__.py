"""Exporting trained qnorm models to interchange formats.

* :mod:`qnorm.export.qonnx`: QONNX (ONNX with the ``qonnx.custom_op.general`` and
  ``qnorm.custom_op`` domains) for FINN / hls4ml flows; the nodes of the
  ``qnorm.custom_op`` domain run with :mod:`qnorm.custom_op`.

Nothing is imported here: the exporters pull in onnx and brevitas, the optional
``qonnx`` extra.
"""
