"""L1LayerNorm's Σ|N·x − S| as ``vpsadbw`` (compilers.tvm.x86_rowsums): where it applies, and
that the rewritten kernels equal the golden op bit for bit.

The exactness tests run on this machine's x86_64 target and skip where it has no AVX2
(nothing is rewritten there); the targets' forms and the rewritten TIR and assembly are
checked on fixed CPU levels, so they hold on any host.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tvm import te, tirx

from compilers.tvm import x86_rowsums
from compilers.tvm.build import build, cache_key, tvm_target
from compilers.tvm.kernels import kernel_for
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.qformat import QFormat
from qnorm.targets import Target, load_target

SEED = 20261202
V2 = ("fpu", "lm", "sse", "sse2", "cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
V3 = V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
V4 = V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
AVX2, AVX512, SSE2 = "llvm.x86.avx2.psad.bw", "llvm.x86.avx512.psad.bw.512", "llvm.x86.sse2.psad.bw"
MADD2, MADD512 = "llvm.x86.avx2.pmadd.wd", "llvm.x86.avx512.pmaddw.d.512"


def x86(*flags: str) -> Target:
    """The x86_64 target as it resolves on a CPU reporting ``flags``."""
    return load_target("x86_64", cpuinfo=f"processor\t: 0\nflags\t\t: {' '.join(flags)}\n")


@functools.cache
def host() -> Target:
    return load_target("x86_64")


def needs_avx2_host() -> None:
    if x86_rowsums.sum_form(host()) is None:
        pytest.skip("this host has no AVX2: nothing is rewritten for it")


def norm_op(cls: type, n: int, bits: int = 8, seed: int = SEED) -> Any:
    rng = np.random.default_rng(seed + n)
    gamma = rng.normal(1.0, 0.1, n).astype(np.float32)
    beta = None if cls is IntRMSNorm else rng.normal(0.0, 0.1, n).astype(np.float32)
    return cls.from_float(gamma, beta, 1e-5, QFormat(bits, 0.03))


def l1_op(n: int, bits: int = 8, seed: int = SEED) -> L1LayerNorm:
    return norm_op(L1LayerNorm, n, bits, seed)


def extreme_rows(fmt: QFormat, n: int, rng: np.random.Generator) -> np.ndarray:
    """Rows at the int8 ends (t = ⌊S/N⌋ at lo and hi, t + 1 past hi), one element
    off each end, halves, rows bunched near each end, and random rows."""
    lo, hi = fmt.lo, fmt.hi
    rows = [np.full(n, lo), np.full(n, hi), np.full(n, 0), np.full(n, hi - 1)]
    one_off = [np.full(n, lo), np.full(n, hi)]
    one_off[0][-1], one_off[1][0] = hi, lo
    half = np.where(np.arange(n) < n // 2, hi, lo)
    rows += [*one_off, half, half[::-1]]
    rows += list(rng.integers(hi - 3, hi + 1, (3, n))) + list(rng.integers(lo, lo + 4, (3, n)))
    rows += list(rng.integers(lo, hi + 1, (6, n)))
    return np.array(rows, dtype=np.int64)


# --------------------------------------------------------------------------- where it applies


def test_each_target_gets_its_widest_form_or_none():
    assert x86_rowsums.sum_form(x86(*V3)) == x86_rowsums.SumForm(32, AVX2, MADD2)
    assert x86_rowsums.sum_form(x86(*V4)) == x86_rowsums.SumForm(64, AVX512, MADD512)
    assert x86_rowsums.sum_form(x86(*V2)) is None
    for name in ("aarch64", "riscv64", "opencl", "cuda", "fpga-hls"):
        assert x86_rowsums.sum_form(load_target(name)) is None, name


def test_l1_statistic_is_rewritten_for_avx2_and_avx512_only():
    """Both row sums: S = Σx (one vpsadbw per chunk) and Σ|N·x − S| (two)."""
    mod = kernel_for(l1_op(768)).mod
    v3, v4 = x86_rowsums.rewrite(mod, x86(*V3)).script(), x86_rowsums.rewrite(mod, x86(*V4)).script()
    assert v3.count(AVX2) == 3 and AVX512 not in v3
    assert '"row_sum_update_sad"' in v3 and '"row_sum_1_update_sad"' in v3
    assert v4.count(AVX512) == 3 and AVX2 not in v4
    for target in (x86(*V2), load_target("aarch64"), load_target("riscv64")):
        assert x86_rowsums.rewrite(mod, target) is mod, target.name


@pytest.mark.parametrize("cls,sums", [(IntLayerNorm, 1), (ShiftLayerNorm, 1), (IntRMSNorm, 0)])
def test_square_sums_are_rewritten_with_the_plain_sum_of_their_loop(cls, sums):
    """Σx² (two vpmaddwd per chunk) and, in the same loop, Σx (one vpsadbw): both move."""
    mod = kernel_for(norm_op(cls, 768)).mod
    v3, v4 = x86_rowsums.rewrite(mod, x86(*V3)).script(), x86_rowsums.rewrite(mod, x86(*V4)).script()
    assert v3.count(MADD2) == 2 and v3.count(AVX2) == sums and MADD512 not in v3
    assert v4.count(MADD512) == 2 and v4.count(AVX512) == sums and MADD2 not in v4


def test_short_rows_keep_their_te_reduction():
    """Rows shorter than MIN_ROW (loops with squares) or MIN_SAD_ROW (L1's vpsadbw sums)
    measured faster as TE."""
    for cls in (IntLayerNorm, IntRMSNorm):
        mod = kernel_for(norm_op(cls, x86_rowsums.MIN_ROW - 1)).mod
        assert x86_rowsums.rewrite(mod, x86(*V4)) is mod, cls.__name__
    l1 = kernel_for(l1_op(x86_rowsums.MIN_SAD_ROW - 1)).mod
    assert x86_rowsums.rewrite(l1, x86(*V4)) is l1
    assert x86_rowsums.rewrite(kernel_for(l1_op(x86_rowsums.MIN_SAD_ROW)).mod, x86(*V4)) is not l1


@pytest.mark.parametrize(
    "n,flags,counts",
    [(112, V4, {AVX512: 3, AVX2: 3, SSE2: 3}), (112, V3, {AVX2: 3, SSE2: 3}),
     (96, V4, {AVX512: 3, AVX2: 3, SSE2: 0}), (768, V4, {AVX512: 3, AVX2: 0, SSE2: 0})],  # fmt: skip
)
def test_a_remainder_takes_the_narrower_forms_that_fit(n, flags, counts):
    """After the whole chunks, a 32-byte and a 16-byte ``vpsadbw`` where the remainder
    holds them (each of L1's three sums once): 112 = 64 + 32 + 16 with AVX-512, 3·32 + 16
    with AVX2."""
    script = x86_rowsums.rewrite(kernel_for(l1_op(n)).mod, x86(*flags)).script()
    assert {name: script.count(f'"{name}"') for name in counts} == counts


@pytest.mark.parametrize(
    "dtype,scale,term_kind",
    [("int8", 1, "abs"), ("int16", 0, "abs"), ("int8", 0, "x(x+1)"), ("int8", 0, "squares in int64")],
    ids=["scale N+1", "int16 x", "x(x+1)", "squares in int64"],
)
def test_near_misses_are_left_alone(dtype, scale, term_kind):
    """Only Σx, Σx² into int32 and Σ|N·x − S| over int8 rows match: another scale, a wider
    x, another term or squares into int64 (whose lanes' int32 sums are not proven) keep
    the TE reduction."""
    n = 256
    rows = te.var("rows", "int64")
    x = te.placeholder((rows, n), dtype, name="x")
    s = te.placeholder((rows,), "int32", name="s")
    k = te.reduce_axis((0, n), "k")

    def term(r):
        v = x[r, k].astype("int32")
        if term_kind == "x(x+1)":
            return v * (v + 1)
        if term_kind == "squares in int64":
            w = x[r, k].astype("int64")
            return w * w
        return tirx.abs(v * (n + scale) - s[r])

    out = te.compute((rows,), lambda r: te.sum(term(r), axis=k), name="out")
    mod = tvm.IRModule({"main": te.create_prim_func([x, s, out])})
    assert x86_rowsums.rewrite(mod, x86(*V4)) is mod


@pytest.mark.parametrize("flags,register", [(V3, "%ymm"), (V4, "%zmm")])
@pytest.mark.parametrize("cls,instruction", [(L1LayerNorm, "vpsadbw"), (IntRMSNorm, "vpmaddwd")])
def test_rewritten_kernel_compiles_to_the_instruction(flags, register, cls, instruction):
    target = x86(*flags)
    mod = x86_rowsums.rewrite(kernel_for(norm_op(cls, 768)).mod, target)
    asm = tvm.compile(mod, target=tvm_target(target)).mod.inspect_source("asm")
    found = [line for line in asm.splitlines() if instruction in line]
    assert found and all(register in line for line in found)


def test_built_kernel_is_keyed_by_the_rewritten_text():
    needs_avx2_host()
    kernel = kernel_for(l1_op(256))
    rewritten = x86_rowsums.rewrite(kernel.mod, host())
    assert rewritten is not kernel.mod
    assert kernel.build(host()).built.key == cache_key(rewritten, host()) != cache_key(kernel.mod, host())


# --------------------------------------------------------------------------- exactness


@given(n=st.integers(1, 4100), bits=st.sampled_from([8, 4]), seed=st.integers(0, 2**16))
@example(n=x86_rowsums.MIN_SAD_ROW, bits=8, seed=0)  # whole chunks only
@example(n=x86_rowsums.MIN_ROW + 33, bits=8, seed=0)  # whole chunks, a 32-byte piece and a tail of 1 (AVX-512)
@example(n=127, bits=8, seed=0)  # a chunk, both narrower pieces and a tail of 15 (AVX-512)
@example(n=256, bits=8, seed=0)  # the blocked schedule (16 rows a block), Σx in int16
@example(n=768, bits=8, seed=0)
@example(n=4100, bits=8, seed=0)  # tail of 4
@settings(max_examples=6, deadline=None)
def test_rewritten_l1_kernel_equals_the_golden_op(n, bits, seed):
    needs_avx2_host()
    op = l1_op(n, bits, seed)
    kernel = kernel_for(op)
    assert (x86_rowsums.rewrite(kernel.mod, host()) is not kernel.mod) == (n >= x86_rowsums.MIN_SAD_ROW)
    compiled = kernel.build(host())
    x = extreme_rows(op.in_fmt, n, np.random.default_rng(seed))
    assert np.array_equal(compiled(x), op.forward(x))


@given(n=st.integers(x86_rowsums.MIN_ROW, 4100), cls=st.sampled_from([IntLayerNorm, ShiftLayerNorm, IntRMSNorm]),
       seed=st.integers(0, 2**16))
@example(n=x86_rowsums.MIN_ROW + 17, cls=IntLayerNorm, seed=0)  # whole chunks and a tail of 17 (AVX2)
@example(n=768, cls=IntRMSNorm, seed=0)
@example(n=4100, cls=ShiftLayerNorm, seed=0)  # tail of 4
@settings(max_examples=4, deadline=None)
def test_rewritten_square_sum_kernels_equal_the_golden_op(n, cls, seed):
    needs_avx2_host()
    op = norm_op(cls, n, 8, seed)
    kernel = kernel_for(op)
    assert x86_rowsums.rewrite(kernel.mod, host()) is not kernel.mod
    x = extreme_rows(op.in_fmt, n, np.random.default_rng(seed))
    assert np.array_equal(kernel.build(host())(x), op.forward(x))


def test_partial_rms_sums_the_first_columns_with_vpmaddwd():
    """A partial RMS norm's Σx² runs over the first ceil(p·N) of N columns."""
    needs_avx2_host()
    n, rng = 768, np.random.default_rng(SEED)
    op = IntRMSNorm.from_float(rng.normal(1.0, 0.1, n), None, 1e-5, QFormat(8, 0.03), partial=0.25)
    kernel = kernel_for(op)
    assert x86_rowsums.sum_form(host()).madd in x86_rowsums.rewrite(kernel.mod, host()).script()
    x = extreme_rows(op.in_fmt, n, rng)
    assert np.array_equal(kernel.build(host())(x), op.forward(x))


def sum_abs_func(n: int) -> tirx.PrimFunc:
    """out[r] = Σ_k |N·x[r, k] − s[r]| with s an argument: any S, not only Σx."""
    rows = te.var("rows", "int64")
    x = te.placeholder((rows, n), "int8", name="x")
    s = te.placeholder((rows,), "int32", name="s")
    k = te.reduce_axis((0, n), "k")
    out = te.compute((rows,), lambda r: te.sum(tirx.abs(x[r, k].astype("int32") * n - s[r]), axis=k), name="out")
    return te.create_prim_func([x, s, out])


def row_reduction_func(n: int, squares: bool) -> tirx.PrimFunc:
    """out[r] = Σ_k x[r, k] (or x[r, k]²) in int32."""
    rows = te.var("rows", "int64")
    x = te.placeholder((rows, n), "int8", name="x")
    k = te.reduce_axis((0, n), "k")

    def term(r):
        v = x[r, k].astype("int32")
        return v * v if squares else v

    out = te.compute((rows,), lambda r: te.sum(term(r), axis=k), name="out")
    return te.create_prim_func([x, out])


@pytest.mark.parametrize(
    "n,squares",
    [(x86_rowsums.MIN_SAD_ROW, False), (200, False), (1000, False), (127, False),
     (x86_rowsums.MIN_ROW, True), (201, True), (65536, True)],  # fmt: skip
)
def test_a_row_reduction_alone_is_exact(n, squares):
    """Σx (vpsadbw) and Σx² (vpmaddwd); rows of -128 at N = 65536 square-sum to 2^30,
    every lane's partial sum far below 2^31."""
    needs_avx2_host()
    func = row_reduction_func(n, squares)
    form = x86_rowsums.sum_form(host())
    rewritten = x86_rowsums.rewrite(tvm.IRModule({"main": func}), host()).script()
    assert (form.madd if squares else form.intrinsic) in rewritten
    x = extreme_rows(QFormat(8, 1.0), n, np.random.default_rng(SEED + n)).astype(np.int8)
    out = tvm.runtime.empty((len(x),), "int32")
    build(func, host())(tvm.runtime.tensor(x), out)
    wide = x.astype(np.int64)
    assert np.array_equal(out.numpy(), (wide**2 if squares else wide).sum(axis=1))


@pytest.mark.parametrize("n", [200, 240])  # 240: both narrower pieces after the chunks (AVX-512)
def test_any_row_sum_is_exact_far_outside_the_int8_range(n):
    """t = ⌊S/N⌋ beyond int8 (and t + 1 past 127) takes the clamped path."""
    needs_avx2_host()
    func = sum_abs_func(n)
    rewritten = x86_rowsums.rewrite(tvm.IRModule({"main": func}), host()).script()
    assert x86_rowsums.sum_form(host()).intrinsic in rewritten
    built = build(func, host())
    rng = np.random.default_rng(SEED)
    x = rng.integers(-128, 128, (64, n)).astype(np.int8)
    x[:8] = 127
    x[8:16] = -128
    edges = np.array([127 * n, 127 * n - 1, 128 * n, -128 * n, -128 * n - 1, -129 * n, 0, -1])
    s = np.concatenate([edges, edges, rng.integers(-(2**20), 2**20, 48)]).astype(np.int32)
    out = tvm.runtime.empty((64,), "int32")
    built(tvm.runtime.tensor(x), tvm.runtime.tensor(s), out)
    want = np.abs(n * x.astype(np.int64) - s[:, None].astype(np.int64)).sum(axis=1)
    assert np.array_equal(out.numpy(), want)


# --------------------------------------------------------------------------- compiled models


def test_compiled_model_with_an_l1_norm_gets_the_rewrite(tmp_path, monkeypatch):
    """``qnorm compile``'s path: the Relax module is rewritten before its cache key, and the
    compiled model equals the QAT model bit for bit, as a Relax VM library and as the C API."""
    needs_avx2_host()
    torch = pytest.importorskip("torch")
    qnn = pytest.importorskip("brevitas.nn")
    from compilers.tvm import c_api
    from compilers.tvm.graph import compile_model, relax_key, to_relax
    from qnorm.deploy import export, freeze
    from qnorm.nn import L1LayerNorm as QatL1LayerNorm
    from qnorm.train.models import Int8ActPerTensorPow2MinMaxInit

    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    torch.manual_seed(0)
    n = 256
    act = Int8ActPerTensorPow2MinMaxInit.let(min_val=-4.0, max_val=4.0)  # scale 2^-5
    fmt = QFormat.power_of_two(8, -5)
    norm = QatL1LayerNorm(n, in_fmt=fmt, out_fmt=fmt)
    with torch.no_grad():
        norm.weight.uniform_(0.6, 0.99)
        norm.bias.uniform_(-0.5, 0.5)
    model = torch.nn.Sequential(qnn.QuantIdentity(act_quant=act, return_quant_tensor=False), norm).eval()
    x = torch.randn(64, n) * torch.linspace(0.01, 4.0, 64)[:, None]  # near-constant to saturated rows
    x[0] = 4.0
    x[1] = -4.0
    mod = to_relax(export(freeze(model), x[:2]))
    rewritten = x86_rowsums.rewrite(mod, host())
    assert x86_rowsums.sum_form(host()).intrinsic in rewritten.script()
    compiled = compile_model(model, x[:2])
    assert compiled.metadata["cache_key"] == relax_key(rewritten, host()) != relax_key(mod, host())
    with torch.no_grad():
        want = model(x).numpy()
    assert np.array_equal(compiled(x.numpy()), want)

    board = compile_model(model, x[:2], "x86_64", c_api_requested=True)
    assert board.metadata["cache_key"] == c_api.artifact_key(relax_key(rewritten, host()))
    scale = board.metadata["output"]["format"]["scale"]  # a power of two: the division is exact
    assert np.array_equal(board.run_ints(board.quantize(x.numpy())), (want / scale).astype(np.int32))
