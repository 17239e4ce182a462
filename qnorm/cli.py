"""The ``qnorm`` command.

Every subcommand checks its arguments (option values, target and case names,
paths) before it imports torch or tvm, which take seconds: a mistyped command
is answered at once.  A problem the user can fix is a
:class:`~qnorm.errors.QnormError`, printed as one line
``qnorm <cmd>: error: <message>`` on stderr; the exit status is 2 for a usage
error, 1 for any other error or failed check.  ``qnorm --debug <cmd>`` also
prints the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from qnorm.cli_args import output_dir, output_file, positive_int
from qnorm.errors import DeployError, QnormError, UsageError
from qnorm.extras import hint_for

if TYPE_CHECKING:
    from qnorm.verify.cases import Case
    from qnorm.verify.harness import CaseReport, Report

HLS_TARGET = "fpga-hls"
RTL_TARGET = "fpga-rtl"


class _ArgumentError(UsageError):
    """An argparse error, with the parser's name and usage line for the message."""

    def __init__(self, prog: str, usage: str, message: str) -> None:
        super().__init__(message)
        self.prog, self.usage = prog, usage


class _Parser(argparse.ArgumentParser):
    """argparse's errors as exceptions, so :func:`main` reports them like every other
    error (and a caller of ``main`` gets an exit status instead of SystemExit)."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(self.prog, self.format_usage(), message)


# --------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    from qnorm.demo import TRAIN_DIR, DeployMismatchError, run_demo, run_deploy_demo
    from qnorm.train.experiment import run_training

    out = args.out
    run_demo(out, seed=args.seed)
    # Train each norm/neuron kind, fold the integer SNN, print the accuracy table.
    # A folded SNN that predicts differently raises FoldMismatchError (non-zero exit).
    table = run_training(out / TRAIN_DIR, seed=args.seed, quick=args.quick, jobs=1 if args.quick else 2)
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


# --------------------------------------------------------------------------- verify


def _verify(args: argparse.Namespace) -> int:
    # The catalogue, the registry and the harness load neither torch nor tvm: names are
    # checked and --list answered before any backend prepares (and imports) anything.
    from qnorm.verify.cases import select_cases
    from qnorm.verify.golden_store import DEFAULT_DIR
    from qnorm.verify.harness import resolve_columns, verify
    from qnorm.verify.vectors import DEFAULT_ELEMENTS, FULL_ELEMENTS

    columns = resolve_columns(args.target)
    cases = select_cases(args.case)
    if args.list:
        return _list(cases, columns, args.json)
    elements = args.elements if args.elements is not None else FULL_ELEMENTS if args.full else DEFAULT_ELEMENTS
    golden_dir = args.golden_dir if args.golden_dir is not None else DEFAULT_DIR
    _note(f"qnorm verify: {len(cases)} cases x {len(columns)} columns ({', '.join(columns)}), "
          f">= {elements} input elements per case")  # fmt: skip
    report = verify(cases, columns, elements, args.seed, golden_dir, _progress)
    _print_report(report, args.json)
    if not report.ok:
        return 1
    if args.strict and report.unproven:
        counts = Counter((name, cell.status) for _, name, cell in report.unproven)
        listed = ", ".join(f"{name}: {n} {status}" for (name, status), n in counts.items())
        _note(f"qnorm verify: FAILED (--strict): {len(report.unproven)} cell(s) not proven here ({listed})")
        return 1
    return 0


def _print_report(report: Report, as_json: bool) -> None:
    if not as_json:
        print(report.matrix())
        return
    print(json.dumps(report.to_json(), indent=1))
    for case_report, name, cell in report.failures:  # the first mismatching input, for humans too
        detail = cell.mismatch.describe() if cell.mismatch is not None else cell.reason
        print(f"FAIL {case_report.case.name} × {name}: {detail}", file=sys.stderr)


def _list(cases: list[Case], columns: list[str], as_json: bool) -> int:
    from qnorm.verify.listing import column_plan, listing_json, listing_text

    plans = [column_plan(name) for name in columns]
    print(json.dumps(listing_json(cases, plans), indent=1) if as_json else listing_text(cases, plans))
    return 0


def _progress(report: CaseReport, i: int, n: int) -> None:
    """One line per finished case on stderr, flushed: a CI log shows a long run advancing
    (a terminal gets the same lines)."""
    _note(f"[{i}/{n}] {report.case.name}: {report.summary()} ({report.seconds:.1f} s)")


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- compile


def _compile(args: argparse.Namespace) -> int:
    from qnorm.targets import C_API_TARGETS, compile_target_name
    from qnorm.train.checkpoint_meta import checkpoint_dir, read_metadata

    target = compile_target_name(args.target)
    if args.c_api and target not in C_API_TARGETS:
        raise UsageError(f"--c-api builds the C API for {', '.join(C_API_TARGETS)}, not {target}")
    if args.skip_unsupported and target != RTL_TARGET:
        raise UsageError(f"--skip-unsupported leaves layers out of the {RTL_TARGET} RTL, not of {target}")
    read_metadata(checkpoint_dir(args.checkpoint))  # a missing or corrupt checkpoint fails before the imports
    _import_models(args.imports)
    if target == HLS_TARGET:
        return _compile_hls(args)
    if target == RTL_TARGET:
        return _compile_rtl(args)
    from qnorm.train.compiled import compile_checkpoint

    compiled, source = compile_checkpoint(args.checkpoint, target, args.c_api)
    out = compiled.save(args.out, source=source)
    meta = json.loads((out / "model.json").read_text())
    target_meta = meta["target"]
    state = "cache hit" if compiled.cache_hit else "compiled"
    print(f"{args.checkpoint}: {source['model']['kind']} {source['model']['config']}")
    print(f"  {meta['exactness']['summary']}")
    check = meta["acceptance"]
    if check["status"] == "passed":
        print(f"  acceptance: {check['samples']} check inputs, every output bit-equal to the frozen program's")
    else:
        print(f"  acceptance not run here: {check['why']}")
    cpu = target_meta["tvm"].get("mcpu", target_meta["tvm"]["kind"])
    print(f"  {state} for {target_meta['name']} ({cpu}) in {compiled.seconds:.2f} s")
    if "files" in meta:  # the C API
        print(f"  wrote {', '.join(str(out / name) for name in meta['files'])} and {out / 'model.json'}")
        print(f"  integers: {meta['input']['dtype']} input {meta['input']['shape'][1:]} "
              f"(x = k * {meta['input']['format']['scale']!r}) -> int32 output {meta['output']['shape'][1:]} "
              f"(y = k * 2^{meta['output']['format']['grid_exp']})")  # fmt: skip
    else:
        print(f"  wrote {out / 'model.so'} (sha256 {meta['library']['sha256'][:16]}...) and {out / 'model.json'}")
    return 0


# --------------------------------------------------------------------------- run


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    if not (args.dir / "model.json").is_file():
        raise UsageError(f"{args.dir} is not a compiled model directory (no model.json): see qnorm compile")
    try:
        x = np.load(args.input, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read {args.input} as a .npy array: {err}") from err
    from compilers.tvm.graph import load_compiled
    from compilers.tvm.run import classes, output_integers

    try:
        model = load_compiled(args.dir, args.target)
        outputs = output_integers(model, x)
    except (ValueError, RuntimeError) as err:  # a refused directory or input; a runner that failed
        raise DeployError(str(err)) from err
    predicted = classes(outputs)
    meta = model.metadata
    name = meta["target"]["name"]
    where = {"x86_64": "natively", "opencl": "on the OpenCL device"}.get(name, f"under {name} emulation")
    print(f"{args.dir}: {meta['target']['name']} model, {len(outputs)} sample(s) run {where}; "
          f"outputs are integers k, y = k * 2^{meta['output']['format']['grid_exp']}")  # fmt: skip
    if args.output is not None:
        np.save(args.output, outputs)
        print(f"  wrote {args.output}: int32 {tuple(outputs.shape)}")
        print("  classes: " + " ".join(map(str, predicted)))
        return 0
    for i, (row, cls) in enumerate(zip(outputs.reshape(len(outputs), -1), predicted, strict=True)):
        print(f"  {i}: class {cls}  {' '.join(map(str, row))}")
    return 0


def _compile_hls(args: argparse.Namespace) -> int:
    """One Vitis HLS project per qnorm layer of the checkpoint (the linears stay on the host)."""
    from compilers.fpga.csim import CsimError, acceptance
    from compilers.fpga.hls import TARGET, write_hls_projects
    from qnorm.deploy import integer_ops
    from qnorm.targets import load_target
    from qnorm.train.checkpoint import load_checkpoint

    model, meta = load_checkpoint(args.checkpoint)
    ops = integer_ops(model)
    if not ops:
        raise DeployError(f"{args.checkpoint} has no qnorm integer layer to put on the FPGA")
    projects = write_hls_projects(ops, args.out)  # TargetLimitError (a QnormError) if the FPGA cannot run one
    print(f"{args.checkpoint}: {meta['model']['kind']} {meta['model']['config']}")
    target = load_target(TARGET)
    for name, path in projects.items():
        print(f"  {name}: {ops[name].name} -> {path} (vitis_hls -f {path / 'run_hls.tcl'})")
        try:  # every project's C simulation on its golden vectors before anyone synthesizes it
            print(f"    C simulation: {acceptance(path, target)}")
        except CsimError as err:
            raise DeployError(str(err)) from err
    return 0


def _compile_rtl(args: argparse.Namespace) -> int:
    """One RTL folder per qnorm layer of the checkpoint: Verilog, testbench, yosys script, README."""
    from compilers.rtl import icarus
    from compilers.rtl.layers import rtl_layers
    from compilers.rtl.project import METADATA, module_name, write_rtl_projects
    from qnorm.targets import load_target
    from qnorm.train.checkpoint import load_checkpoint

    model, meta = load_checkpoint(args.checkpoint)
    layers, skipped = rtl_layers(model, load_target(RTL_TARGET), args.skip_unsupported)
    source = {"checkpoint": str(args.checkpoint), "model": meta["model"], "weights_sha256": meta["weights"]["sha256"]}
    folders = write_rtl_projects(layers, args.out, source, skipped)
    print(f"{args.checkpoint}: {meta['model']['kind']} {meta['model']['config']}")
    for layer in layers:
        unit = layer.unit
        print(f"  {layer.name}: {layer.layer_class} ({unit.op.name}) -> {folders[layer.name]} "
              f"(latency {unit.latency}, {unit.cycles_per_row} cycles per {'row' if unit.row_length > 1 else 'element'})")  # fmt: skip
        try:  # every folder's own testbench before anyone synthesizes it
            print(f"    Icarus Verilog: {icarus.acceptance(folders[layer.name], module_name(layer.name))}")
        except icarus.RtlSimError as err:
            raise DeployError(str(err)) from err
    for left_out in skipped:
        print(f"  {left_out.name}: {left_out.layer_class} left out ({left_out.reason})")
    print(f"  wrote {args.out / METADATA}")
    return 0


def _import_models(modules: list[str]) -> None:
    """Import the modules ``--import`` names: they register models of the user's own
    (``qnorm.train.models.register_model``).  The user names them on the command
    line; a checkpoint never does (it is data, not code)."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise UsageError(f"--import {name}: {err} (is its directory on PYTHONPATH?)") from None


