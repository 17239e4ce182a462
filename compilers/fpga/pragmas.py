"""The Vitis HLS directives of a qnorm HLS project, as ``#pragma HLS`` lines in its C.

* **Interfaces** (in ``qnorm_top``): the port arrays are AXI masters (``m_axi``, one
  bundle each, ``depth`` = the elements of one block, so C/RTL co-simulation sizes its
  memories), their base addresses, ``steps`` and the return value are AXI-Lite registers
  (``s_axilite``): the host starts a call and reads its status like any Vitis kernel.
  The kernel reads its arrays by index, more than once per row, so a stream (``axis``)
  port would not match its access pattern.
* **Pipelining** (in ``kernel.c``): ``PIPELINE II=1`` on every element loop, a loop over
  the row's (or the neuron's channels') width not inside another such loop; Vitis
  unrolls the loops inside it (a multi-threshold unit's levels).
* **Partitioning** (in ``qnorm_top``): a 2-D constant (levels × channels: the
  multi-threshold unit's thresholds) is split completely along its first axis, so the
  unrolled levels loop reads every level of a channel in one clock.  1-D per-channel
  constants are read once per element and stay whole.

gcc ignores them (the C simulation builds with ``-Wno-unknown-pragmas``); Vitis is not
run here, so the II each loop achieves is Vitis' report to read, not a claim.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# TVM's C loops: ``for (int32_t ax0 = 0; ax0 < 64; ++ax0) {`` (int64_t counters start at ``(int64_t)0``).
_FOR = re.compile(r"^(\s*)for \((?:int32_t|int64_t) (\w+) = (?:\(int64_t\))?0; \2 < (?:\(int64_t\))?(\d+); \+\+\2\) \{$")

# String literals and line comments: TVM's C has braces in both (its assert messages
# print tensor shapes, its first line the target as JSON).
_NOT_CODE = re.compile(r'"(?:\\.|[^"\\])*"|//.*$')


class PragmaError(RuntimeError):
    """The kernel's C has no loop the pipelining directive can be placed on."""


def interface_pragmas(x: str, y: str, depth: int, time_major: bool, consts: Mapping[str, int]) -> list[str]:
    """The directives at the top of ``qnorm_top``'s body: ports ``x`` and ``y`` of ``depth``
    elements, ``steps`` when ``time_major``; ``consts``: each constant's C name -> its
    number of axes."""
    lines = [
        f"#pragma HLS INTERFACE mode=m_axi port={x} offset=slave bundle=gmem_in depth={depth}",
        f"#pragma HLS INTERFACE mode=m_axi port={y} offset=slave bundle=gmem_out depth={depth}",
        f"#pragma HLS INTERFACE mode=s_axilite port={x} bundle=control",
        f"#pragma HLS INTERFACE mode=s_axilite port={y} bundle=control",
        *(["#pragma HLS INTERFACE mode=s_axilite port=steps bundle=control"] if time_major else []),
        "#pragma HLS INTERFACE mode=s_axilite port=return bundle=control",
    ]
    lines += [
        f"#pragma HLS ARRAY_PARTITION variable={name} type=complete dim=1" for name, axes in consts.items() if axes == 2
    ]
    return ["  " + line for line in lines]


def pipeline_element_loops(source: str, width: int) -> str:
    """``source`` (TVM's C for a kernel) with ``PIPELINE II=1`` as the first line of each
    element loop: a loop of ``width`` iterations not nested in another one.  A kernel of
    width 1 has no such loop (TVM removes loops of one iteration) and is returned as is."""
    out: list[str] = []
    inside: list[bool] = []  # per open brace: does it open an element loop?
    placed = 0
    for line in source.splitlines(keepends=True):
        out.append(line)
        loop = _FOR.match(line.rstrip("\n"))
        element = loop is not None and int(loop.group(3)) == width and not any(inside)
        code = _NOT_CODE.sub("", line)
        for _ in range(code.count("}")):
            inside.pop()
        inside.extend([element] + [False] * (code.count("{") - 1) if "{" in code else [])
        if element:
            out.append(f"{loop.group(1)}  #pragma HLS PIPELINE II=1\n")
            placed += 1
    if placed == 0 and width > 1:
        raise PragmaError(f"kernel C has no loop of {width} iterations (the row width) to pipeline")
    return "".join(out)
