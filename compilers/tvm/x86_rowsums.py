"""The norms' row sums in the x86 instructions LLVM does not pick: a target-specific rewrite of scheduled TIR.

Why.  The statistics pass sums each int8 row once or twice before the element pass
can start; from TE, LLVM widens every byte to int32 and multiplies in int32 lanes
(``vpmovsxbd``, ``vpmulld``, ``vpaddd``: 20 instructions per 32 inputs for IntLayerNorm's
Σx and Σx², 20 more for L1's Σ|N·x − S|).  x86 has an instruction for each of these
sums, and each gives the same integers:

* **Σx²** (IntLayerNorm, ShiftLayerNorm, IntRMSNorm): ``vpmaddwd`` multiplies 16-bit
  lanes and adds adjacent pairs into int32 — x² + x'² per lane, at most 2^15 for int8.
  Per 32 inputs: two ``vpmovsxbw``, two ``vpmaddwd`` and two ``vpaddd`` into int32
  accumulators.  Only where the op keeps the sum in int32 (its range analysis proved
  the row's total fits): every lane's partial sum of non-negative terms is at most the
  total, so no lane can wrap.
* **Σx** (all four norms): Σx = Σ|x + 128| − 128·N, one ``vpsadbw`` (sum of absolute
  byte differences into 64-bit lanes) per chunk of x ^ 0x80 against 0.
* **Σ|N·x − S|** (L1LayerNorm's second pass): with t = ⌊S/N⌋ and D = S − N·t
  (0 ≤ D < N), for every integer x, with m = x − t,

      |N·x − S| = |N·m − D| = (N − D)·|m| + D·|m − 1|

  (m ≥ 1: both sides are N·m − D; m ≤ 0: both are D − N·m).  So

      Σ|N·x − S| = (N − D)·Σ|x − t| + D·Σ|x − t − 1|,

  and Σ|x − τ| over int8 x, for τ in [−128, 127], is ``vpsadbw`` of x ^ 0x80 against
  the byte τ + 128 (both shifted into unsigned bytes by the same 128).  A τ outside
  the int8 range (t + 1 = 128, or any t of a sum S that is not Σx) is clamped to τc,
  and |τ − τc| added per element: every x then lies on one side of τ, so
  |x − τ| = |x − τc| + |τ − τc|.

A chunk is 32 bytes with AVX2 and 64 with AVX-512BW.  After a row's whole chunks, the
``vpsadbw`` sums take a 32-byte (AVX2) and a 16-byte (SSE2) piece where the remainder
holds them, so at most 15 elements are summed as written (scalar); Σx² sums its
remainder of N mod (chunk bytes) as written.  A scalar remainder of 32 elements had made
L1's kernel slower than its TE form (20480×160 at x86-64-v4, Zen 4: 1,096 against
805 µs; with the pieces 590 µs).

LLVM does not form these instructions from the TE reductions, and TVM 0.27's
``tensorize`` crashes on them, so each reduction's loop is replaced after scheduling
by a block that calls the LLVM intrinsics.  The target is only known where the module
is built, so :func:`rewrite` runs there (:func:`compilers.tvm.build.build` and the
whole-model compile in :mod:`compilers.tvm.graph`), before the build-cache key is
taken, so the key is of the rewritten text.  It matches strictly: a serial loop over
k in [0, N) whose body is one reduction block, or a sequence of them (IntLayerNorm
sums x² and x in one loop), each over k (N the reduction's extent, x an int8
(rows, M ≥ N) buffer: a partial RMS norm sums the first N columns) accumulating
``int(x[r, k])``, ``int(x[r, k])·int(x[r, k])`` or ``|int(x[r, k])·N − S[r]|`` with the
absolute value as TIR writes it (a Select); every block of the loop must match.  Anything else, and every target without AVX2
(aarch64, riscv64, GPUs, C), is left as it is.

Measured (AMD EPYC Zen 3, AVX2, 1 thread, whole int8 kernels interleaved with their
TE form on a shared machine): see :data:`MIN_ROW`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
import tvm.s_tir
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

from qnorm.targets import Target

_REDUCE = 2  # IterVar.iter_type of a reduction axis
_LANE_BITS = 64  # vpsadbw sums each 8 bytes into one 64-bit lane
# (CPU feature, chunk bytes, the vpsadbw and vpmaddwd intrinsics), widest first; a
# target uses the first it has
_AVX2_SAD = "llvm.x86.avx2.psad.bw"
_FORMS: tuple[tuple[str, int, str, str], ...] = (
    ("avx512bw", 64, "llvm.x86.avx512.psad.bw.512", "llvm.x86.avx512.pmaddw.d.512"),
    ("avx2", 32, _AVX2_SAD, "llvm.x86.avx2.pmadd.wd"),
)
# The narrower vpsadbw forms every AVX2 target has, (bytes, intrinsic), widest first: a
# row's remainder after its whole chunks takes each that fits once, so no more than 15
# elements are left to the scalar tail
_PIECES: tuple[tuple[int, str], ...] = ((32, _AVX2_SAD), (16, "llvm.x86.sse2.psad.bw"))
# Rows shorter than this keep the TE reductions of a loop with a Σx² (L1's sums:
# MIN_SAD_ROW below).  First measured for L1 on the AVX2 host (Zen 3), whole kernels
# rewritten against TE, interleaved: 1.13-1.19x at N = 768, 1.24x at 4096, 1.11x at 256,
# 1.02-1.04x at 128; at 64, where the blocked schedule of short rows (16 rows a block,
# compilers.tvm.cpu) kept the TE passes cheap, 0.96-0.98x then (before the pieces).  Against
# IntLayerNorm the rewritten L1 kernel ran 1.10-1.12x at 768 and 1.08-1.11x at 4096
# (the TE one 0.92-0.99x and 0.87-0.89x).  The vpmaddwd Σx² (with Σx): IntLayerNorm
# 2.95x -> 3.30x torch's float LayerNorm at 4096x768 and 2.84x -> 3.41x at 1024x4096
# (make bench, before and after); at 64 it measured 1.04x (IntLayerNorm) and 1.00x
# (IntRMSNorm) against TE, within the noise, so those rows keep TE too.  That holds for
# every loop with a Σx²; on the Zen 4 host (AMD EPYC, interleaved) IntLayerNorm's fused
# loop measured 0.96x at 64 and at 96 at x86-64-v4.
MIN_ROW = 128
# Rows shorter than this keep L1's TE reductions (its vpsadbw sums, with the narrower
# pieces).  Zen 4 host, interleaved against TE, whole kernels: 1.13-1.14x at 64, 1.08x
# at 96, 1.36x at 160 at x86-64-v4; 1.02x, 1.07x, 1.23x at x86-64-v3; at 32 and 48 even
# at v4 and 0.92x at v3.
MIN_SAD_ROW = 64


def _min_row(m: _RowSum) -> int:
    """The shortest row whose sum ``m`` is rewritten."""
    return MIN_ROW if m.kind == SQUARES else MIN_SAD_ROW


@dataclass(frozen=True)
class SumForm:
    """How one target sums a row: ``chunk`` bytes per ``vpsadbw`` call (``intrinsic``)
    and per two ``vpmaddwd`` calls (``madd``, each on half the chunk widened to int16)."""

    chunk: int
    intrinsic: str
    madd: str

    @property
    def lanes(self) -> int:
        """The 64-bit lanes of one ``vpsadbw``."""
        return self.chunk * 8 // _LANE_BITS

    @property
    def madd_lanes(self) -> int:
        """The int32 lanes of one ``vpmaddwd`` (on chunk / 2 int16 values)."""
        return self.chunk // 4


def sum_form(target: Target) -> SumForm | None:
    """The row-sum instructions ``target`` has, or None (not an llvm x86 target with AVX2)."""
    spec = target.tvm_spec()
    if spec.get("kind") != "llvm":
        return None
    tvm_target = tvm.target.Target(spec)
    for feature, chunk, intrinsic, madd in _FORMS:
        if codegen.target_has_features(feature, tvm_target):
            return SumForm(chunk, intrinsic, madd)
    return None


def rewrite(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """``mod`` with every matched row sum (module docstring) of every PrimFunc in
    ``vpsadbw`` / ``vpmaddwd`` form for ``target``; ``mod`` itself (unchanged, the same
    object) where nothing matches or the target has no such form."""
    form = sum_form(target)
    if form is None:
        return mod
    changed = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            new = rewrite_func(func, form)
            if new is not func:
                changed[gv] = new
    if not changed:
        return mod
    out = mod.clone()
    for gv, func in changed.items():
        out.update_func(gv, func)
    return out


def rewrite_func(func: tirx.PrimFunc, form: SumForm) -> tirx.PrimFunc:
    """``func`` with its matched reduction loops replaced (``func`` when none match)."""
    hits = []

    def mutate(node: Any, mutator: tvm_ffi.StructuralMutator) -> Any:
        if isinstance(node, tirx.For):
            found = _match(node)
            if found and all(m.n >= _min_row(m) and _supported(m) for m in found):
                hits.extend(found)
                blocks = [_sad_realize(m, form) for m in found]
                return blocks[0] if len(blocks) == 1 else tirx.SeqStmt(blocks)
        return mutator.default_mutate(node)

    body = tvm_ffi.structural_mutate(func.body, mutate)
    return func.with_body(body) if hits else func


# --------------------------------------------------------------------------- matching


SUM, SQUARES, ABS = "sum", "squares", "abs"  # Σx, Σx², Σ|N·x − S|


@dataclass(frozen=True)
class _RowSum:
    """A matched ``acc[r] (+)= Σ_k term`` reduction block: ``kind`` says which term
    (SUM ``x[r, k]``, SQUARES ``x[r, k]²``, ABS ``|int(x[r, k])·N − S|``)."""

    realize: Any  # the reduction block's SBlockRealize (its row binding and predicate)
    row: tirx.Var  # the block's row axis
    x: Any  # the int8 (rows, N) buffer
    centre: Any  # S, in the block's terms (a load of v_r, maybe cast); None unless ABS
    acc: Any  # the accumulator buffer
    n: int
    has_init: bool  # the block zeroes acc itself (else a decomposed init block did)
    kind: str = SUM


def _supported(m: _RowSum) -> bool:
    """Whether the rewrite keeps ``m`` exact: squares only into an int32 accumulator (the
    op proved the row's total fits it, which bounds every lane's partial sum)."""
    return m.kind != SQUARES or str(m.acc.dtype) == "int32"


def _match(loop: tirx.For) -> list[_RowSum] | None:
    """The row reductions whose loop is ``loop`` — its body one reduction block or a
    sequence of them, every one matching — or None."""
    if not (loop.kind == tirx.ForKind.SERIAL and _is_int(loop.min, 0) and isinstance(loop.extent, tirx.IntImm)):
        return None
    body = loop.body
    realizes = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    found = [_match_block(realize, loop) for realize in realizes]
    return None if any(m is None for m in found) else found  # type: ignore[return-value]


def _match_block(realize: Any, loop: tirx.For) -> _RowSum | None:
    """The row reduction of one block of ``loop``, if it is one of the three forms.

    Every piece is checked: the loop runs k over [0, N) serially, binding the
    block's reduction axis directly; the block writes one accumulator element per
    row; its update is ``acc[r] + int(x[r, k])`` (x int8), ``acc[r] +
    int(x[r, k])·int(x[r, k])``, or ``acc[r] + |int(x[r, k])·N − S|`` with the absolute
    value exactly as TIR lowers ``abs`` (``Select(0 <= e, e, S − int(x)·N)``).
    """
    if not isinstance(realize, tvm.s_tir.SBlockRealize):
        return None
    n = int(loop.extent)
    block = realize.block
    if len(block.iter_vars) != 2 or block.alloc_buffers or block.match_buffers:
        return None
    row_iv, k_iv = block.iter_vars
    if row_iv.iter_type == _REDUCE or k_iv.iter_type != _REDUCE:
        return None
    if not (_is_int(k_iv.dom.min, 0) and _is_int(k_iv.dom.extent, n)):
        return None
    if not realize.iter_values[1].same_as(loop.loop_var):
        return None
    # the row and the predicate must hold for the whole row: the new block has no k
    if any(v.same_as(loop.loop_var) for e in (realize.iter_values[0], realize.predicate)
           for v in tirx.analysis.undefined_vars(e)):
        return None
    row, k = row_iv.var, k_iv.var
    store = block.body
    if not (isinstance(store, tirx.BufferStore) and _indexes(store.indices, [row])):
        return None
    acc = store.buffer
    acc_dtype = str(acc.dtype)
    if acc_dtype not in ("int16", "int32", "int64"):
        return None
    has_init = block.init is not None
    if has_init and not _zeroes(block.init, acc, row):
        return None
    value = store.value
    if not isinstance(value, tirx.Add) or not _loads(value.a, acc, [row]):
        return None
    term = value.b
    if isinstance(term, tirx.Cast) and _dtype(term) == acc_dtype:
        term = term.value
    if _row_element(term, row, k, n):
        return _RowSum(realize, row, term.source, None, acc, n, has_init)
    if _square_of_element(term, acc_dtype, row, k, n):
        return _RowSum(realize, row, term.a.value.source, None, acc, n, has_init, SQUARES)
    parts = _abs_of_centered(term, row, k, n)
    if parts is None:
        return None
    x, centre = parts
    return _RowSum(realize, row, x, centre, acc, n, has_init, ABS)


def _square_of_element(term: Any, dtype: str, row: tirx.Var, k: tirx.Var, n: int) -> bool:
    """``term`` is ``int(x[row, k])·int(x[row, k])``, both factors widened to ``dtype``."""
    if not (isinstance(term, tirx.Mul) and tvm_ffi.structural_equal(term.a, term.b)):
        return False
    widened = term.a
    return isinstance(widened, tirx.Cast) and _dtype(widened) == dtype and _row_element(widened.value, row, k, n)


def _abs_of_centered(term: Any, row: tirx.Var, k: tirx.Var, n: int) -> tuple[Any, Any] | None:
    """(x, S) when ``term`` is ``|int(x[row, k])·n − S|`` as TIR writes ``abs``."""
    if not isinstance(term, tirx.Select):
        return None
    e = term.true_value
    dtype = _dtype(e)
    if dtype not in ("int32", "int64") or not (isinstance(e, tirx.Sub) and isinstance(e.a, tirx.Mul)):
        return None
    widened, scale, sum_expr = e.a.a, e.a.b, e.b
    if not (_is_int(scale, n) and isinstance(widened, tirx.Cast) and _dtype(widened) == dtype):
        return None
    load = widened.value
    if not _row_element(load, row, k, n) or not _per_row(sum_expr, row):
        return None
    zero = tirx.const(0, dtype)
    want_cond = tirx.LE(zero, e)
    want_neg = tirx.Sub(sum_expr, e.a)
    if not (tvm_ffi.structural_equal(term.condition, want_cond) and tvm_ffi.structural_equal(term.false_value, want_neg)):
        return None
    return load.source, sum_expr


def _row_element(expr: Any, row: tirx.Var, k: tirx.Var, n: int) -> bool:
    """``expr`` is ``x[row, k]`` of an int8 (rows, M) buffer, M >= n (a partial RMS norm
    sums the first n of its M columns)."""
    if not isinstance(expr, tvm.ir.expr.TensorLoad) or str(expr.source.dtype) != "int8":
        return False
    x = expr.source
    width = x.shape[1] if len(x.shape) == 2 else None
    return isinstance(width, tirx.IntImm) and int(width) >= n and _indexes(expr.indices, [row, k])


def _per_row(expr: Any, row: tirx.Var) -> bool:
    """``expr`` is a load of one per-row value at ``row``, maybe cast (S of the row)."""
    if isinstance(expr, tirx.Cast):
        expr = expr.value
    return (
        isinstance(expr, tvm.ir.expr.TensorLoad)
        and _dtype(expr) in ("int8", "int16", "int32", "int64")
        and _indexes(expr.indices, [row])
    )


def _loads(expr: Any, buffer: Any, index: list[tirx.Var]) -> bool:
    return isinstance(expr, tvm.ir.expr.TensorLoad) and expr.source.same_as(buffer) and _indexes(expr.indices, index)


def _indexes(indices: Any, want: list[tirx.Var]) -> bool:
    return len(indices) == len(want) and all(i.same_as(w) for i, w in zip(indices, want, strict=True))


def _zeroes(init: Any, acc: Any, row: tirx.Var) -> bool:
    return isinstance(init, tirx.BufferStore) and init.buffer.same_as(acc) and _indexes(init.indices, [row]) and _is_int(init.value, 0)


def _dtype(expr: Any) -> str:
    return str(expr.ty)


def _is_int(expr: Any, value: int) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr) == value


# --------------------------------------------------------------------------- the psadbw block


def _sad_realize(m: _RowSum, form: SumForm) -> tvm.s_tir.SBlockRealize:
    """A block computing the matched accumulator element with ``form`` (module docstring).

    Its row axis, binding and predicate are the reduction block's; it reads the
    whole row of x and writes the accumulator element.
    """
    old = m.realize.block
    r = tirx.Var("v_r", m.row.ty)
    body, scratch = _sad_body(m, form, r)
    reads = [m.x[r, 0 : m.n]]
    reads += [_rename(reg, m.row, r) for reg in old.reads if not (reg.source.same_as(m.x) or reg.source.same_as(m.acc))]
    if not m.has_init:
        reads.append(m.acc[r : r + 1])
    row_iv = old.iter_vars[0]
    block = tvm.s_tir.SBlock(
        [tirx.IterVar(row_iv.dom, r, row_iv.iter_type)],
        reads,
        [m.acc[r : r + 1]],
        f"{old.name_hint}_sad",
        body,
        alloc_buffers=scratch,
    )
    return tvm.s_tir.SBlockRealize([m.realize.iter_values[0]], m.realize.predicate, block)


def _sad_body(m: _RowSum, form: SumForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
    """The statements of one row's sum at row ``r``, and the scratch buffers they use."""
    return {SUM: _plain_sum, SQUARES: _square_sum, ABS: _abs_sum}[m.kind](m, form, r)


