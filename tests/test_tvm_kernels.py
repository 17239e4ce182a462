"""Every golden op compiled by TVM for this x86 host equals ``op.forward`` bit for bit.

One test per (op, config) builds the kernel once and checks it on random rows and
on the rows that stress each stage: constant rows, all-minimum rows, alternating
extremes, the extremal rows of the range analysis, configs where the tie rule
decides most outputs, every input value of the BN folds, neurons whose
thresholds lie on the integer grid.  Equality is ``np.array_equal``; every
kernel is integer-only.  Builds go through the on-disk cache, so reruns skip
compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from hypothesis import given, settings
from hypothesis import strategies as st

from compilers.tvm.build import non_integer_dtypes
from compilers.tvm.cpu import ROW_BLOCK
from compilers.tvm.kernels import kernel_for
from compilers.tvm.kernels._base import fmt_dtype
from compilers.tvm.kernels._rows import Rows
from compilers.tvm.kernels.norms import norm_kernel
from qnorm.analysis import Interval, OverflowRiskError
from qnorm.fixedpoint import Dyadic, Round
from qnorm.nn.elementchain import ElementChain
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops.bnfold import RationalBN
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold
from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig, MPBNNeuron, MPBNParams
from qnorm.qformat import QFormat
from qnorm.targets import load_target

SEED = 20261130
INT8, INT4, INT12 = QFormat(8, 0.05), QFormat(4, 0.5), QFormat(12, 0.01)


@functools.cache
def host():
    return load_target("x86_64")


def assert_bit_exact(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> None:
    assert got.shape == want.shape
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)
        i = tuple(bad[0])
        pytest.fail(
            f"{len(bad)} elements differ; first at {i}: tvm {got[i]}, golden {want[i]};"
            f" row {x[i[:-1]]}"
        )


def check_kernel(op: Any, *inputs: np.ndarray) -> None:
    kernel = kernel_for(op)
    assert non_integer_dtypes(kernel.mod) == frozenset()
    script = kernel.mod.script()
    assert "T.parallel" in script
    # a row that no stage's register divides may be left to LLVM's loop vectorizer
    # (compilers.tvm.cpu._register_lanes); powers of two and multiples of 128 never are
    n = inputs[0].shape[-1]
    assert "T.vectorized" in script or not (n & (n - 1) == 0 or n % 128 == 0)
    compiled = kernel.build(host())
    for x in inputs:
        assert_bit_exact(compiled(x), op.forward(x), x)


# --------------------------------------------------------------------------- norms


def edge_rows(fmt: QFormat, n: int, prefix: int) -> np.ndarray:
    """Rows that reach the ends of each stage's range."""
    lo, hi = fmt.lo, fmt.hi
    idx = np.arange(n)
    rows = [np.full(n, v) for v in (lo, hi, 0, -1, 1, lo + 1)]  # constant rows: W = ε
    rows += [np.where(idx % 2 == 0, lo, hi), np.where(idx % 2 == 0, hi, lo)]  # alternating extremes
    rows += [
        np.where(idx < n // 2, lo, hi),
        np.where(idx < (n + 1) // 2, hi, lo),
    ]  # largest variance / MAD
    for k in {0, n // 2, n - 1}:
        for a, b in ((lo, hi), (hi, lo), (lo, 0), (hi, 0), (1, 0), (0, lo)):
            r = np.full(n, b)
            r[k] = a
            rows.append(r)  # [a, b, …, b]: the largest |d| / |x| against the statistic
    tail = np.where(idx < prefix, 0, hi)
    rows += [tail, np.where(idx < prefix, 0, lo)]  # partial RMS: a zero prefix, a full tail
    rows += [lo + (idx * 37) % (hi - lo + 1), np.clip(idx - n // 2, lo, hi)]
    return np.stack(rows).astype(np.int64)


def random_rows(fmt: QFormat, n: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Full-range, gaussian at several scales, and near-constant rows."""
    lo, hi = fmt.lo, fmt.hi
    full = rng.integers(lo, hi + 1, (count, n))
    scales = rng.choice([0.5, 2.0, 8.0, hi / 3], (count, 1))
    gauss = np.clip(np.rint(rng.normal(rng.normal(0, 4, (count, 1)), scales, (count, n))), lo, hi)
    flat = np.clip(rng.integers(lo, hi + 1, (count, 1)) + rng.integers(-1, 2, (count, n)), lo, hi)
    return np.concatenate([full, gauss, flat]).astype(np.int64)


@dataclass(frozen=True)
class NormCase:
    cls: type
    n: int
    in_fmt: QFormat = INT8
    kw: dict[str, Any] = field(default_factory=dict)
    eps: float = 1e-5
    ties: bool = False

    @property
    def id(self) -> str:
        extra = "".join(f",{k}={getattr(v, 'value', v)}" for k, v in self.kw.items())
        ties = ",ties" if self.ties else ""
        return f"{self.cls.__name__}[N={self.n},int{self.in_fmt.bits}{extra},eps={self.eps}{ties}]"

    def op(self) -> Any:
        rng = np.random.default_rng(SEED + self.n)
        gamma = rng.normal(1.0, 0.5, self.n) * rng.choice([1.0, -1.0], self.n, p=[0.8, 0.2])
        gamma[3::11] = 0.0  # γ = 0 channels output β alone
        beta = rng.normal(0.0, 0.5, self.n)
        op = self.cls.from_float(gamma, beta, self.eps, in_fmt=self.in_fmt, **self.kw)
        if not self.ties:
            return op
        # z with one fraction bit, unit gains and a one-bit output shift: y = round(z m / 2 + B / 2)
        # is an exact tie for every odd accumulator, so the tie rule decides most outputs.
        gains = tuple(int(v) for v in np.resize([1, -1, 2, 0], self.n))
        biases = tuple(int(v) for v in np.resize([0, 1, -1, 3], self.n))
        return self.cls(
            dataclasses.replace(op.config, frac_bits=1, gain=gains, shift=1, bias=biases), op.params
        )


def _norm_cases() -> list[NormCase]:
    cases = []
    for cls in (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm):
        cases += [
            NormCase(cls, 768),
            NormCase(cls, 64, kw={"rounding": Round.HALF_EVEN}),
            NormCase(cls, 2, INT4, eps=0.0),
            NormCase(cls, 1),
        ]
    cases += [
        NormCase(IntLayerNorm, 64, INT12, kw={"rounding": Round.TRUNC}),
        NormCase(L1LayerNorm, 64, INT4, kw={"rounding": Round.FLOOR}, eps=0.0),
        NormCase(ShiftLayerNorm, 64, kw={"mantissa_terms": 1}),
        NormCase(ShiftLayerNorm, 768, INT4, kw={"mantissa_terms": 1, "rounding": Round.HALF_AWAY}),
        NormCase(IntRMSNorm, 768, kw={"partial": 0.25}),
        NormCase(IntRMSNorm, 64, INT4, kw={"partial": 0.1, "rounding": Round.CEIL}, eps=0.0),
    ]
    tie_rules = {IntLayerNorm: Round.HALF_EVEN, L1LayerNorm: Round.HALF_AWAY}
    tie_rules |= {ShiftLayerNorm: Round.HALF_EVEN, IntRMSNorm: Round.HALF_AWAY}
    cases += [
        NormCase(cls, 64, kw={"rounding": mode}, ties=True) for cls, mode in tie_rules.items()
    ]
    return cases


NORM_CASES = _norm_cases()


@pytest.mark.parametrize("case", NORM_CASES, ids=[c.id for c in NORM_CASES])
def test_norm_kernel_bit_exact(case):
    op = case.op()
    rng = np.random.default_rng(SEED)
    prefix = getattr(op.config, "prefix", case.n)
    batched = random_rows(case.in_fmt, case.n, 6, rng).reshape(3, 6, case.n)  # leading batch axes
    check_kernel(
        op,
        edge_rows(case.in_fmt, case.n, prefix),
        random_rows(case.in_fmt, case.n, 64, rng),
        batched.astype(np.int8 if case.in_fmt.bits <= 8 else np.int16),
        np.zeros((0, case.n), dtype=np.int64),
    )


@pytest.mark.parametrize("cls", [IntLayerNorm, ShiftLayerNorm])
def test_int16_rows_of_65536_fill_int64(cls):
    """N·Σx² and (Σx)² reach 2^62 exactly on a row of -32768s (the analysis lets these
    two, which only form V's subtraction, use int64's headroom bit): the kernel, the
    golden op on torch tensors and the QAT layers' element chain give the golden integers."""
    n, fmt = 65536, QFormat(16, 2.0**-12)
    rng = np.random.default_rng(SEED)
    op = cls.from_float(rng.normal(1, 0.1, n), rng.normal(0, 0.2, n), 1e-5, fmt, QFormat(16, 2.0**-13))
    assert op.ranges()["n_sum_sq"].hi == op.ranges()["sum_squared"].hi == 1 << 62
    check_kernel(op, edge_rows(fmt, n, n), random_rows(fmt, n, 4, rng))
    x = edge_rows(fmt, n, n)
    want = op.forward(x)
    assert np.array_equal(op._forward(torch.from_numpy(x), None).numpy(), want)
    assert np.array_equal(ElementChain(op)(torch.from_numpy(x)).numpy(), want)


@functools.cache
def compiled_norm(cls: type) -> Any:
    """A fixed-N kernel the property test reuses across its examples."""
    op = NormCase(cls, 64).op()
    return op, kernel_for(op).build(host())


@given(
    cls=st.sampled_from([IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm]),
    rows=st.lists(
        st.lists(st.integers(-128, 127), min_size=64, max_size=64), min_size=1, max_size=4
    ),
    center=st.integers(-128, 127),
    spread=st.integers(0, 8),
)
@settings(max_examples=30, deadline=None)
def test_norm_kernels_on_generated_rows(cls, rows, center, spread):
    """Hypothesis rows, plus narrow rows around a centre (small W, large exponents)."""
    op, compiled = compiled_norm(cls)
    x = np.array(rows, dtype=np.int64)
    narrow = np.clip(center + (x % (spread + 1)), -128, 127)
    for v in (x, narrow):
        assert_bit_exact(compiled(v), op.forward(v), v)


GAINS = ("near one", "spread", "log-normal", "constant", "zeros")


@st.composite
def drawn_norm_cases(draw: Any, lengths: tuple[int, ...]) -> tuple[Any, list[np.ndarray]] | None:
    """A norm op of a drawn config and the rows to check it on (those that reach its
    stages' ends, and random ones), or None where the analysis refuses the config
    (refusal is tested elsewhere).  The draws span row lengths, formats (int4..int16),
    gains from near one to zero, large β, every rounding (half up often: the 16-bit
    output stage needs it) and ε = 0."""
    cls = draw(st.sampled_from([IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm]))
    n = draw(st.sampled_from(lengths))
    in_fmt = draw(st.sampled_from([INT4, INT8, INT12, QFormat(8, 2.0**-5), QFormat(16, 0.001)]))
    out_fmt = draw(st.sampled_from([QFormat(8, 2.0**-5), QFormat(4, 0.1), QFormat(16, 2.0**-10)]))
    gains = draw(st.sampled_from(GAINS))
    beta_spread = draw(st.sampled_from([None, None, 0.1, 100.0]))
    rounding = draw(st.one_of(st.just(Round.HALF_UP), st.sampled_from(list(Round))))
    eps = draw(st.sampled_from([0.0, 1e-5, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    gamma = {
        "near one": lambda: rng.normal(1.0, 0.1, n),
        "spread": lambda: rng.normal(0.0, 2.0, n),
        "log-normal": lambda: np.exp(rng.normal(0.0, 2.0, n)) * rng.choice([-1.0, 1.0], n),
        "constant": lambda: np.full(n, 30.0),
        "zeros": lambda: np.where(np.arange(n) % 3 == 0, 0.0, rng.normal(1.0, 0.5, n)),
    }[gains]()
    beta = None if beta_spread is None or cls is IntRMSNorm else rng.normal(0.0, beta_spread, n)
    try:
        op = cls.from_float(gamma, beta, eps, in_fmt, out_fmt, rounding=rounding)
    except OverflowRiskError:
        return None
    prefix = getattr(op.config, "prefix", n)
    return op, [edge_rows(in_fmt, n, prefix), random_rows(in_fmt, n, 16, rng)]


@pytest.mark.slow
@given(drawn_norm_cases(lengths=(1, 3, 31, 64, 129, 768, 4100)))
@settings(max_examples=60, deadline=None)
def test_norm_kernels_on_drawn_configs(case):
    """Drawn configs (:func:`drawn_norm_cases`), row lengths on both sides of the vector
    and block widths: each kernel the op's integers."""
    if case is not None:
        check_kernel(case[0], *case[1])


@pytest.mark.parametrize("cls", [IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm])
def test_norm_kernels_on_every_row_count_around_a_row_block(cls):
    """The per-row chain runs on blocks of ROW_BLOCK rows; the last block's lanes
    past the last row compute a zero row's chain and must not reach the output."""
    op, compiled = compiled_norm(cls)
    rng = np.random.default_rng(SEED)
    for count in (1, ROW_BLOCK - 1, ROW_BLOCK, ROW_BLOCK + 1, 2 * ROW_BLOCK + 3):
        x = rng.integers(-128, 128, (count, 64))
        x[::3] = rng.integers(-128, 128, (len(x[::3]), 1))  # constant rows among them
        assert_bit_exact(compiled(x), op.forward(x), x)


def test_shift_gains_are_one_multiply_on_cpus_and_a_shift_for_hls():
    """ShiftLayerNorm's ±2^l gain: its config.gain multiplies where a multiply is one
    instruction; the HLS kernel keeps the op's shift and conditional negate (no DSP)."""
    from compilers.fpga.kernel_c import HLS

    op = NormCase(ShiftLayerNorm, 64, kw={"mantissa_terms": 2}).op()

    def args(kernel):
        return {str(p.name) for p in kernel.mod["main"].params[1:-1]}

    cpu, hls = args(kernel_for(op)), args(kernel_for(op, HLS))
    assert "gain" in cpu and not {"log2", "neg", "keep"} & cpu
    assert {"log2", "neg", "keep"} <= hls and "gain" not in hls


def test_statistic_reductions_stay_narrow():
    """An int8 row of 768 sums in int32 (Σx² < 2^24), not int64."""
    mod = kernel_for(NormCase(IntLayerNorm, 768).op()).mod
    sums = [b for b in mod["main"].body.block.alloc_buffers if b.name.startswith("row_sum")]
    assert len(sums) == 2 and {str(b.dtype) for b in sums} == {"int32"}


def test_symbolic_rows_refuse_comparisons():
    """A statistic that compares would need a select, which Rows cannot evaluate:
    it must fail at kernel build, not take a branch (== defaults to identity)."""
    x = Rows.of_tensor(tvm.te.placeholder((4, 8), "int8", name="x"), Interval(-128, 127))
    for compare in (lambda: x == 0, lambda: x > 0, lambda: bool(x.sum())):
        with pytest.raises(TypeError, match="symbolic row"):
            compare()
    assert (x * x).iv == Interval(0, 128 * 128) and x.sum().dtype == "int16"


def test_unmirrored_stage_is_refused():
    class Doubled(IntLayerNorm):
        def _scale(self, z):
            return 2 * super()._scale(z)

    op = NormCase(IntLayerNorm, 8).op()
    with pytest.raises(NotImplementedError, match="does not mirror"):
        norm_kernel(Doubled(op.config, op.params))
    with pytest.raises(NotImplementedError, match="no TVM kernel"):
        kernel_for(object())


def test_runner_refuses_inputs_outside_the_format():
    op = NormCase(IntLayerNorm, 2, INT4).op()
    compiled = kernel_for(op).build(host())
    with pytest.raises(ValueError, match="outside the declared"):
        compiled(np.array([[8, 0]]))  # int4 travels in int8: 8 would not wrap, but it is no int4
    with pytest.raises(ValueError, match="rows of shape"):
        compiled(np.zeros((2, 3), dtype=np.int64))


# --------------------------------------------------------------------------- BN + activation


def make_bn(
    channels: list[tuple[int, int, int, int]], shift: int, frac: int, out_frac: int
) -> RationalBN:
    """Channels as integers (G, M, D, B): z = G (2^F x − M) / (D 2^S) + B / 2^Fo."""
    g, m, d, b = (np.array(col, dtype=np.int64) for col in zip(*channels, strict=True))
    return RationalBN(g, shift, m, d, frac, b, out_frac)


def adversarial_bn() -> RationalBN:
    """Ties at every odd x, γ < 0 with ties, thresholds on the grid, γ = 0 (constant
    at a tie and clamped), steep and flat slopes, γ < 0 off the grid."""
    channels = [(2, 0, 2, 0), (-2, 0, 2, 0), (1, 0, 2, 1), (0, 0, 1, 3), (0, 0, 1, -7),
                (40, 0, 4, 0), (1, 0, 16, -1), (-4, 6, 6, 1)]  # fmt: skip
    return make_bn(channels, shift=2, frac=1, out_frac=1)


def random_bn(c: int, rng: np.random.Generator) -> RationalBN:
    g = rng.integers(-(1 << 12), 1 << 12, c)
    g[::5] = 0
    m, d, b = rng.integers(-400, 400, c), rng.integers(1, 1 << 8, c), rng.integers(-600, 600, c)
    return make_bn(
        list(zip(g.tolist(), m.tolist(), d.tolist(), b.tolist(), strict=True)), shift=10, frac=4, out_frac=4
    )


def every_input(fmt: QFormat, c: int) -> np.ndarray:
    """Each input value of the format in every channel: the whole input domain."""
    return np.repeat(np.arange(fmt.lo, fmt.hi + 1)[:, None], c, axis=1)


I8, U2, U4 = QFormat(8, 1.0), QFormat(2, 1.0, signed=False), QFormat(4, 1.0, signed=False)
BN_CASES = [
    *(
        pytest.param(
            adversarial_bn, QFormat(4, 1.0), QFormat(4, 1.0), m, id=f"adversarial-int4-{m.value}"
        )
        for m in Round
    ),
    pytest.param(adversarial_bn, I8, U2, Round.HALF_UP, id="adversarial-int8-uint2"),
    pytest.param(
        lambda: random_bn(67, np.random.default_rng(SEED)),
        I8,
        I8,
        Round.HALF_EVEN,
        id="random67-half_even",
    ),
    pytest.param(  # 768 channels of 255 levels: the int16 count runs in column tiles
        lambda: random_bn(768, np.random.default_rng(SEED + 2)),
        I8,
        I8,
        Round.HALF_UP,
        id="random768-int8",
    ),
    pytest.param(
        lambda: random_bn(16, np.random.default_rng(SEED + 1)),
        I8,
        U4,
        Round.TRUNC,
        id="random16-uint4-trunc",
    ),
]


@pytest.mark.parametrize("bn,in_fmt,out_fmt,mode", BN_CASES)
def test_bnact_kernels_bit_exact_on_every_input(bn, in_fmt, out_fmt, mode):
    cfg = BNActConfig(in_fmt, out_fmt, mode)
    unfolded = BNQuant(cfg, bn())
    c = unfolded.bn.shape[0]
    x = every_input(in_fmt, c)
    for op in (unfolded, unfolded.fold()):
        check_kernel(op, x, x[::-1].reshape(2, -1, c))


def test_multithreshold_per_neuron_parameters():
    """Parameters of shape (3, 4) (one set per neuron) flatten to 12 kernel channels."""
    rng = np.random.default_rng(SEED)
    cfg = BNActConfig(INT8, QFormat(4, 0.1, signed=False), Round.HALF_UP)
    shape = (3, 4)
    gamma, beta, mean = rng.normal(0, 1, shape), rng.normal(0, 0.3, shape), rng.normal(0, 1, shape)
    op = MultiThreshold.from_float(gamma, beta, mean, rng.uniform(0.5, 2, shape), 1e-5, cfg)
    check_kernel(op, rng.integers(-128, 128, (5, *shape)), rng.integers(-128, 128, (2, 7, *shape)))


def test_multithreshold_compares_in_int16():
    """int8 inputs against thresholds one bit wider: 16-bit compares, not 64-bit."""
    op = BNQuant(
        BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0), Round.HALF_UP), adversarial_bn()
    ).fold()
    kernel = kernel_for(op)
    assert kernel.consts[0].dtype == np.int16
    assert 'T.Cast("int16", x[' in kernel.mod.script()


# --------------------------------------------------------------------------- spiking neurons


def neuron_params(c: int, soft: bool, rng: np.random.Generator) -> MPBNParams:
    """γ > 0, γ < 0 and γ = 0 channels; thresholds on the integer grid for every
    fourth channel (θ = M / 2^F − j D 2^S / (G 2^Fo) exactly), so ``>=`` vs ``>`` matters."""
    f, fo, s = 3, 2, 4
    g = rng.integers(1, 1 << 10, c) * rng.choice([1, -1], c)
    g[2::7] = 0
    d = rng.integers(1, 64, c)
    b = rng.integers(-200, 200, c)
    m = rng.integers(-(1 << 9), 1 << 9, c)
    v = rng.integers(-200, 200, c)
    grid = np.arange(c) % 4 == 0
    j = rng.integers(-3, 4, c)
    theta = rng.integers(-20, 20, c)
    m = np.where(grid, (theta << f) - j * (d << s), m)
    v = np.where(grid, b + j * (g << fo), v)
    r = rng.integers(-40, 80, c) if soft else np.zeros(c, dtype=np.int64)
    bn = RationalBN(
        g.astype(np.int64), s, m.astype(np.int64), d.astype(np.int64), f, b.astype(np.int64), fo
    )
    return MPBNParams(bn, v.astype(np.int64), r.astype(np.int64))


LIF_CASES = [
    pytest.param({"reset": "hard", "comparator": ">=", "leak": None}, 37, id="hard-ge-noleak"),
    pytest.param(
        {"reset": "soft", "comparator": ">", "leak": Dyadic(15, 4)}, 37, id="soft-gt-leak"
    ),
    pytest.param(
        {
            "reset": "soft",
            "comparator": ">=",
            "leak": Dyadic(29491, 15),
            "saturate": True,
            "membrane_bits": 10,
        },
        16,
        id="soft-ge-saturate10",
    ),
    pytest.param(
        {"reset": "hard", "comparator": ">", "leak": Dyadic(7, 3), "u_rest": -5},
        64,
        id="hard-gt-urest",
    ),
]


@pytest.mark.parametrize("dyn,c", LIF_CASES)
def test_lif_kernels_bit_exact_over_time(dyn, c):
    """Folded and unfolded neurons, T = 24 steps, currents that keep them firing."""
    rng = np.random.default_rng(SEED + c)
    cfg = LIFConfig(QFormat(6, 0.125), **{"membrane_bits": 16, "max_steps": 32, **dyn})
    unfolded = MPBNNeuron(cfg, neuron_params(c, dyn["reset"] == "soft", rng))
    small = rng.integers(-3, 4, (24, 5, c))  # steps that walk through every membrane value
    full = rng.integers(-32, 32, (24, 2, 3, c))  # batch axes between time and channels
    extremes = np.where(np.arange(24)[:, None, None] % 3 == 0, -32, 31) * np.ones(
        (24, 1, c), dtype=np.int64
    )
    for op in (unfolded, unfolded.fold()):
        check_kernel(op, small, full, extremes, np.zeros((0, 2, c), dtype=np.int64))
        assert np.any(op.forward(full)) and not np.all(op.forward(full))


def test_lif_runner_keeps_the_analysis_horizon():
    """Without leak or saturation a γ > 0 membrane can fall without bound: the
    analysis covers max_steps steps, and the kernel's runner refuses more, as the op does."""
    cfg = LIFConfig(QFormat(6, 0.125), membrane_bits=16, max_steps=8)
    op = FoldedLIFNeuron(cfg, neuron_params(4, False, np.random.default_rng(SEED)))
    assert op.bounds.steps == 8
    compiled = kernel_for(op).build(host())
    with pytest.raises(ValueError, match="time steps exceed"):
        compiled(np.zeros((9, 1, 4), dtype=np.int64))


def test_kernel_dtypes_follow_the_formats():
    op = NormCase(IntRMSNorm, 2, INT4).op()
    kernel = kernel_for(op)
    assert (kernel.in_dtype, kernel.out_dtype) == (fmt_dtype(INT4), "int8") == ("int8", "int8")


def test_a_kernel_refuses_stages_the_op_does_not_record():
    from compilers.tvm.kernels._base import check_mirrored_stages

    check_mirrored_stages("IntLayerNorm", ["stat", "out"], ["stat", "out"], "norm_kernel")
    with pytest.raises(NotImplementedError, match=r"IntLayerNorm's stages \['stat', 'z', 'out'\] .* update norm_kernel"):
        check_mirrored_stages("IntLayerNorm", ["stat", "z", "out"], ["stat", "out"], "norm_kernel")
