"""GPU report of scripts/gpu_check.sh: the verify matrix and int8 kernels vs torch CUDA norms.

Runs on the GPU host with its own python3: standard library only, plus torch
when it is installed with CUDA (the baseline).  Inputs: the bundle's
``manifest.json`` and the output of compilers/tvm/harness/gpu_harness.cu for the verify plans
and the benchmark plans (``ok LABEL ELEMENTS [time_us MEDIAN MIN]`` /
``FAIL LABEL REASON`` lines).  Writes ``gpu_verify.md``, ``gpu_bench.md`` and
``gpu_results.json`` into ``--out``.

Timing: each int8 kernel and each torch op is timed the same way: 10 warm-up
calls, then 5 rounds of 200 back-to-back calls between CUDA events; the median
round gives the time per call.  Bandwidth counts every input, constant and
output byte once.  Torch runs ``layer_norm``/``rms_norm`` on float16 and
float32 rows of the same shape (its int8 equivalent does not exist).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROUNDS, ITERS, WARMUP = 5, 200, 10
VERIFY_REPORT, BENCH_REPORT, RESULTS = "gpu_verify.md", "gpu_bench.md", "gpu_results.json"
TORCH_DTYPES = ("float16", "float32")


def parse_harness(text: str) -> dict[str, dict[str, Any]]:
    """Harness output lines by label: status, elements, time (µs, median) or the failure reason."""
    results: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] == "ok":
            entry: dict[str, Any] = {"status": "ok", "elements": int(words[2])}
            if len(words) >= 6 and words[3] == "time_us":
                entry.update(time_us=float(words[4]), min_us=float(words[5]))
            results[words[1]] = entry
        elif len(words) >= 2 and words[0] == "FAIL":
            results[words[1]] = {"status": "FAIL", "reason": " ".join(words[2:])}
    return results


def verify_table(
    manifest: dict[str, Any], runs: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], str]:
    """Per case: ok with the vectors checked, FAIL with the first mismatch, or missing."""
    rows = []
    for case in manifest["cases"]:
        mine = {k: v for k, v in runs.items() if k.split(":")[0] == case["name"]}
        failed = [f"{k}: {v['reason']}" for k, v in mine.items() if v["status"] == "FAIL"]
        if failed:
            status = "FAIL " + failed[0]
        elif len(mine) != case["launches"]:
            status = f"FAIL ran {len(mine)} of {case['launches']} batches"
        else:
            status = f"ok ({sum(v['elements'] for v in mine.values()) // case['width']} vectors)"
        rows.append({"case": case["name"], "status": status})
    lines = [
        "| case | cuda (GPU) |",
        "|---|---|",
        *(f"| {r['case']} | {r['status']} |" for r in rows),
    ]
    return rows, "\n".join(lines)


def torch_baseline(shapes: list[tuple[int, int]]) -> tuple[dict[str, float], str]:
    """Median µs per call of torch layer_norm / rms_norm by ``"{op}.{dtype}.{rows}x{n}"``."""
    try:
        import torch
    except ImportError:
        return {}, "torch is not installed"
    if not torch.cuda.is_available():
        return {}, f"torch {torch.__version__} sees no CUDA device"
    fn = torch.nn.functional
    if not hasattr(fn, "rms_norm"):
        return {}, f"torch {torch.__version__} has no rms_norm"
    times: dict[str, float] = {}
    for rows, n in shapes:
        for dtype in TORCH_DTYPES:
            dt = getattr(torch, dtype)
            x = torch.randn(rows, n, device="cuda", dtype=dt)
            w, b = torch.randn(n, device="cuda", dtype=dt), torch.randn(n, device="cuda", dtype=dt)
            for name, call in _torch_calls(fn, x, w, b).items():
                times[f"{name}.{dtype}.{rows}x{n}"] = _time_cuda(torch, call)
    return times, f"torch {torch.__version__}, {torch.cuda.get_device_name()}"


def _torch_calls(fn: Any, x: Any, w: Any, b: Any) -> dict[str, Any]:
    shape = (x.shape[-1],)
    return {
        "layer_norm": lambda: fn.layer_norm(x, shape, w, b, 1e-5),
        "rms_norm": lambda: fn.rms_norm(x, shape, w, 1e-5),
    }


def _time_cuda(torch: Any, call: Any) -> float:
    for _ in range(WARMUP):
        call()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(ROUNDS):
        start.record()
        for _ in range(ITERS):
            call()
        stop.record()
        stop.synchronize()
        per_call.append(1000.0 * start.elapsed_time(stop) / ITERS)
    return statistics.median(per_call)


def bench_table(
    manifest: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    torch_times: dict[str, float],
    torch_note: str,
) -> tuple[list[dict[str, Any]], str]:
    rows = []
    for b in manifest["bench"]:
        run = runs.get(b["label"], {"status": "FAIL", "reason": "no result"})
        row: dict[str, Any] = {**b, "status": run["status"], "reason": run.get("reason")}
        if "time_us" in run:
            row["time_us"] = run["time_us"]
            row["gb_s"] = b["bytes"] / run["time_us"] / 1e3
        for dtype in TORCH_DTYPES:
            t = torch_times.get(f"{b['torch']}.{dtype}.{b['rows']}x{b['n']}")
            if t is not None:
                row[f"torch_{dtype}_us"] = t
        rows.append(row)
    head = ["kernel", "shape", "bit-exact (CRC-32)", "int8 µs", "GB/s"]
    head += [f"torch {d} µs (ratio)" for d in TORCH_DTYPES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["op"],
            f"{r['rows']}x{r['n']}",
            r["status"] if r["status"] == "ok" else f"FAIL {r['reason']}",
        ]
        cells += [f"{r['time_us']:.2f}", f"{r['gb_s']:.0f}"] if "time_us" in r else ["-", "-"]
        for d in TORCH_DTYPES:
            t = r.get(f"torch_{d}_us")
            ratio = f" ({t / r['time_us']:.2f}x)" if t is not None and "time_us" in r else ""
            cells.append(f"{r['torch']} {t:.2f}{ratio}" if t is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Baseline: {torch_note}. Ratio > 1: the int8 kernel is faster."]
    return rows, "\n".join(lines)


def bench_report(device: str, table: str) -> str:
    """The text of ``gpu_bench.md``: a heading naming the GPU, then :func:`bench_table`'s table."""
    return f"# int8 norm kernels on {device}\n\n{table}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--verify-log", type=Path, required=True)
    parser.add_argument("--bench-log", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="", help="the GPU, as nvidia-smi names it")
    args = parser.parse_args(argv)
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)

    verify_rows, verify_md = verify_table(manifest, parse_harness(args.verify_log.read_text()))
    (args.out / VERIFY_REPORT).write_text(
        f"# qnorm verify, cuda column on {args.device}\n\n{verify_md}\n"
    )
    results: dict[str, Any] = {
        "device": args.device,
        "nvcc_here": manifest["nvcc"],
        "verify": verify_rows,
    }
    failed = [r["case"] for r in verify_rows if not r["status"].startswith("ok")]
    if args.bench_log is not None:
        shapes = sorted({(b["rows"], b["n"]) for b in manifest["bench"]})
        torch_times, note = torch_baseline(shapes)
        bench_rows, bench_md = bench_table(
            manifest, parse_harness(args.bench_log.read_text()), torch_times, note
        )
        (args.out / BENCH_REPORT).write_text(bench_report(args.device, bench_md))
        results.update(bench=bench_rows, torch=note)
        failed += [r["label"] for r in bench_rows if r["status"] != "ok"]
        print(bench_md)
    (args.out / RESULTS).write_text(json.dumps(results, indent=1) + "\n")
    print(verify_md)
    print(f"not bit-exact on the GPU: {', '.join(failed) or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
