"""TVM lowering of qnorm: fixedpoint bodies to TIR (``primitives``), CPU schedules
(``cpu``) and cached builds for a qnorm target (``build``).

Importing these modules imports tvm (seconds); ``import qnorm`` never does.  No
names are re-exported here: ``build`` the function would shadow ``build`` the module.
"""
