"""The ``qnorm`` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qnorm.extras import hint_for


def _demo(args: argparse.Namespace) -> int:
    from qnorm.demo import DeployMismatchError, run_demo, run_deploy_demo
    from qnorm.train.experiment import run_training

    out = Path(args.out)
    run_demo(out, seed=args.seed)
    # Train each norm/neuron kind, fold the integer SNN, print the accuracy table.
    # A folded SNN that predicts differently raises FoldMismatchError (non-zero exit).
    table = run_training(out / "train", seed=args.seed, quick=args.quick, jobs=1 if args.quick else 2)
    print("\n## Training: int8 transformer per norm, MPBN SNN unfolded vs folded\n")
    print(table.to_markdown())
    # Train the deployable models, compile them for this CPU, check them bit for bit.
    print("\n## Deployment: train, fold, compile for this CPU, run the test set, compare\n")
    try:
        run_deploy_demo(out, seed=args.seed, quick=args.quick, jobs=1 if args.quick else 2)
    except DeployMismatchError as err:
        print(f"qnorm demo: FAILED: {err}", file=sys.stderr)
        return 1
    return 0


def _verify(args: argparse.Namespace) -> int:
    from qnorm.verify import DEFAULT_ELEMENTS, FULL_ELEMENTS, resolve_columns, select_cases, verify
    from qnorm.verify.golden_store import DEFAULT_DIR
    from qnorm.verify.harness import CaseReport

    columns = resolve_columns(args.target)
    cases = select_cases(args.case)
    elements = args.elements if args.elements is not None else FULL_ELEMENTS if args.full else DEFAULT_ELEMENTS
    if elements < 1:
        raise ValueError(f"--elements must be positive, got {elements}")

    def progress(report: CaseReport, i: int, n: int) -> None:
        status = "FAIL" if report.failed else "ok"
        print(f"[{i}/{n}] {report.case.name}: {status} ({report.seconds:.1f} s)", file=sys.stderr)

    golden_dir = Path(args.golden_dir) if args.golden_dir else DEFAULT_DIR
    report = verify(cases, columns, elements, args.seed, golden_dir, progress if sys.stderr.isatty() else None)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
        for case_report, name, cell in report.failures:  # the first mismatching input, for humans too
            detail = cell.mismatch.describe() if cell.mismatch is not None else cell.reason
            print(f"FAIL {case_report.case.name} × {name}: {detail}", file=sys.stderr)
    else:
        print(report.matrix())
    return 0 if report.ok else 1


def _compile(args: argparse.Namespace) -> int:
    if args.target == HLS_TARGET:
        return _compile_hls(args)
    from compilers.tvm.graph import compile_checkpoint

    compiled, source = compile_checkpoint(args.checkpoint, args.target)
    out = compiled.save(args.out, source=source)
    meta = json.loads((out / "model.json").read_text())
    target = meta["target"]
    state = "cache hit" if compiled.cache_hit else "compiled"
    print(f"{args.checkpoint}: {source['model']['kind']} {source['model']['config']}")
    print(f"  {meta['exactness']['summary']}")
    cpu = target["tvm"].get("mcpu", target["tvm"]["kind"])
    print(f"  {state} for {target['name']} ({cpu}) in {compiled.seconds:.2f} s")
    print(f"  wrote {out / 'model.so'} (sha256 {meta['library']['sha256'][:16]}...) and {out / 'model.json'}")
    return 0


HLS_TARGET = "fpga-hls"


def _compile_hls(args: argparse.Namespace) -> int:
    """One Vitis HLS project per qnorm layer of the checkpoint (the linears stay on the host)."""
    from compilers.fpga.hls import write_hls_projects
    from qnorm.analysis import TargetLimitError
    from qnorm.deploy import integer_ops
    from qnorm.train.checkpoint import load_checkpoint

    model, meta = load_checkpoint(args.checkpoint)
    ops = integer_ops(model)
    if not ops:
        print(f"qnorm compile: {args.checkpoint} has no qnorm integer layer to put on the FPGA", file=sys.stderr)
        return 2
    try:
        projects = write_hls_projects(ops, args.out)
    except TargetLimitError as err:
        print(f"qnorm compile: refused: {err}", file=sys.stderr)
        return 2
    print(f"{args.checkpoint}: {meta['model']['kind']} {meta['model']['config']}")
    for name, path in projects.items():
        print(f"  {name}: {ops[name].name} -> {path} (vitis_hls -f {path / 'run_hls.tcl'})")
    return 0


def _export(args: argparse.Namespace) -> int:
    """``qnorm export CHECKPOINT --format qonnx -o FILE``: the logic is in qnorm.export.qonnx."""
    try:
        from qnorm.export.qonnx import describe, export_checkpoint
    except ModuleNotFoundError as err:
        print(f"qnorm export: QONNX export needs the qonnx extra (pip install -e '.[qonnx]'): {err}", file=sys.stderr)
        return 2
    proto, meta = export_checkpoint(args.checkpoint, args.out, args.batch)
    print(f"{args.checkpoint}: {meta['model']['kind']} {meta['model']['config']}")
    print(f"  wrote {args.out}: {describe(proto)}")
    return 0


def _golden(args: argparse.Namespace) -> int:
    from qnorm.verify import select_cases
    from qnorm.verify.golden_store import DEFAULT_DIR, check, regenerate

    directory = Path(args.dir) if args.dir else DEFAULT_DIR
    cases = select_cases(args.case)
    if args.regenerate:
        manifest = regenerate(directory, cases)
        size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
        total = len(manifest["cases"])
        print(f"wrote {len(cases)} case(s) to {directory}: {total} in the manifest, {size / 1024:.0f} KiB")
        return 0
    problems = check(directory, cases)
    for case in cases:
        print(f"{case.name}: {problems.get(case.name, 'ok')}")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    from qnorm.train.cli import add_train_parser

    parser = argparse.ArgumentParser(prog="qnorm", description="Integer and fixed-point normalization toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="measure every integer op against its float op, train, compile for this CPU and check the "
             "compiled models bit for bit; write out/",
    )  # fmt: skip
    demo.add_argument("--out", default="out", help="directory for the markdown table and the PNG (default: out)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true", help="train for a few epochs only (smoke test)")
    demo.set_defaults(func=_demo)
    add_train_parser(sub)

    verify = sub.add_parser(
        "verify",
        help="bit-exactness of every op x config on golden, qat and each target; exit 1 on any mismatch",
    )
    verify.add_argument(
        "--target", nargs="+", action="extend", metavar="T",
        help="targets/backends to check besides golden and qat (default: every known target)",
    )  # fmt: skip
    verify.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    size = verify.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="10^7 input elements per case instead of 10^5")
    size.add_argument("--elements", type=int, help="input elements per case (default 10^5)")
    verify.add_argument("--case", nargs="+", action="extend", metavar="GLOB", help="only cases matching a glob")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random vectors (default 0)")
    verify.add_argument("--golden-dir", help="golden store directory (default: qnorm/data/golden)")
    verify.set_defaults(func=_verify)

    compile_ = sub.add_parser(
        "compile",
        help="compile a trained checkpoint for a target (proven bit-exact with the QAT model, or refused)",
        description="Freeze, export and prove a checkpoint written by qnorm train exact on power-of-two grids, "
                    "compile it through TVM Relax and write DIR/model.so + DIR/model.json. A model that "
                    "cannot be proven exact (float softmax/GELU, non-power-of-two scales, float biases, "
                    "accumulators past 2^24) is refused with every problem listed.",
    )  # fmt: skip
    compile_.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="checkpoint directory written by qnorm train (safetensors + meta.json)"
    )
    compile_.add_argument(
        "--target", default="x86_64", help="target name: x86_64 (default, the host CPU; x86 works too) compiles the whole model into one "
        "library; fpga-hls writes one HLS project per qnorm layer"
    )
    compile_.add_argument("-o", "--out", metavar="DIR", required=True, help="output directory for model.so and model.json")
    compile_.set_defaults(func=_compile)

    export = sub.add_parser(
        "export",
        help="export a trained checkpoint to QONNX (Brevitas layers as Quant, BN thresholds as MultiThreshold, "
             "qnorm norms as qnorm.custom_op nodes)",
    )  # fmt: skip
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory written by qnorm train")
    export.add_argument("--format", choices=["qonnx"], default="qonnx", help="output format (default: qonnx)")
    export.add_argument("-o", "--out", metavar="FILE", required=True, help="the .onnx file to write")
    export.add_argument("--batch", type=int, default=1, help="the graph's static batch size (default 1)")
    export.set_defaults(func=_export)

    golden = sub.add_parser("golden", help="check qnorm/data/golden against the golden model, or --regenerate it")
    golden.add_argument(
        "--regenerate", action="store_true",
        help="rewrite the stored vectors and manifest from the current golden model (deliberate)",
    )  # fmt: skip
    golden.add_argument("--case", nargs="+", action="extend", metavar="GLOB", help="only cases matching a glob")
    golden.add_argument("--dir", help="golden store directory (default: qnorm/data/golden)")
    golden.set_defaults(func=_golden)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad input / refused config: a clear message, no traceback
        print(f"qnorm: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an optional dependency: name the extra that installs it
        hint = hint_for(err)
        if hint is None:
            raise
        print(f"qnorm: error: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