def _abs_sum(m: _RowSum, form: SumForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
    """Σ|N·x − S|: t = ⌊S/N⌋, D = S − N·t, then (N − D)·Σ|x − t| + D·Σ|x − t − 1| + tail."""
    i64 = "int64"
    n = tirx.const(m.n, i64)
    s = _rename(m.centre, m.row, r)
    s = s if _dtype(s) == i64 else tirx.Cast(i64, s)
    t, d = tirx.Var("t", i64), tirx.Var("d", i64)
    steps, (below, above), tail, scratch = _sad_sums(
        m, form, r, [t, t + tirx.const(1, i64)], lambda xk: _absdiff(xk * n, s)
    )
    total = (n - d) * below + d * above + tail
    body = [tirx.Bind(t, tirx.floordiv(s, n)), tirx.Bind(d, s - n * t), *steps, _accumulate(m, r, total)]
    return tirx.SeqStmt(body), scratch


def _plain_sum(m: _RowSum, form: SumForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
    """Σx = Σ|x − (−128)| − 128·(elements the chunks cover) + tail: one ``vpsadbw`` per
    chunk where LLVM widens and adds (8 instructions per 32 bytes)."""
    low = tirx.const(-128, "int64")
    steps, (shifted,), tail, scratch = _sad_sums(m, form, r, [low], lambda xk: xk)
    total = shifted + low * _covered(m, form) + tail
    return tirx.SeqStmt([*steps, _accumulate(m, r, total)]), scratch


def _square_sum(m: _RowSum, form: SumForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
    """Σx² in int32: per chunk, each half widened to int16 and ``vpmaddwd`` with itself
    (x² + x'² per lane) into its own accumulator (two chains, so the adds do not wait
    on each other), then the tail as written."""
    i32, w, half = "int32", form.chunk, form.chunk // 2
    lanes = tirx.Ramp(tirx.const(0, i32), tirx.const(1, i32), form.madd_lanes)
    sums = [tirx.decl_buffer((form.madd_lanes,), i32, f"sq{i}", scope="global") for i in range(2)]
    tail = tirx.decl_buffer((1,), i32, "tail", scope="global")
    j = tirx.Var("j", i32)
    steps = []
    for i, buf in enumerate(sums):
        wide = tirx.Cast(f"int16x{half}", m.x[r, tirx.Ramp(j * w + i * half, tirx.const(1, i32), half)])
        madd = tirx.call_llvm_pure_intrin(f"int32x{form.madd_lanes}", form.madd, wide, wide)
        steps.append(tirx.BufferStore(buf, buf[lanes] + madd, [lanes]))
    chunks = tirx.For(j, tirx.const(0, i32), tirx.const(m.n // w, i32), tirx.ForKind.SERIAL, tirx.SeqStmt(steps))
    covered = m.n // w * w
    k = tirx.Var("k", i32)
    xk = tirx.Cast(i32, m.x[r, k])
    tail_loop = tirx.For(
        k, tirx.const(covered, i32), tirx.const(m.n - covered, i32), tirx.ForKind.SERIAL,
        tirx.BufferStore(tail, tail[0] + xk * xk, [0]),
    )
    reduce = f"llvm.vector.reduce.add.v{form.madd_lanes}i32"
    total = sum((tirx.call_llvm_pure_intrin(i32, reduce, buf[lanes]) for buf in sums), tail[0])
    body = [
        *(tirx.BufferStore(buf, tirx.Broadcast(tirx.const(0, i32), form.madd_lanes), [lanes]) for buf in sums),
        tirx.BufferStore(tail, tirx.const(0, i32), [0]),
        chunks,
        tail_loop,
        _accumulate(m, r, total),
    ]
    return tirx.SeqStmt(body), [*sums, tail]


def _sad_sums(
    m: _RowSum, form: SumForm, r: tirx.Var, taus: list[Any], tail_term: Callable[[Any], Any]
) -> tuple[list[tirx.Stmt], list[Any], Any, list[Any]]:
    """Statements summing row ``r``; then Σ|x − τ| over the chunks for each τ of ``taus``,
    the tail's Σ tail_term(int64(x)), and the scratch buffers.

    Each τ is clamped into int8 for ``vpsadbw`` and the clamp's distance added once
    per element the chunks cover (every int8 x then lies on one side of τ).
    """
    i64 = "int64"
    clamped = [tirx.max(tirx.min(tau, tirx.const(127, i64)), tirx.const(-128, i64)) for tau in taus]
    # "global" scope: buffers this small then live on the stack (LLVM keeps them in
    # registers); "local" ones became heap workspace allocations on every row
    sums = [tirx.decl_buffer((form.lanes,), i64, f"sad{i}", scope="global") for i in range(len(taus))]
    tail = tirx.decl_buffer((1,), i64, "tail", scope="global")
    lanes = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), form.lanes)
    covered = _covered(m, form)
    steps = [
        *(tirx.BufferStore(buf, tirx.Broadcast(tirx.const(0, i64), form.lanes), [lanes]) for buf in sums),
        tirx.BufferStore(tail, tirx.const(0, i64), [0]),
        _chunk_loop(m, form, r, sums, clamped, lanes),
        _tail_loop(m, r, covered, tail, tail_term),
    ]
    pieces = _pieces(m, form)
    totals = [
        tirx.call_llvm_pure_intrin(i64, f"llvm.vector.reduce.add.v{form.lanes}i64", buf[lanes])
        + sum((_piece_sad(m, r, start, width, name, tc) for start, width, name in pieces), tirx.const(0, i64))
        + covered * _absdiff(tau, tc)
        for buf, tau, tc in zip(sums, taus, clamped, strict=True)
    ]
    return steps, totals, tail[0], [*sums, tail]


def _pieces(m: _RowSum, form: SumForm) -> list[tuple[int, int, str]]:
    """(first column, bytes, intrinsic) of each narrower ``vpsadbw`` after the whole chunks."""
    start, found = m.n // form.chunk * form.chunk, []
    for width, name in _PIECES:
        if width < form.chunk and m.n - start >= width:
            found.append((start, width, name))
            start += width
    return found


def _piece_sad(m: _RowSum, r: tirx.Var, start: int, width: int, intrinsic: str, tau: Any) -> Any:
    """Σ|x − τ| over ``width`` columns from ``start`` as one narrower ``vpsadbw`` (int64)."""
    sad = _sad(_flipped(m, r, tirx.const(start, "int32"), width), tau, width, intrinsic)
    return tirx.call_llvm_pure_intrin("int64", f"llvm.vector.reduce.add.v{width * 8 // _LANE_BITS}i64", sad)


def _flipped(m: _RowSum, r: tirx.Var, start: Any, width: int) -> Any:
    """``width`` int8 columns of row ``r`` from ``start`` as unsigned bytes, x ^ 0x80 = x + 128."""
    columns = m.x[r, tirx.Ramp(start, tirx.const(1, "int32"), width)]
    return tirx.reinterpret(f"uint8x{width}", columns) ^ tirx.Broadcast(tirx.const(128, "uint8"), width)


def _sad(flipped: Any, tau: Any, width: int, intrinsic: str) -> Any:
    """``vpsadbw(flipped, τ + 128)``: Σ|x − τ| per 8 bytes, in 64-bit lanes (τ within int8)."""
    byte = tirx.Broadcast((tau + tirx.const(128, "int64")).astype("uint8"), width)
    return tirx.call_llvm_pure_intrin(f"int64x{width * 8 // _LANE_BITS}", intrinsic, flipped, byte)


def _covered(m: _RowSum, form: SumForm) -> Any:
    """How many elements of a row the whole chunks and the narrower pieces hold (int64)."""
    return tirx.const(m.n // form.chunk * form.chunk + sum(w for _, w, _ in _pieces(m, form)), "int64")


def _accumulate(m: _RowSum, r: tirx.Var, total: Any) -> tirx.BufferStore:
    """``acc[r] = total`` (the block zeroed acc) or ``acc[r] += total`` (an init block did),
    in acc's dtype: the op proves the sum fits it, and int64 holds every partial value."""
    dtype = str(m.acc.dtype)
    total = total if dtype == "int64" else tirx.Cast(dtype, total)
    return tirx.BufferStore(m.acc, total if m.has_init else m.acc[r] + total, [r])


def _chunk_loop(m: _RowSum, form: SumForm, r: tirx.Var, sums: list[Any], taus: list[Any], lanes: Any) -> tirx.For:
    """``sums[i] += vpsadbw(x ^ 0x80, taus[i] + 128)`` over the row's whole chunks."""
    w = form.chunk
    j = tirx.Var("j", "int32")
    flipped = _flipped(m, r, j * w, w)
    steps = []
    for buf, tau in zip(sums, taus, strict=True):
        steps.append(tirx.BufferStore(buf, buf[lanes] + _sad(flipped, tau, w, form.intrinsic), [lanes]))
    body = steps[0] if len(steps) == 1 else tirx.SeqStmt(steps)
    return tirx.For(j, tirx.const(0, "int32"), tirx.const(m.n // w, "int32"), tirx.ForKind.SERIAL, body)


def _tail_loop(m: _RowSum, r: tirx.Var, start: Any, tail: Any, term: Callable[[Any], Any]) -> tirx.For:
    """``tail += term(int64(x))`` over the columns after the last whole chunk and piece."""
    k = tirx.Var("k", "int32")
    first = int(start)
    return tirx.For(
        k, tirx.const(first, "int32"), tirx.const(m.n - first, "int32"), tirx.ForKind.SERIAL,
        tirx.BufferStore(tail, tail[0] + term(tirx.Cast("int64", m.x[r, k])), [0]),
    )


def _absdiff(a: Any, b: Any) -> Any:
    return tirx.max(a - b, b - a)


def _rename(node: Any, old: tirx.Var, new: tirx.Var) -> Any:
    """``node`` (an expression or region) with the variable ``old`` replaced by ``new``."""
    return tvm_ffi.structural_mutate(
        node, lambda x, mut: new if isinstance(x, tirx.Var) and x.same_as(old) else mut.default_mutate(x)
    )
