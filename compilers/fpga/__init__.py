"""FPGA back ends: HLS projects (TVM's C, a top function, a C testbench) checked by C simulation."""

from qnorm.extras import require as _require

_require("tvm")  # TVM writes the kernels' C: say which extra installs it
