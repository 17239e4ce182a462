"""Transformer latency: the compiled integer transformers against the same QAT model in torch.

For each integer transformer of the demo (``transformer-int_ln``: IntLayerNorm,
IntSoftmax, IntGELU; ``llama-int_rms``: IntRMSNorm, IntSoftmax, gated IntSiLU) it
times, at batch 1 (latency) and at the demo's batch (the whole digits test set,
as ``make demo`` runs it; time per sample):

* the model compiled for x86_64 (``compile_model``), called as a user calls it
  (numpy in, numpy out);
* the same QAT model in torch eager (its float32 forward, ``torch.no_grad``);
* ``torch.compile`` of that model; when it fails, the cell holds the error;
* the float transformer (``norm="float"``) in torch eager, for reference.

All sides run one thread (TVM's pool and torch), in interleaved loops measured
by the calling thread's CPU time; ratios are medians of per-round ratios.

Where the compiled model's time goes: each step of the Relax VM's program
(every kernel call) is run and timed on its own through the VM's instrument
hook, a few calls in a row with the cost of calling from Python (measured on a
no-op with the same arguments) taken off, and grouped by op kind.  What the VM
itself spends (dispatch, allocation, shape checks) is the whole VM call less
its steps, and the call wrapper (input checks, numpy <-> TVM tensors) the public
call less the VM call.  The models are the demo's, untrained (timing does not
depend on the weights), calibrated on a batch of digits like the P4 section's.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tvm
from tvm import relax

from benchmarks._machine import describe
from benchmarks._timing import Timing, interleaved, ratio
from benchmarks.bench_compile import calibrated
from benchmarks.bench_kernels import use_threads
from compilers.tvm.graph import CompiledModel, compile_model, kernel_symbol
from qnorm.demo import DEPLOY_MODELS
from qnorm.train.data import load_digits_data

ModelSpec = tuple[str, dict[str, Any]]  # (kind, config) as build_model takes them

MODELS: dict[str, ModelSpec] = {name: DEPLOY_MODELS[name] for name in ("transformer-int_ln", "llama-int_rms")}
REFERENCE: ModelSpec = ("transformer", {"norm": "float"})

COMPILED = "compiled (TVM, x86_64)"
EAGER = "QAT model, torch eager"
TORCH_COMPILE = "QAT model, `torch.compile`"
FLOAT = 'float transformer (`norm="float"`), eager'
WAYS = (COMPILED, EAGER, TORCH_COMPILE, FLOAT)
_VM = "VM call"  # the compiled model's VM program alone: the per-op table's reference

# The per-op groups, in table order; the last two are remainders, not timed steps.
MATMUL = "matmul / dense"
NORM = "norm (IntLayerNorm, IntRMSNorm)"
SOFTMAX = "IntSoftmax"
ACTIVATION = "activation (IntGELU, IntSiLU)"
ELEMENTWISE = "requantize / elementwise"
OTHER = "other kernels (transpose, slice, mean)"
VM_REST = "VM: dispatch, allocation, shape checks"
WRAPPER = "call wrapper: input checks, numpy ↔ TVM tensors"
GROUPS = (MATMUL, NORM, SOFTMAX, ACTIVATION, ELEMENTWISE, OTHER, VM_REST, WRAPPER)
_OP_GROUPS = {"IntLayerNorm": NORM, "L1LayerNorm": NORM, "ShiftLayerNorm": NORM, "IntRMSNorm": NORM,
              "IntSoftmax": SOFTMAX, "IntGELU": ACTIVATION, "IntSiLU": ACTIVATION}  # fmt: skip
# Relax's legalized elementwise ops (a fused function joins their names with "_").
_ELEMENTWISE = re.compile(
    r"(fused_)?((add|subtract|multiply|divide|tir_round|tir_clip|clip|round|floor|maximum|minimum|negative|"
    r"where|astype|cast)_?)+[0-9]*"
)
PROFILE_RUNS = 5  # instrumented runs; each step's time is its median over them
STEP_REPEATS = 10  # calls of a step in a row per timing (a call alone is a few µs at batch 1)

# The VM's instrument protocol: after a "before" hook returns SKIP_RUN, the VM does not run the step.
_NO_OP, _SKIP_RUN = 0, 1


@dataclass(frozen=True)
class Breakdown:
    """Per-call time of the compiled model at one batch, split by op kind."""

    seconds: dict[str, float]  # group -> seconds per call (every group of GROUPS)
    calls: dict[str, int]  # kernel group -> its kernel calls per model call

    @property
    def total_s(self) -> float:
        """The groups' sum: the public call's median, unless a remainder was clipped at 0."""
        return sum(self.seconds.values())

    def share(self, group: str) -> float:
        return self.seconds[group] / self.total_s


@dataclass(frozen=True)
class ModelResult:
    """One integer transformer: its timings per batch, what could not run, and its breakdowns."""

    name: str
    latency: dict[int, dict[str, Timing]]  # batch -> way (of WAYS) -> per-call time
    errors: dict[str, tuple[int, str]]  # way -> the batch it failed at and why (torch.compile failing)
    breakdown: dict[int, Breakdown]  # batch -> where the compiled model's time goes


def step_group(symbol: str, int_ops: Mapping[str, str]) -> str | None:
    """The group of a VM step called ``symbol``; None for the VM's own shape function.

    ``int_ops`` maps each qnorm op's name to its class name (the compiled model's
    ``metadata["datapath"]["int_ops"]``): its kernel is ``kernel_symbol(name)``,
    flanked by that symbol's ``_quantize`` and ``_dequantize`` steps.
    """
    if symbol.startswith("shape_func"):
        return None
    kernels = {kernel_symbol(name): _OP_GROUPS.get(op, OTHER) for name, op in int_ops.items()}
    if symbol in kernels:
        return kernels[symbol]
    if symbol.endswith(("_quantize", "_dequantize")) and symbol.rsplit("_", 1)[0] in kernels:
        return ELEMENTWISE
    if "matmul" in symbol or "dense" in symbol:
        return MATMUL
    if _ELEMENTWISE.fullmatch(symbol):
        return ELEMENTWISE
    return OTHER


def _step_times(
    vm: relax.VirtualMachine, x: tvm.runtime.Tensor, runs: int, repeats: int, clock: Callable[[], float]
) -> tuple[list[str], list[float], np.ndarray]:
    """Each step's symbol and median net time over ``runs`` instrumented runs, and the output.

    The hook runs every kernel step itself (``repeats`` calls in a row, less as
    many calls of a no-op with the same arguments: the cost of calling from
    Python, which the VM does not pay) and tells the VM to skip it.  A step
    writes its outputs from its inputs (destination passing), so calling it again
    rewrites the same values; the caller checks the output anyway.
    """
    nop = tvm.get_global_func("testing.nop")
    run: list[tuple[str, float]] = []  # this run's steps so far

    def hook(func: Any, symbol: str, before: bool, _ret: Any, *args: Any) -> int:
        if not before or symbol.startswith("vm."):  # the VM's builtins return values the VM needs
            return _NO_OP
        start = clock()
        for _ in range(repeats):
            func(*args)
        middle = clock()
        for _ in range(repeats):
            nop(*args)
        run.append((symbol, ((middle - start) - (clock() - middle)) / repeats))
        return _SKIP_RUN

    vm.set_instrument(hook)
    runs_steps: list[list[tuple[str, float]]] = []
    out = np.empty(0)
    for _ in range(runs):
        run.clear()
        out = vm["main"](x).numpy()
        runs_steps.append(list(run))
    symbols = [symbol for symbol, _ in runs_steps[0]]
    if any([symbol for symbol, _ in steps] != symbols for steps in runs_steps):
        raise RuntimeError("the VM ran different steps in two runs of the same input")
    medians = [statistics.median(steps[i][1] for steps in runs_steps) for i in range(len(symbols))]
    return symbols, medians, out


def breakdown(
    compiled: CompiledModel, x: np.ndarray, call: Timing, vm_call: Timing, runs: int, repeats: int,
    clock: Callable[[], float],
) -> Breakdown:
    """Where ``compiled``'s time on ``x`` goes; ``call`` and ``vm_call`` are its public and VM
    call times, measured beside the others."""
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(compiled.library)), tvm.cpu())
    symbols, medians, out = _step_times(vm, tvm.runtime.tensor(x), runs, repeats, clock)
    if not np.array_equal(out, compiled(x)):
        raise RuntimeError("the instrumented VM's output differs from the compiled model's: a step was not "
                           "safe to run again, so its timing is not the model's")
    int_ops = {name: entry["op"] for name, entry in compiled.metadata["datapath"]["int_ops"].items()}
    kernels = dict.fromkeys(GROUPS[:-2], 0.0)
    calls = dict.fromkeys(kernels, 0)
    for symbol, s in zip(symbols, medians, strict=True):
        group = step_group(symbol, int_ops)
        if group is not None:  # None: the VM's shape function, part of the VM's rest
            kernels[group] += max(s, 0.0)
            calls[group] += 1
    # The remainders are differences of medians: noise can make one negative, and it is then 0.
    seconds = {**kernels, VM_REST: max(vm_call.median_s - sum(kernels.values()), 0.0),
               WRAPPER: max(call.median_s - vm_call.median_s, 0.0)}  # fmt: skip
    return Breakdown(seconds, calls)


def error_text(err: BaseException) -> str:
    """One line for a table cell: the error's type, first line and first compiler ``error:`` line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    detail = next((line.split("error:", 1)[1].strip() for line in lines[1:] if "error:" in line), None)
    if detail:
        text += f" ({detail})"
    return text if len(text) <= 240 else text[:239] + "…"


