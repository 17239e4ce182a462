"""L1LayerNorm's row sums as ``vpsadbw`` on x86: a target-specific rewrite of scheduled TIR.

Why.  L1LayerNorm's statistic needs a second pass over the row after S = Σx:
Σ_k |N·x_k − S|.  From TE, LLVM makes that pass 20 instructions per 32 int8
inputs (widen, multiply by N, subtract, absolute value, add), which is why L1 ran
slower than the integer L2 norm at N = 768 and 4096.  x86 has an instruction for
sums of absolute byte differences, ``vpsadbw`` (AVX2: 32 bytes, AVX-512BW: 64), and
the statistic can be written with it exactly.  With t = ⌊S/N⌋ and D = S − N·t
(0 ≤ D < N), for every integer x, with m = x − t:

    |N·x − S| = |N·m − D| = (N − D)·|m| + D·|m − 1|

(m ≥ 1: both sides are N·m − D; m ≤ 0: both are D − N·m).  So

    Σ|N·x − S| = (N − D)·Σ|x − t| + D·Σ|x − t − 1|,

and Σ|x − τ| over int8 x, for τ in [−128, 127], is ``vpsadbw`` of x ^ 0x80 against
the byte τ + 128 (both shifted into unsigned bytes by the same 128).  A τ outside
the int8 range (t + 1 = 128, or any t of a sum S that is not Σx) is clamped to τc,
and |τ − τc| added per element: every x then lies on one side of τ, so
|x − τ| = |x − τc| + |τ − τc|.  The first pass, S = Σx, is the same instruction
against τ = −128: Σx = Σ|x + 128| − 128·N, one ``vpsadbw`` per chunk where LLVM
widens and adds (8 instructions per 32 bytes).  The row's tail of N mod (chunk
bytes) elements is summed as written.

LLVM does not form ``vpsadbw`` from the TE reductions, and TVM 0.27's ``tensorize``
crashes on them, so each reduction's loop is replaced after scheduling by a block
that calls the LLVM intrinsic.  The target is only known where the module is
built, so :func:`rewrite` runs there (:func:`compilers.tvm.build.build` and the
whole-model compile in :mod:`compilers.tvm.graph`), before the build-cache key is
taken, so the key is of the rewritten text.  It matches two shapes strictly: a
reduction block over k in [0, N) (N the reduction's extent, x an int8 (rows, N)
buffer) accumulating ``int(x[r, k])``, or ``|int(x[r, k])·N − S[r]|`` with the
absolute value as TIR writes it (a Select).  Anything else, and every target
without AVX2 (aarch64, riscv64, GPUs, C), is left as it is.  IntLayerNorm and
ShiftLayerNorm sum x with x² in one loop, which does not match: only L1's sums move.

Measured (AMD EPYC Zen 3, AVX2, 1 thread, whole int8 L1LayerNorm kernels
interleaved with IntLayerNorm's on a shared machine): see :data:`MIN_ROW`.
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
# (chunk bytes, the LLVM intrinsic), widest first; a target uses the first it has
_FORMS: tuple[tuple[str, int, str], ...] = (
    ("avx512bw", 64, "llvm.x86.avx512.psad.bw.512"),
    ("avx2", 32, "llvm.x86.avx2.psad.bw"),
)
# Rows shorter than this keep the TE reductions.  Whole kernels, rewritten against TE
# (interleaved runs): 1.13-1.19x at N = 768, 1.24x at 4096, 1.11x at 256,
# 1.02-1.04x at 128; at 64, where the blocked schedule of short rows (16 rows a
# block, compilers.tvm.cpu) already keeps the TE passes cheap, 0.96-0.98x.  Against
# IntLayerNorm the rewritten L1 kernel ran 1.10-1.12x at 768 and 1.08-1.11x at 4096
# (the TE one 0.92-0.99x and 0.87-0.89x).
MIN_ROW = 128


@dataclass(frozen=True)
class SadForm:
    """How one target sums absolute byte differences: ``chunk`` bytes per call."""

    chunk: int
    intrinsic: str

    @property
    def lanes(self) -> int:
        return self.chunk * 8 // _LANE_BITS


def sad_form(target: Target) -> SadForm | None:
    """The ``vpsadbw`` form ``target`` has, or None (not an llvm x86 target with AVX2)."""
    spec = target.tvm_spec()
    if spec.get("kind") != "llvm":
        return None
    tvm_target = tvm.target.Target(spec)
    for feature, chunk, intrinsic in _FORMS:
        if codegen.target_has_features(feature, tvm_target):
            return SadForm(chunk, intrinsic)
    return None


def rewrite(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """``mod`` with every matched row sum (module docstring) of every PrimFunc in
    ``vpsadbw`` form for ``target``; ``mod`` itself (unchanged, the same object)
    where nothing matches or the target has no such form."""
    form = sad_form(target)
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


def rewrite_func(func: tirx.PrimFunc, form: SadForm) -> tirx.PrimFunc:
    """``func`` with its matched reduction loops replaced (``func`` when none match)."""
    hits = []

    def mutate(node: Any, mutator: tvm_ffi.StructuralMutator) -> Any:
        if isinstance(node, tirx.For):
            found = _match(node)
            if found is not None and found.n >= max(MIN_ROW, form.chunk):
                hits.append(found)
                return _sad_realize(found, form)
        return mutator.default_mutate(node)

    body = tvm_ffi.structural_mutate(func.body, mutate)
    return func.with_body(body) if hits else func


# --------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class _RowSum:
    """A matched ``acc[r] (+)= Σ_k |int(x[r, k])·N − S|`` loop, or (``centre`` None)
    ``acc[r] (+)= Σ_k x[r, k]``."""

    realize: Any  # the reduction block's SBlockRealize (its row binding and predicate)
    row: tirx.Var  # the block's row axis
    x: Any  # the int8 (rows, N) buffer
    centre: Any  # S, in the block's terms (a load of v_r, maybe cast); None: a plain sum
    acc: Any  # the accumulator buffer
    n: int
    has_init: bool  # the block zeroes acc itself (else a decomposed init block did)


def _match(loop: tirx.For) -> _RowSum | None:
    """The row reduction whose loop is ``loop``, if it is one of the two forms, or None.

    Every piece is checked: the loop runs k over [0, N) serially, binding the
    block's reduction axis directly; the block writes one accumulator element per
    row; its update is ``acc[r] + int(x[r, k])`` (x int8) or ``acc[r] +
    |int(x[r, k])·N − S|`` with the absolute value exactly as TIR lowers ``abs``
    (``Select(0 <= e, e, S − int(x)·N)``).
    """
    realize = loop.body
    if not (isinstance(realize, tvm.s_tir.SBlockRealize) and loop.kind == tirx.ForKind.SERIAL):
        return None
    if not (_is_int(loop.min, 0) and isinstance(loop.extent, tirx.IntImm)):
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
    parts = _abs_of_centered(term, row, k, n)
    if parts is None:
        return None
    x, centre = parts
    return _RowSum(realize, row, x, centre, acc, n, has_init)


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
    """``expr`` is ``x[row, k]`` of an int8 (rows, n) buffer."""
    if not isinstance(expr, tvm.ir.expr.TensorLoad) or str(expr.source.dtype) != "int8":
        return False
    x = expr.source
    return len(x.shape) == 2 and _is_int(x.shape[1], n) and _indexes(expr.indices, [row, k])


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


def _sad_realize(m: _RowSum, form: SadForm) -> tvm.s_tir.SBlockRealize:
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


def _sad_body(m: _RowSum, form: SadForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
    """The statements of one row's sum at row ``r``, and the scratch buffers they use."""
    return (_plain_sum if m.centre is None else _abs_sum)(m, form, r)


