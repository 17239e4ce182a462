"""Prepare the GPU check (scripts/gpu_check.sh prepare): everything that needs TVM.

Writes a bundle directory (default ``out/gpu_bundle``, ignored by git) that a GPU
host without TVM or the project's venv runs with nvcc and compilers/tvm/harness/gpu_harness.cu:

* ``cases/<case>/`` — per verify case: TVM's CUDA source (``kernel.cu``), nvcc's
  PTX and cubin for every architecture of qnorm/data/targets/cuda.toml, and ``verify.plan``:
  the stored golden vectors and this run's edge, exhaustive and random vectors
  (as ``qnorm verify`` runs them) with the golden outputs, compared element by
  element on the GPU;
* ``bench/`` — the int8 norm kernels at (4096, 768), (1024, 4096) and (49152, 64), one plan
  each: a seeded random input, the golden output's CRC-32, timed launches;
* ``manifest.json`` — what the bundle holds (cases and their vector widths,
  benchmark shapes and bytes moved), read by benchmarks/bench_gpu.py.

Usage: .venv/bin/python scripts/gpu_bundle.py [--out DIR] [--case GLOB ...]
       [--elements N] [--no-bench]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from compilers.tvm import cuda
from qnorm.verify import golden_store
from qnorm.verify.cases import Case, case_named, select_cases
from qnorm.verify.vectors import DEFAULT_ELEMENTS, Batch, run_batches

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "out" / "gpu_bundle"
SEED = 0  # run vectors: the seed of a default `qnorm verify`
BENCH_SHAPES = ((4096, 768), (1024, 4096), (49152, 64))
# (benchmark op, the verify case whose config it takes at another row length, torch op)
BENCH_OPS = (
    ("int_layernorm", "int_layernorm.int8.n64", "layer_norm"),
    ("l1_layernorm", "l1_layernorm.int8.n64", "layer_norm"),
    ("shift_layernorm", "shift_layernorm.int8.n64.m2", "layer_norm"),
    ("int_rmsnorm", "int_rmsnorm.int8.n64", "rms_norm"),
)
BENCH_ITERS = 200  # launches per timed round (5 rounds)


def _copy_module(compiled: cuda.CudaKernel, stem: Path) -> None:
    """The source and nvcc's outputs into the bundle as ``{stem}.cu``, ``{stem}.sm_XY.ptx``/``.cubin``."""
    shutil.copyfile(compiled.binaries.stem.with_suffix(".cu"), stem.with_suffix(".cu"))
    for src in compiled.binaries.files:
        shutil.copyfile(
            src, stem.with_name(stem.name + src.name[len(compiled.binaries.stem.name) :])
        )


def _batches(case: Case, elements: int) -> list[Batch]:
    stored = golden_store.load(golden_store.DEFAULT_DIR, case)
    return [Batch("golden", stored.x, stored.y), *run_batches(case, elements, SEED)]


def write_case(root: Path, case: Case, elements: int) -> dict[str, Any]:
    """One verify case's module and plan; returns its manifest entry."""
    op = case.build()
    compiled = cuda.cuda_kernel(op)
    directory = root / "cases" / case.name
    directory.mkdir(parents=True, exist_ok=True)
    _copy_module(compiled, directory / "kernel")
    out = list(compiled.device.buffers)[-1]
    runs, vectors = [], 0
    for i, batch in enumerate(_batches(case, elements)):
        arrays = cuda.kernel_arrays(compiled.kernel, compiled.device, batch.x)
        expected = batch.expected if batch.expected is not None else op.forward(batch.x)
        runs.append(
            cuda.PlanRun(
                f"{case.name}:{batch.source}:{i}",
                arrays,
                out,
                expected=expected.reshape(arrays[out].shape),
            )
        )
        vectors += batch.x.size // case.width
    archs = cuda.archs(cuda.cuda_target())
    cuda.PlanWriter(directory).write("verify", "kernel", archs, compiled.device, runs)
    return {"name": case.name, "width": case.width, "vectors": vectors, "launches": len(runs)}


def bench_case(op_name: str, base: str, n: int) -> Case:
    """The verify case ``base`` at row length ``n`` (same formats, rounding, options)."""
    return case_named(base).derived(f"bench.{op_name}.n{n}", n=n)


def write_bench(root: Path) -> list[dict[str, Any]]:
    """The benchmark plans; returns their manifest entries."""
    writer = cuda.PlanWriter(root / "bench")
    archs = cuda.archs(cuda.cuda_target())
    entries = []
    for rows, n in BENCH_SHAPES:
        x = np.random.default_rng([SEED, rows, n]).integers(-128, 128, (rows, n), dtype=np.int8)
        for op_name, base, torch_op in BENCH_OPS:
            op = bench_case(op_name, base, n).build()
            compiled = cuda.cuda_kernel(op)
            label = f"{op_name}.{rows}x{n}"
            _copy_module(compiled, writer.directory / f"{label}.kernel")
            arrays = cuda.kernel_arrays(compiled.kernel, compiled.device, x)
            out = list(compiled.device.buffers)[-1]
            run = cuda.PlanRun(
                label,
                arrays,
                out,
                crc32=cuda.crc32(op.forward(x).astype(np.int8)),
                time_iters=BENCH_ITERS,
            )
            writer.write(label, f"{label}.kernel", archs, compiled.device, [run])
            moved = sum(a.nbytes for a in arrays.values())  # each buffer read or written once
            entries.append(
                {
                    "label": label,
                    "op": op_name,
                    "torch": torch_op,
                    "rows": rows,
                    "n": n,
                    "bytes": moved,
                }
            )
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--case", nargs="*", help="verify cases (glob patterns; default all)")
    parser.add_argument(
        "--elements", type=int, default=DEFAULT_ELEMENTS, help="run vectors' elements per case"
    )
    parser.add_argument("--no-bench", action="store_true", help="verify plans only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out.exists():
        shutil.rmtree(args.out)
    cases = []
    for case in select_cases(args.case):
        cases.append(write_case(args.out, case, args.elements))
        print(f"{case.name}: {cases[-1]['vectors']} vectors", file=sys.stderr)
    bench = [] if args.no_bench else write_bench(args.out)
    manifest = {
        "archs": list(cuda.archs(cuda.cuda_target())),
        "nvcc": cuda.nvcc_version(),
        "elements_per_case": args.elements,
        "seed": SEED,
        "cases": cases,
        "bench": bench,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(
        f"wrote {args.out}: {len(cases)} cases, {len(bench)} benchmark kernels, "
        f"{size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