@dataclass(frozen=True)
class Subject:
    """An integer transformer ready to time: the QAT model (eval), its compiled form, torch.compile's."""

    name: str
    model: torch.nn.Module
    compiled: CompiledModel
    torch_compiled: Callable[[torch.Tensor], torch.Tensor]


def _key(name: str, way: str) -> str:
    return f"{name}/{way}"


def measure(
    subjects: list[Subject],
    reference: torch.nn.Module,
    inputs: dict[int, torch.Tensor],
    rounds: int,
    min_loop_s: float,
    profile_runs: int,
    step_repeats: int,
) -> list[ModelResult]:
    """Time every subject's ways and the reference at each batch of ``inputs``, all in one
    interleaved set per batch, then break each compiled model's time down."""
    use_threads(1)
    clock = time.thread_time  # one thread: the calling thread's CPU time
    errors: dict[str, dict[str, tuple[int, str]]] = {s.name: {} for s in subjects}
    measured: dict[int, dict[str, Timing]] = {}
    with torch.no_grad():
        for batch, x in inputs.items():
            xn = x.numpy()
            xt = tvm.runtime.tensor(xn)
            sides: dict[str, Callable[[], object]] = {_key("reference", FLOAT): lambda x=x: reference(x)}
            for s in subjects:
                vm = relax.VirtualMachine(tvm.runtime.load_module(str(s.compiled.library)), tvm.cpu())
                sides[_key(s.name, COMPILED)] = lambda c=s.compiled, xn=xn: c(xn)
                sides[_key(s.name, _VM)] = lambda vm=vm, xt=xt: vm["main"](xt)
                sides[_key(s.name, EAGER)] = lambda m=s.model, x=x: m(x)
                if TORCH_COMPILE in errors[s.name]:
                    continue  # failed at an earlier batch: compiling again would fail the same way
                try:
                    s.torch_compiled(x)  # compiles for this shape
                except Exception as err:  # noqa: BLE001 (any failure of torch.compile is a result to report)
                    errors[s.name][TORCH_COMPILE] = (batch, error_text(err))
                    continue
                sides[_key(s.name, TORCH_COMPILE)] = lambda t=s.torch_compiled, x=x: t(x)
            measured[batch] = interleaved(sides, rounds, min_loop_s, clock)
    results = []
    for s in subjects:
        latency: dict[int, dict[str, Timing]] = {}
        parts: dict[int, Breakdown] = {}
        for batch, times in measured.items():
            mine = {w: times[_key(s.name, w)] for w in (COMPILED, EAGER, TORCH_COMPILE) if _key(s.name, w) in times}
            latency[batch] = {**mine, FLOAT: times[_key("reference", FLOAT)]}
            parts[batch] = breakdown(s.compiled, inputs[batch].numpy(), times[_key(s.name, COMPILED)],
                                     times[_key(s.name, _VM)], profile_runs, step_repeats, clock)
        results.append(ModelResult(s.name, latency, errors[s.name], parts))
    return results