def _abs_sum(m: _RowSum, form: SadForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
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


def _plain_sum(m: _RowSum, form: SadForm, r: tirx.Var) -> tuple[tirx.Stmt, list[Any]]:
    """Σx = Σ|x − (−128)| − 128·(elements the chunks cover) + tail: one ``vpsadbw`` per
    chunk where LLVM widens and adds (8 instructions per 32 bytes)."""
    low = tirx.const(-128, "int64")
    steps, (shifted,), tail, scratch = _sad_sums(m, form, r, [low], lambda xk: xk)
    total = shifted + low * _covered(m, form) + tail
    return tirx.SeqStmt([*steps, _accumulate(m, r, total)]), scratch


def _sad_sums(
    m: _RowSum, form: SadForm, r: tirx.Var, taus: list[Any], tail_term: Callable[[Any], Any]
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
    totals = [
        tirx.call_llvm_pure_intrin(i64, f"llvm.vector.reduce.add.v{form.lanes}i64", buf[lanes])
        + covered * _absdiff(tau, tc)
        for buf, tau, tc in zip(sums, taus, clamped, strict=True)
    ]
    return steps, totals, tail[0], [*sums, tail]


def _covered(m: _RowSum, form: SadForm) -> Any:
    """How many elements of a row the whole chunks hold (int64)."""
    return tirx.const(m.n // form.chunk * form.chunk, "int64")


def _accumulate(m: _RowSum, r: tirx.Var, total: Any) -> tirx.BufferStore:
    """``acc[r] = total`` (the block zeroed acc) or ``acc[r] += total`` (an init block did),
    in acc's dtype: the op proves the sum fits it, and int64 holds every partial value."""
    dtype = str(m.acc.dtype)
    total = total if dtype == "int64" else tirx.Cast(dtype, total)
    return tirx.BufferStore(m.acc, total if m.has_init else m.acc[r] + total, [r])


def _chunk_loop(m: _RowSum, form: SadForm, r: tirx.Var, sums: list[Any], taus: list[Any], lanes: Any) -> tirx.For:
    """``sums[i] += vpsadbw(x ^ 0x80, taus[i] + 128)`` over the row's whole chunks."""
    w = form.chunk
    j = tirx.Var("j", "int32")
    chunk = m.x[r, tirx.Ramp(j * w, tirx.const(1, "int32"), w)]
    flipped = tirx.reinterpret(f"uint8x{w}", chunk) ^ tirx.Broadcast(tirx.const(128, "uint8"), w)
    steps = []
    for buf, tau in zip(sums, taus, strict=True):
        byte = tirx.Broadcast((tau + tirx.const(128, "int64")).astype("uint8"), w)
        sad = tirx.call_llvm_pure_intrin(f"int64x{form.lanes}", form.intrinsic, flipped, byte)
        steps.append(tirx.BufferStore(buf, buf[lanes] + sad, [lanes]))
    body = steps[0] if len(steps) == 1 else tirx.SeqStmt(steps)
    return tirx.For(j, tirx.const(0, "int32"), tirx.const(m.n // w, "int32"), tirx.ForKind.SERIAL, body)


def _tail_loop(m: _RowSum, r: tirx.Var, start: Any, tail: Any, term: Callable[[Any], Any]) -> tirx.For:
    """``tail += term(int64(x))`` over the columns after the last whole chunk."""
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