def _add_import_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import", dest="imports", metavar="MODULE", action="append", default=[],
        help="import MODULE first: it registers a model class of your own (qnorm.train.models.register_model); "
             "repeatable",
    )  # fmt: skip


def _export(args: argparse.Namespace) -> int:
    """``qnorm export CHECKPOINT --format qonnx -o FILE``: the logic is in qnorm.export.qonnx."""
    from qnorm.train.checkpoint_meta import checkpoint_dir, read_metadata

    read_metadata(checkpoint_dir(args.checkpoint))  # a missing or corrupt checkpoint fails before the imports
    _import_models(args.imports)
    from qnorm.export.qonnx import describe, export_checkpoint  # a missing qonnx: main names the extra

    proto, meta = export_checkpoint(args.checkpoint, args.out, args.batch)
    print(f"{args.checkpoint}: {meta['model']['kind']} {meta['model']['config']}")
    print(f"  wrote {args.out}: {describe(proto)}")
    return 0


# --------------------------------------------------------------------------- golden


def _golden(args: argparse.Namespace) -> int:
    from qnorm.verify.cases import select_cases
    from qnorm.verify.golden_store import DEFAULT_DIR, check, regenerate

    directory = args.dir if args.dir is not None else DEFAULT_DIR
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


# --------------------------------------------------------------------------- synth