def _time(seconds: float) -> str:
    return f"{1e6 * seconds:,.0f} µs" if seconds < 0.01 else f"{1e3 * seconds:,.1f} ms"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def latency_rows(result: ModelResult, batches: list[int]) -> list[str]:
    rows = []
    for way in WAYS:
        cells = [result.name, way]
        for b in batches:
            times = result.latency[b]
            if way in times:
                cells += [_time(times[way].median_s / b), f"{ratio(times[way], times[COMPILED]):.2f}×"]
            else:
                failed_at, why = result.errors[way]
                cells += [_cell(f"failed: {why}" if failed_at == b else f"not run (failed at batch {failed_at})"), "—"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def transformer_markdown(results: list[ModelResult], rounds: int, min_loop_s: float, test_samples: int) -> str:
    """The section: the latency table, then the per-op share table (``test_samples``: the
    size of the test set, which the larger batch is when it is the demo's)."""
    demo = max(results[0].latency)
    whole = "the whole test set, as `make demo` runs it: " if demo == test_samples else ""
    head = [
        "## Transformer latency: compiled vs the QAT model in torch (eager, `torch.compile`)",
        "",
        (f"Machine: {describe()}; TVM {tvm.__version__}, torch {torch.__version__}; **1 thread** "
         "(TVM's pool and torch). The demo's integer transformers (untrained, calibrated), on digits "
         f"test samples: batch 1 (latency) and batch {demo} ({whole}time per sample). Median per call over {rounds} rounds of interleaved loops ≥ {min_loop_s:g} s; "
         "clock: CPU time of the calling thread; × compiled: medians of per-round ratios to the compiled "
         "model (> 1: slower than it)."),
        "",
        f"| model | runs as | batch 1: latency | × compiled | batch {demo}: time per sample | × compiled |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        head += latency_rows(r, [1, demo])
    columns = [(r, b) for r in results for b in (1, demo)]
    share = [
        "",
        "### Per-op share of the compiled transformers' time",
        "",
        ("Each step of the compiled model's VM program (a kernel call) timed on its own, grouped by op "
         "kind, as a share of the model's call; the last two rows are what the VM call spends beyond its "
         "steps and what the public call spends beyond the VM call. Kernel calls per model call in "
         "parentheses."),
        "",
        "| op kind | " + " | ".join(f"{r.name}, batch {b}" for r, b in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for group in GROUPS:
        cells = []
        for r, b in columns:
            part = r.breakdown[b]
            calls = f" ({part.calls[group]})" if group in part.calls else ""
            cells.append(f"{100 * part.share(group):.0f} %{calls}")
        share.append(f"| {group} | " + " | ".join(cells) + " |")
    share.append("| **total per call** | " + " | ".join(_time(r.breakdown[b].total_s) for r, b in columns) + " |")
    return "\n".join(head + share)


def prepare(name: str, spec: ModelSpec, torch_compile: Callable[[torch.nn.Module], Any]) -> Subject:
    """The calibrated QAT model of ``spec``, compiled for x86_64 (cached in $QNORM_CACHE) and
    wrapped by ``torch_compile`` (lazy: it compiles at the first call)."""
    kind, config = spec
    model = calibrated(kind, config)
    compiled = compile_model(model, model.example_input())
    if not isinstance(compiled, CompiledModel):
        raise TypeError(f"{name}: compile_model gave {type(compiled).__name__}, not a VM library")
    return Subject(name, model, compiled, torch_compile(model))


def section(
    models: Mapping[str, ModelSpec] = MODELS,
    reference: ModelSpec = REFERENCE,
    batch: int | None = None,
    rounds: int = 5,
    min_loop_s: float = 0.5,
    profile_runs: int = PROFILE_RUNS,
    step_repeats: int = STEP_REPEATS,
    torch_compile: Callable[[torch.nn.Module], Any] = torch.compile,
) -> str:
    """The transformer latency section, measured now; ``batch`` None: the whole test set."""
    subjects = [prepare(name, spec, torch_compile) for name, spec in models.items()]
    test = load_digits_data(subjects[0].model.input_layout, seed=0).test.tensors[0]
    demo = len(test) if batch is None else batch
    if not 1 < demo <= len(test):
        raise ValueError(f"batch must be in 2..{len(test)} (the test set), got {demo}")
    inputs = {1: test[:1].contiguous(), demo: test[:demo].contiguous()}
    ref = calibrated(*reference)
    results = measure(subjects, ref, inputs, rounds, min_loop_s, profile_runs, step_repeats)
    return transformer_markdown(results, rounds, min_loop_s, len(test))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-loop", type=float, default=0.5, help="seconds per timed loop")
    parser.add_argument("--out", default="out/bench_transformer.md")
    args = parser.parse_args()
    text = section(rounds=args.rounds, min_loop_s=args.min_loop)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
