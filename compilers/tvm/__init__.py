"""TVM lowering of qnorm: fixedpoint bodies to TIR (``primitives``), kernels for
every op (``kernels``), schedules per kind of target (``schedules``, ``cpu``,
``gpu``), cached builds for a qnorm target (``build``), edge-CPU cross builds
(``cross``), CUDA and OpenCL (``cuda``, ``opencl``) and whole models (``graph``).

Importing these modules imports tvm (seconds); ``import qnorm`` never does.  No
names are re-exported here: ``build`` the function would shadow ``build`` the module.
"""

from qnorm.extras import require as _require

_require("tvm")  # before any submodule's `import tvm`: say which extra installs it
