"""TVM lowering of qnorm: fixedpoint bodies to TIR (``primitives``), kernels for
every op (``kernels``), schedules per kind of target (``schedules``, ``cpu``,
``gpu``), cached builds for a qnorm target (``build``), edge-CPU cross builds
(``cross``), CUDA and OpenCL (``cuda``, ``opencl``) and whole models (``graph``).

Importing these modules imports tvm (seconds); ``import qnorm`` never does.  No
names are re-exported here: ``build`` the function would shadow ``build`` the module.

TVM's thread pool pins the thread that starts it to CPU 0 unless told otherwise,
and threads started afterwards (torch's intra-op pool) inherit that one CPU: a
process that runs a TVM kernel and then trains or evaluates in torch would run
torch on one core.  Unpinned is the default here; an explicit setting wins.
"""

import os

os.environ.setdefault("TVM_BIND_THREADS", "0")