def _synth(args: argparse.Namespace) -> int:
    """``qnorm synth``: the logic is in compilers.rtl.report."""
    from compilers.rtl.report import write_report  # a missing amaranth: main names the extra
    from qnorm.verify.cases import case_named

    paths = write_report(args.out, case_named, quick=args.quick, progress=_note, patterns=args.unit,
                         families=args.family)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _add_synth_parser(sub: Any) -> None:
    synth = sub.add_parser(
        "synth",
        help="synthesize every RTL unit for xc7, xcup, ecp5 and ice40 (place and route where open tools "
             "exist); write the resource / Fmax table and a PNG",
    )  # fmt: skip
    synth.add_argument(
        "--out", type=output_file, default=Path("out/fpga.md"),
        help="the markdown table to write; the PNG goes beside it (default: out/fpga.md)",
    )  # fmt: skip
    synth.add_argument("--quick", action="store_true", help="rows of 64 only, and no xcup (the slowest flow)")
    synth.add_argument(
        "--unit", action="append", default=[], metavar="PATTERN",
        help="only the units whose name matches this shell pattern, e.g. '*.int8.n768*' (repeatable)",
    )  # fmt: skip
    synth.add_argument(
        "--family", action="append", default=[], metavar="FAMILY",
        help="only this FPGA family: xc7, xcup, ecp5 or ice40 (repeatable; default: all, or --quick's)",
    )  # fmt: skip
    synth.set_defaults(func=_synth)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from qnorm.train.cli import add_train_parser

    parser = _Parser(prog="qnorm", description="Integer and fixed-point normalization toolkit")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not just its message")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="measure every integer op against its float op, train, compile for this CPU and check the "
             "compiled models bit for bit; write out/",
    )  # fmt: skip
    demo.add_argument(
        "--out", type=output_dir, default="out", help="directory for the markdown table and the PNG (default: out)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true", help="train for a few epochs only (smoke test)")
    demo.set_defaults(func=_demo)
    add_train_parser(sub)
    _add_verify_parser(sub)
    _add_synth_parser(sub)

    compile_ = sub.add_parser(
        "compile",
        help="compile a trained checkpoint for a target (proven bit-exact with the QAT model, or refused)",
        description="Freeze, export and prove a checkpoint written by qnorm train exact on power-of-two grids, "
                    "compile it through TVM Relax and write DIR/model.so + DIR/model.json (for aarch64 and riscv64, "
                    "and x86_64 with --c-api: a static C library, its header and a runner). A model that "
                    "cannot be proven exact (float softmax/GELU, non-power-of-two scales, float biases, "
                    "accumulators past 2^24) is refused with every problem listed.",
    )  # fmt: skip
    compile_.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="checkpoint directory written by qnorm train (safetensors + meta.json)"
    )
    compile_.add_argument(
        "--target", default="x86_64", help="target name: x86_64 (default, the host CPU; x86 works too) compiles the whole model into one "
        "library; aarch64 and riscv64 into a C library and runner for a board; opencl into an OpenCL program and "
        "launch plan; cuda into CUDA source, PTX and cubins; fpga-hls writes one HLS project per qnorm layer; "
        "fpga-rtl one folder per qnorm layer (Verilog, self-checking testbench with golden vectors, yosys script)"
    )  # fmt: skip
    compile_.add_argument(
        "-o", "--out", metavar="DIR", type=output_dir, required=True,
        help="output directory for model.so (or the C API's files) and model.json (created; must not be a file)",
    )  # fmt: skip
    compile_.add_argument(
        "--c-api", action="store_true",
        help="x86_64: build the C API (libqnorm_model.a, qnorm_model.h, qnorm_run) instead of model.so; "
             "aarch64 and riscv64 always get it",
    )  # fmt: skip
    compile_.add_argument(
        "--skip-unsupported", action="store_true",
        help="fpga-rtl: leave out the layers that have no RTL unit (float norms and neurons), "
             "listed in rtl.json, instead of refusing the model",
    )  # fmt: skip
    _add_import_argument(compile_)
    compile_.set_defaults(func=_compile)

    run = sub.add_parser(
        "run",
        help="run a compiled model on a .npy array here (natively, or under qemu-user for aarch64/riscv64): "
             "print or write the output integers and the predicted classes",
    )  # fmt: skip
    run.add_argument("dir", metavar="DIR", type=Path, help="directory written by qnorm compile")
    run.add_argument(
        "--input", metavar="X.npy", type=Path, required=True,
        help="(batch, ...) integers of the model's input grid, or float32 values its first quantizer rounds",
    )  # fmt: skip
    run.add_argument("--output", metavar="Y.npy", type=Path, help="write the int32 outputs here instead of printing")
    run.add_argument("--target", help="refuse to run unless the model was compiled for this target")
    run.set_defaults(func=_run)

    export = sub.add_parser(
        "export",
        help="export a trained checkpoint to QONNX (Brevitas layers as Quant, BN thresholds as MultiThreshold, "
             "qnorm norms as qnorm.custom_op nodes)",
    )  # fmt: skip
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory written by qnorm train")
    export.add_argument("--format", choices=["qonnx"], default="qonnx", help="output format (default: qonnx)")
    export.add_argument("-o", "--out", metavar="FILE", required=True, help="the .onnx file to write")
    export.add_argument("--batch", type=positive_int, default=1, help="the graph's static batch size (default 1)")
    _add_import_argument(export)
    export.set_defaults(func=_export)

    golden = sub.add_parser("golden", help="check qnorm/data/golden against the golden model, or --regenerate it")
    golden.add_argument(
        "--regenerate", action="store_true",
        help="rewrite the stored vectors and manifest from the current golden model (deliberate)",
    )  # fmt: skip
    golden.add_argument("--case", nargs="+", action="extend", metavar="GLOB", help="only cases matching a glob")
    golden.add_argument("--dir", type=Path, help="golden store directory (default: qnorm/data/golden)")
    golden.set_defaults(func=_golden)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def _add_verify_parser(sub: Any) -> None:
    verify = sub.add_parser(
        "verify",
        help="bit-exactness of every op x config on golden, qat and each target; exit 1 on any mismatch",
    )
    verify.add_argument(
        "--target", nargs="+", action="extend", metavar="T",
        help="targets/backends to check besides golden and qat (default: every known target)",
    )  # fmt: skip
    verify.add_argument("--json", action="store_true", help="machine-readable report (or --list) on stdout")
    size = verify.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="10^7 input elements per case instead of 10^5")
    size.add_argument("--elements", type=positive_int, help="input elements per case (default 10^5)")
    verify.add_argument("--case", nargs="+", action="extend", metavar="GLOB", help="only cases matching a glob")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random vectors (default 0)")
    verify.add_argument("--golden-dir", type=Path, help="golden store directory (default: qnorm/data/golden)")
    verify.add_argument(
        "--list", action="store_true",
        help="list the cases and the columns (whether each can run here, and why not) without running anything",
    )  # fmt: skip
    verify.add_argument(
        "--strict", action="store_true",
        help="a skip or compiled cell is a failure too (exit 1): every chosen column must run every case here",
    )  # fmt: skip
    verify.set_defaults(func=_verify)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, reporting an unrecognized argument as its subcommand's error (argparse
    itself blames the top-level parser)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run ``qnorm`` with ``argv`` (default: the command line); returns the exit status."""
    try:
        args = _parse(build_parser(), argv)
    except _ArgumentError as err:
        sys.stderr.write(err.usage)
        print(f"{err.prog}: error: {err}", file=sys.stderr)
        return err.exit_code
    try:
        return args.func(args)
    except QnormError as err:
        if args.debug:
            traceback.print_exc()
        print(f"qnorm {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except ImportError as err:  # an optional dependency: name the extra that installs it
        hint = hint_for(err)
        if hint is None:
            raise
        if args.debug:
            traceback.print_exc()
        print(f"qnorm {args.command}: error: {hint}", file=sys.stderr)
        return UsageError.exit_code


if __name__ == "__main__":
    sys.exit(main())
