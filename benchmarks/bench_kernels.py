"""P1 and P2: the int8 norm kernels against torch float32, an int8 copy, and each other.

P1: each int8-in, int8-out norm kernel (built by ``kernel_for(op).build(x86_64)``,
γ/β/ε through ``Op.from_float``) on (4096, 768) and (1024, 4096), against
torch float32 ``F.layer_norm`` (the LayerNorm family) or ``F.rms_norm``
(IntRMSNorm) on the same values, and against an int8 copy of the same bytes.
Goals: >= 4x torch float32 on AVX2 hosts, at most 5x the time of the int8 copy on
every host.  P2: L1LayerNorm against IntLayerNorm (integer L2) at N = 64, 768 and
4096, goal: L1 not slower.

``--isa avx2`` measures both at the AVX2 level on a host with AVX-512: the kernels
built for x86-64-v3 (the target resolved as if the CPU listed no AVX-512 flag) and
torch dispatching its AVX2 kernels, which it does only when the process starts with
``ATEN_CPU_CAPABILITY=avx2`` (:mod:`benchmarks.bench_avx2` runs it so).  That is an
AVX2 host's instruction set on this host's cores, caches and clock, not an AVX2 host.

The copy roofline is a TVM-compiled int8 copy kernel scheduled by the same
row-parallel, vectorized CPU schedule and called the same way: the least any
kernel of this shape, dtype and calling path can cost.  ``np.copyto`` (a
single-threaded memcpy) is listed beside it as a cross-check.

Both sides run the same number of threads (torch's and TVM's pools).  With one
thread the clock is the calling thread's CPU time, so other processes on a
shared machine do not count; with more it is wall time.  Kernels are called
through ``CompiledKernel.run`` with preallocated tensors (no conversion timed),
and each is checked bit-exact against its golden op before it is timed.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm import te

from benchmarks._machine import describe
from benchmarks._timing import Timing, interleaved, ratio
from compilers.tvm.build import Built, build
from compilers.tvm.cpu import schedule_rowwise
from compilers.tvm.kernels import kernel_for
from qnorm.ops import NORMS, IntLayerNorm, IntRMSNorm, L1LayerNorm
from qnorm.ops._normcore import NormOp
from qnorm.qformat import QFormat
from qnorm.targets import Target, detect_x86_level, load_target, read_cpuinfo

SHAPES: tuple[tuple[int, int], ...] = ((4096, 768), (1024, 4096), (49152, 64))
OPS: tuple[type[NormOp], ...] = NORMS
SPEEDUP_GOAL = 4.0  # x torch float32 (on AVX2 hosts; AVX-512 torch runs near memory speed)
COPY_GOAL = 5.0  # at most this many times an int8 copy of the same tensor, on every host
L1_GOAL = 1.0  # L1LayerNorm not slower than IntLayerNorm at any N
CHECK_ROWS = 64  # rows checked bit-exact against the golden op before timing
SEED = 0
LN_EPS, RMS_EPS = 1e-5, 1e-6
TVM_COPY, NP_COPY = "int8 copy (TVM)", "np.copyto"
HOST, AVX2 = "host", "avx2"  # --isa: the host's own level, or AVX2 on an AVX-512 host
AVX2_LEVEL = "x86-64-v3"
TORCH_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2"}  # read by torch once, when it starts
AVX2_TITLE = "## Kernel throughput at the AVX2 level on this AVX-512 host (P1, P2)"


def without_avx512(cpuinfo: str) -> str:
    """``cpuinfo`` with every AVX-512 flag removed (what an AVX2 CPU's would list)."""
    return re.sub(r"\bavx512\w*", "", cpuinfo)


def host_has_avx512(cpuinfo: str | None = None) -> bool:
    """Whether the CPU's flags reach x86-64-v4 (AVX-512), so an AVX2-level run means something."""
    return detect_x86_level(read_cpuinfo() if cpuinfo is None else cpuinfo)[0] == "x86-64-v4"


def isa_target(isa: str, cpuinfo: str | None = None) -> Target:
    """The x86_64 target at the host's level (``host``) or at x86-64-v3 (``avx2``).

    ``avx2`` refuses a host without AVX2 (its level would be below v3) and a torch
    that does not dispatch AVX2 kernels (the process must start with
    ``ATEN_CPU_CAPABILITY=avx2``): either would time another instruction set
    under the AVX2 label."""
    if isa == HOST:
        return load_target("x86_64", cpuinfo=cpuinfo)
    if isa != AVX2:
        raise ValueError(f"isa must be {HOST!r} or {AVX2!r}, got {isa!r}")
    target = load_target("x86_64", cpuinfo=without_avx512(read_cpuinfo() if cpuinfo is None else cpuinfo))
    if target.tvm.get("mcpu") != AVX2_LEVEL:
        raise RuntimeError(f"this CPU has no AVX2 (its level without AVX-512 is {target.tvm.get('mcpu')})")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        raise RuntimeError(
            f"torch dispatches {capability} kernels in this process; an AVX2-level run needs it started "
            "with ATEN_CPU_CAPABILITY=avx2"
        )
    return target


def use_threads(threads: int) -> None:
    """Run torch and TVM's thread pool with ``threads`` threads each.

    TVM sizes its pool when it first starts, from TVM_NUM_THREADS (default: half
    the logical CPUs), and can only shrink it later; so the variable is set
    around the first configuration and the resulting size is checked.  By
    default TVM also pins the calling thread to CPU 0 whenever it configures
    the pool, and threads started later (torch's) inherit that single CPU:
    TVM_BIND_THREADS=0 keeps the process's CPUs as they were.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    settings = {"TVM_NUM_THREADS": str(threads), "TVM_BIND_THREADS": "0"}
    previous = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        tvm.get_global_func("runtime.config_threadpool")(1, threads)
    finally:
        for k, v in previous.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    running = tvm.get_global_func("runtime.NumThreads")()
    if running != threads:
        raise RuntimeError(
            f"TVM's thread pool runs {running} threads, not {threads}: it started with fewer "
            "before this benchmark; run the benchmark in a fresh process"
        )


def make_op(cls: type[NormOp], gamma: np.ndarray, beta: np.ndarray, in_fmt: QFormat) -> NormOp:
    """The op of ``cls`` for these float parameters (RMSNorm has no β and a smaller ε)."""
    if cls is IntRMSNorm:
        return cls.from_float(gamma, None, RMS_EPS, in_fmt)
    return cls.from_float(gamma, beta, LN_EPS, in_fmt)


def torch_reference(cls: type[NormOp]) -> str:
    return "rms_norm" if cls is IntRMSNorm else "layer_norm"


def copy_kernel(n: int, target: Target) -> Built:
    """``out = x`` for (rows, n) int8, through the same CPU schedule as the norm kernels."""
    rows = te.var("rows", "int64")
    x = te.placeholder((rows, n), "int8", name="x")
    out = te.compute((rows, n), lambda r, c: x[r, c], name="out")
    return build(schedule_rowwise(te.create_prim_func([x, out]), "out"), target)


def _sides(rows: int, n: int, target: Target) -> dict[str, Callable[[], object]]:
    """Every timed call on one shape: the kernels, their torch references, the copies."""
    rng = np.random.default_rng(SEED)
    act = rng.standard_normal((rows, n)).astype(np.float32)
    in_fmt = QFormat(8, float(np.abs(act).max()) / 127)  # max-abs calibration
    xq = in_fmt.quantize(act).astype(np.int8)
    x, out = tvm.runtime.tensor(xq), tvm.runtime.empty((rows, n), "int8")
    xf = torch.from_numpy(xq.astype(np.float32) * np.float32(in_fmt.scale))
    gamma = rng.normal(1.0, 0.1, n).astype(np.float32)  # trained-looking parameters
    beta = rng.normal(0.0, 0.1, n).astype(np.float32)
    gamma_t, beta_t = torch.from_numpy(gamma), torch.from_numpy(beta)

    sides: dict[str, Callable[[], object]] = {}
    for cls in OPS:
        op = make_op(cls, gamma, beta, in_fmt)
        compiled = kernel_for(op).build(target)
        head = xq[:CHECK_ROWS]
        if not np.array_equal(compiled(head), op.forward(head.astype(np.int64))):
            raise RuntimeError(f"{cls.__name__} kernel differs from its golden op on {rows}x{n}")
        consts = compiled.device_args()
        sides[cls.__name__] = lambda c=compiled, k=consts: c.run(x, k, out)
    sides["layer_norm"] = lambda: F.layer_norm(xf, (n,), gamma_t, beta_t, LN_EPS)
    sides["rms_norm"] = lambda: F.rms_norm(xf, (n,), gamma_t, RMS_EPS)
    copy, dst = copy_kernel(n, target), np.empty_like(xq)
    sides[TVM_COPY] = lambda: copy(x, out)
    sides[NP_COPY] = lambda: np.copyto(dst, xq)
    return sides


def measure(
    shapes: Sequence[tuple[int, int]], rounds: int, min_loop_s: float, threads: int, target: Target
) -> dict[tuple[int, int], dict[str, Timing]]:
    use_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    return {
        (rows, n): interleaved(_sides(rows, n, target), rounds, min_loop_s, clock)
        for rows, n in shapes
    }


# --------------------------------------------------------------------------- report


def _us(t: Timing) -> str:
    return f"{t.median_s * 1e6:,.0f} µs"


def _verdict(value: float, goal: float, at_most: bool = False) -> str:
    return "met" if (value <= goal if at_most else value >= goal) else "NOT met"


def _p1_table(results: dict[tuple[int, int], dict[str, Timing]]) -> tuple[list[str], int, int]:
    lines = [
        f"| op | shape | int8 kernel | torch float32 | speedup (goal ≥ {SPEEDUP_GOAL:g}×) "
        f"| int8 copy | × int8 copy (goal ≤ {COPY_GOAL:g}×) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    met_speed = met_roof = 0
    for (rows, n), t in results.items():
        copy = t[TVM_COPY]
        for cls in OPS:
            k, ref = t[cls.__name__], t[torch_reference(cls)]
            speed, copies = ratio(ref, k), ratio(k, copy)
            met_speed += speed >= SPEEDUP_GOAL
            met_roof += copies <= COPY_GOAL
            lines.append(
                f"| {cls.__name__} | {rows}×{n} | {_us(k)} | {ref.name} {_us(ref)} "
                f"| {speed:.2f}× {_verdict(speed, SPEEDUP_GOAL)} | {_us(copy)} "
                f"| {copies:.1f}× {_verdict(copies, COPY_GOAL, at_most=True)} |"
            )
    return lines, met_speed, met_roof


def _p2_table(results: dict[tuple[int, int], dict[str, Timing]]) -> list[str]:
    lines = [
        f"| shape | IntLayerNorm | L1LayerNorm | L1 speedup (goal ≥ {L1_GOAL:.2f}×) |",
        "|---|---:|---:|---:|",
    ]
    for (rows, n), t in results.items():
        l2, l1 = t[IntLayerNorm.__name__], t[L1LayerNorm.__name__]
        r = ratio(l2, l1)
        lines.append(f"| {rows}×{n} | {_us(l2)} | {_us(l1)} | {r:.2f}× {_verdict(r, L1_GOAL)} |")
    return lines


def _titles(isa: str) -> tuple[str, str, str, list[str]]:
    """The section's heading, its P1 and P2 subheadings and what it says about the level."""
    if isa == HOST:
        return ("## Kernel throughput (P1, P2)", "### P1: int8 kernels vs torch float32 and vs the int8 copy",
                "### P2: L1LayerNorm vs IntLayerNorm (integer L2)", [])  # fmt: skip
    return (
        AVX2_TITLE,
        "### AVX2 level, P1: int8 kernels vs torch float32 and vs the int8 copy",
        "### AVX2 level, P2: L1LayerNorm vs IntLayerNorm (integer L2)",
        [
            "Both sides limited to AVX2 in one process: the kernels built for x86-64-v3, torch "
            "started with `ATEN_CPU_CAPABILITY=avx2` (its AVX2 kernels). An AVX2 host's "
            "instruction set on this host's cores, caches and clock, not an AVX2 host.",
        ],
    )


def render(
    results: dict[tuple[int, int], dict[str, Timing]],
    rounds: int,
    min_loop_s: float,
    threads: int,
    target: Target,
    isa: str = HOST,
) -> str:
    title, p1_title, p2_title, level = _titles(isa)
    clock = "CPU time of the calling thread" if threads == 1 else "wall time"
    p1, met_speed, met_roof = _p1_table(results)
    cases = len(results) * len(OPS)
    copies = "; ".join(
        f"{rows}×{n}: TVM {_us(t[TVM_COPY])}, np.copyto {_us(t[NP_COPY])}"
        for (rows, n), t in results.items()
    )
    return "\n".join(
        [
            title,
            "",
            *level,
            f"Machine: {describe()}; kernels built for `{target.tvm.get('mcpu', '?')}` "
            f"({target.hardware.vector_bits}-bit vectors); TVM {tvm.__version__}, torch "
            f"{torch.__version__}; **{threads} thread{'s' if threads > 1 else ''}** on both sides "
            "(TVM's pool and torch).",
            f"Median per call over {rounds} rounds of interleaved loops ≥ {min_loop_s:g} s; "
            f"clock: {clock}; ratios are medians of per-round ratios.",
            f"int8 in, int8 out, γ ~ N(1, 0.1), β ~ N(0, 0.1), ε = {LN_EPS:g} (RMSNorm {RMS_EPS:g}), input "
            "N(0, 1) quantized with max-abs calibration; torch gets the same values in float32.",
            "Copy roofline: a TVM int8 copy kernel with the norm kernels' schedule and calling "
            f"path (np.copyto, one thread, as a cross-check: {copies}).",
            "",
            p1_title,
            "",
            *p1,
            "",
            f"Speedup goal met in {met_speed} of {cases} cases; copy-multiple goal met in "
            f"{met_roof} of {cases}.",
            "",
            p2_title,
            "",
            *_p2_table(results),
        ]
    )


def section(
    shapes: Sequence[tuple[int, int]] = SHAPES,
    rounds: int = 5,
    min_loop_s: float = 0.5,
    threads: int = 1,
    isa: str = HOST,
) -> str:
    """The P1/P2 markdown section, measured now at ``isa``'s level (:func:`isa_target`)."""
    target = isa_target(isa)
    results = measure(shapes, rounds, min_loop_s, threads, target)
    return render(results, rounds, min_loop_s, threads, target, isa)


def parse_shape(text: str) -> tuple[int, int]:
    """``"ROWSxN"`` as (rows, n)."""
    rows, sep, n = text.partition("x")
    if not (sep and rows.isdigit() and n.isdigit() and int(rows) > 0 and int(n) > 0):
        raise argparse.ArgumentTypeError(f"a shape is ROWSxN with positive integers, got {text!r}")
    return int(rows), int(n)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-loop", type=float, default=0.5, help="seconds per timed loop")
    parser.add_argument("--threads", type=int, default=1, help="threads for torch and TVM alike")
    parser.add_argument("--out", default="out/bench_kernels.md")
    parser.add_argument("--isa", choices=(HOST, AVX2), default=HOST,
                        help="the host's own level, or AVX2 on an AVX-512 host (start with ATEN_CPU_CAPABILITY=avx2)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=list(SHAPES), metavar="ROWSxN")
    args = parser.parse_args(argv)
    text = section(tuple(args.shapes), args.rounds, args.min_loop, args.threads, args.isa)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
