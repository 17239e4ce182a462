"""RTL units of the golden ops (Amaranth HDL), simulated bit-exact against them.

``rtl_unit(op)`` builds the streaming unit of one golden op instance from the
op's own integer code run on HDL values (:mod:`.values`); :mod:`.sim` runs it in
Amaranth's simulator, :mod:`.verilator` through Verilator for large runs.
Requires the ``fpga`` extra (amaranth).
"""

from compilers.rtl.unit import RtlUnit, rtl_unit

__all__ = ["RtlUnit", "rtl_unit"]
