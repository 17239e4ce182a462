"""fixedpoint bodies lowered to TIR, compiled for this x86 host, bit-exact vs numpy.

Every kernel is ``elementwise_func(lambda ...: fixedpoint.f(...))``: the TIR comes
from the very function bodies the golden models run, and the reference is the same
function on numpy int64 arrays, compared with ``np.array_equal`` (bit for bit).
Kernels compile into a per-module temporary cache, so every run really compiles.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from cache_damage import DAMAGES

tvm = pytest.importorskip("tvm")
from tvm import te

import compilers.tvm.build as build_mod
from compilers.cache import CACHE_ENV, sha256_file
from compilers.tvm.build import build, cache_dir, dtypes_used, non_integer_dtypes
from compilers.tvm.cpu import schedule_rowwise
from compilers.tvm.primitives import elementwise_func, staged_compute, staged_compute_many
from qnorm import fixedpoint as fp
from qnorm.fixedpoint import Round
from qnorm.targets import load_target

COLS = 64  # static row length: the CPU schedule vectorizes whole rows
MODES = list(Round)
RNG_SEED = 20261130
I62 = 1 << 62


@pytest.fixture(scope="module")
def host():
    return load_target("x86_64")


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("qnorm-cache")))
        yield


def rows(*arrays: np.ndarray) -> list[np.ndarray]:
    """Pad equally long int64 vectors to whole rows of COLS (repeating the first
    element, which is valid input) and reshape to (rows, COLS)."""
    n = len(arrays[0])
    pad = -n % COLS
    return [
        np.concatenate([a, np.full(pad, a[0])]).astype(np.int64).reshape(-1, COLS) for a in arrays
    ]


def run(built, *arrays: np.ndarray) -> np.ndarray:
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros_like(arrays[0]), dev)
    built(*[tvm.runtime.tensor(a, dev) for a in arrays], out)
    return out.numpy()


def assert_bit_exact(got: np.ndarray, want: np.ndarray, *inputs: np.ndarray) -> None:
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)[:5]
        detail = [
            (tuple(int(x[tuple(i)]) for x in inputs), int(got[tuple(i)]), int(want[tuple(i)]))
            for i in bad
        ]
        pytest.fail(f"{int((got != want).sum())} elements differ; (inputs, tvm, numpy): {detail}")


# --------------------------------------------------------------------------- inputs


def _ties(shifts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Values exactly halfway between two multiples of 2**s (and their neighbours)."""
    k = rng.integers(-(1 << 20), 1 << 20, size=len(shifts))
    s = np.maximum(shifts, 1)
    tie = k * (1 << np.minimum(s, 40)) + (1 << (np.minimum(s, 40) - 1))
    return np.concatenate([tie, tie - 1, tie + 1, -tie])


def shift_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    edges = [0, 1, -1, 2, -2, 3, -3, 5, -5, 7, -7, 8, -8, 127, -128, 2**31, -(2**31), I62 - 1, -I62]
    shifts = [0, 1, 2, 3, 7, 13, 31, 40, 61, 62]
    ev, es = np.meshgrid(edges, shifts)
    ts = rng.integers(1, 41, size=512)
    rv = rng.integers(-I62, I62, size=2048)
    rs = rng.integers(0, 63, size=2048)
    v = np.concatenate([ev.ravel(), _ties(ts, rng), rv])
    s = np.concatenate([es.ravel(), np.tile(ts, 4), rs])
    return v, s


def div_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    d_even = 2 * rng.integers(1, 1 << 30, size=256)
    q = rng.integers(-(1 << 30), 1 << 30, size=256)
    tie_n = q * d_even + d_even // 2  # exactly q + 1/2
    edge_n = np.array([0, 1, -1, 2, -2, 3, -3, I62 - 1, -I62, 5, -5, 7, -7])
    n = np.concatenate(
        [
            tie_n,
            tie_n - 1,
            tie_n + 1,
            -tie_n,
            np.repeat(edge_n, 6),
            rng.integers(-I62, I62, size=2048),
        ]
    )
    edge_d = np.tile([1, 2, 3, 4, 7, I62], len(edge_n))
    d_rand = np.where(
        rng.random(2048) < 0.5, rng.integers(1, 1 << 12, size=2048), rng.integers(1, I62, size=2048)
    )
    d = np.concatenate([np.tile(d_even, 4), edge_d, d_rand])
    return n, d


def dyadic_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    v = np.concatenate(
        [[0, 1, -1, 1 << 40, -(1 << 40)], rng.integers(-(1 << 40), 1 << 40, size=2048)]
    )
    m = np.concatenate(
        [[1, -1, (1 << 20), -(1 << 20), 3], rng.integers(-(1 << 20), 1 << 20, size=2048)]
    )
    # products that are exact ties for the shift of 17 used below
    k = rng.integers(-(1 << 20), 1 << 20, size=256)
    return np.concatenate(
        [v, k * (1 << 17) + (1 << 16), -(k * (1 << 17) + (1 << 16))]
    ), np.concatenate([m, np.ones(512, np.int64)])


def sqrt_inputs(rng: np.random.Generator) -> np.ndarray:
    k = np.concatenate(
        [np.arange(0, 300), rng.integers(0, 1 << 31, size=600), [(1 << 31) - 1, 1 << 31]]
    )
    sq = k * k
    v = np.concatenate(
        [sq, sq + 1, np.maximum(sq - 1, 0), rng.integers(0, I62, size=2048), [I62, I62 - 1, 2, 3]]
    )
    return v[v <= I62]


def bitlen_inputs(rng: np.random.Generator) -> np.ndarray:
    p = np.array([1 << k for k in range(62)], dtype=np.int64)
    return np.concatenate([[0, 1, 2, 3, I62 - 1], p, p - 1, p + 1, rng.integers(0, I62, size=1024)])


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    id: str
    fn: Callable
    arity: int
    inputs: Callable[[np.random.Generator], tuple[np.ndarray, ...]]


def _cases() -> list[Case]:
    cs = []
    for m in MODES:
        cs.append(
            Case(
                f"rshift_round[{m.value},per-element-shift]",
                lambda v, s, m=m: fp.rshift_round(v, s, m),
                2,
                shift_inputs,
            )
        )
        for s in (0, 13):
            cs.append(
                Case(
                    f"rshift_round[{m.value},shift={s}]",
                    lambda v, m=m, s=s: fp.rshift_round(v, s, m),
                    1,
                    lambda g: shift_inputs(g)[:1],
                )
            )
        cs.append(
            Case(f"div_round[{m.value}]", lambda n, d, m=m: fp.div_round(n, d, m), 2, div_inputs)
        )
        cs.append(
            Case(
                f"dyadic_mul[{m.value},shift=17]",
                lambda v, k, m=m: fp.dyadic_mul(v, k, 17, m),
                2,
                dyadic_inputs,
            )
        )
    for bits in (40, 64):
        cs.append(
            Case(
                f"saturate[{bits},signed]",
                lambda v, b=bits: fp.saturate(v, b),
                1,
                lambda g: (np.concatenate([shift_inputs(g)[0], [1 << 39, -(1 << 39) - 1]]),),
            )
        )
    cs.append(Case("bit_length[62]", lambda v: fp.bit_length(v), 1, lambda g: (bitlen_inputs(g),)))
    cs.append(
        Case(
            "bit_length[16]",
            lambda v: fp.bit_length(v, 16),
            1,
            lambda g: (bitlen_inputs(g) & 0xFFFF,),
        )
    )
    cs.append(Case("isqrt[62]", lambda v: fp.isqrt(v), 1, lambda g: (sqrt_inputs(g),)))
    cs.append(Case("isqrt_round[62]", lambda v: fp.isqrt_round(v), 1, lambda g: (sqrt_inputs(g),)))
    for m in fp.RSQRT_MODES:
        cs.append(
            Case(
                f"rsqrt[{m.value},frac=15]",
                lambda v, m=m: fp.rsqrt(v, 15, m),
                1,
                lambda g: (np.maximum(sqrt_inputs(g), 1),),
            )
        )
    cs.append(
        Case(
            "rsqrt[half_up,frac=30]",
            lambda v: fp.rsqrt(v, 30),
            1,
            lambda g: (np.maximum(sqrt_inputs(g), 1),),
        )
    )
    for m in (Round.HALF_UP, Round.FLOOR):
        cs.append(
            Case(
                f"reciprocal[{m.value},frac=40]",
                lambda d, m=m: fp.reciprocal(d, 40, m),
                1,
                lambda g: (div_inputs(g)[1],),
            )
        )
    return cs


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_primitive_bit_exact_on_x86(case, host):
    """One compile per case (xdist would split separate tests over workers and
    compile twice): the kernel is integer-only, then bit-exact."""
    func = elementwise_func(case.fn, case.arity, COLS)
    mod = schedule_rowwise(func, "out")
    for m in (func, mod):
        assert non_integer_dtypes(m) == frozenset()
        assert "int64" in dtypes_used(m)
    inputs = rows(*case.inputs(np.random.default_rng(RNG_SEED)))
    assert_bit_exact(run(build(mod, host), *inputs), case.fn(*inputs), *inputs)


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.id in ("isqrt[62]", "div_round[half_even]", "rsqrt[ceil,frac=15]")],
    ids=lambda c: c.id,
)
def test_default_schedule_agrees(case, host):
    """The staging alone is exact: TVM's default (unscheduled) build agrees too."""
    inputs = rows(*case.inputs(np.random.default_rng(RNG_SEED + 1)))
    built = build(elementwise_func(case.fn, case.arity, COLS), host)
    assert_bit_exact(run(built, *inputs), case.fn(*inputs), *inputs)


# --------------------------------------------------------------------------- operand mixes that once failed to lower


@pytest.mark.parametrize("bits,signed", [(8, True), (32, True), (8, False), (40, False)])
def test_saturate_narrow_or_unsigned_lowers(bits, signed, host):
    func = elementwise_func(lambda v: fp.saturate(v, bits, signed), 1, COLS)
    (v,) = rows(shift_inputs(np.random.default_rng(RNG_SEED))[0])
    assert_bit_exact(
        run(build(schedule_rowwise(func, "out"), host), v), fp.saturate(v, bits, signed), v
    )


def test_rshift_round_by_computed_shift_lowers(host):
    func = elementwise_func(lambda v, s: fp.rshift_round(v, s & 31), 2, COLS)
    v, s = rows(*shift_inputs(np.random.default_rng(RNG_SEED)))
    assert_bit_exact(
        run(build(schedule_rowwise(func, "out"), host), v, s), fp.rshift_round(v, s & 31), v, s
    )


# --------------------------------------------------------------------------- row-wise schedule


def test_rowwise_schedule_with_reduction_and_row_scalars(host):
    """Parallel rows, a row reduction, a per-row isqrt-based scalar and per-element
    stages: the shape every norm kernel has, scheduled by schedule_rowwise."""
    nrows = te.var("rows", "int64")
    x = te.placeholder((nrows, COLS), "int64", name="x")
    k = te.reduce_axis((0, COLS), name="k")
    ss = te.compute((nrows,), lambda r: te.sum(x[r, k] * x[r, k], axis=k), name="ss")
    inv = staged_compute(
        (nrows,), lambda r: fp.rsqrt(fp.div_round(ss[r], COLS) + 1, 15), name="inv"
    )
    y = staged_compute(
        (nrows, COLS), lambda r, c: fp.rshift_round(x[r, c] * inv[r], 9, Round.HALF_EVEN), name="y"
    )
    mod = schedule_rowwise(te.create_prim_func([x, y]), "y")
    assert non_integer_dtypes(mod) == frozenset()

    rng = np.random.default_rng(RNG_SEED)
    xv = rng.integers(-(1 << 15), 1 << 15, size=(37, COLS))
    xv[0] = 0  # rsqrt(1): the +1 keeps the operand >= 1
    xv[1, ::2] = -(1 << 15)
    want = fp.rshift_round(
        xv * fp.rsqrt(fp.div_round((xv * xv).sum(axis=1), COLS) + 1, 15)[:, None],
        9,
        Round.HALF_EVEN,
    )
    assert_bit_exact(run(build(mod, host), xv), want, xv)


def test_results_of_one_call_share_their_stages(host):
    """A bit length and the value it normalizes, from one DAG: its search is
    staged once (the bit length, used by the other result, under its own name),
    where one staged_compute per result stages it twice; the integers agree."""
    nrows = te.var("rows", "int64")
    x = te.placeholder((nrows, COLS), "int64", name="x")

    def split(r, c):
        n = fp.bit_length(x[r, c], 40)
        return n, x[r, c] >> n

    def stages(parts: list[te.Tensor]) -> tuple[int, te.Tensor]:
        y = te.compute((nrows, COLS), lambda r, c: parts[0][r, c] * 64 + parts[1][r, c], name="y")
        return len(te.create_prim_func([x, y]).body.block.alloc_buffers), y

    shared, y = stages(staged_compute_many((nrows, COLS), split, ("n", "rest")))
    apart, _ = stages([staged_compute((nrows, COLS), lambda r, c, i=i: split(r, c)[i], f"p{i}") for i in (0, 1)])
    assert shared < apart

    xv = np.random.default_rng(RNG_SEED).integers(0, 1 << 40, size=(5, COLS))
    n = fp.bit_length(xv, 40)
    mod = schedule_rowwise(te.create_prim_func([x, y]), "y")
    assert_bit_exact(run(build(mod, host), xv), n * 64 + (xv >> n), xv)


def test_schedule_rowwise_rejects_1d_output():
    a = te.placeholder((8,), "int64", name="a")
    b = te.compute((8,), lambda i: a[i] + 1, name="b")
    with pytest.raises(ValueError, match="row and column"):
        schedule_rowwise(te.create_prim_func([a, b]), "b")


# --------------------------------------------------------------------------- dtype walker


def _float_kernels():
    a = te.placeholder((4, COLS), "int64", name="a")
    in_expr = te.compute(
        (4, COLS), lambda r, c: (a[r, c].astype("float32") * 0.5).astype("int64"), name="b"
    )
    yield "float32 in an expression", te.create_prim_func([a, in_expr]), {"float32"}
    half = te.compute((4, COLS), lambda r, c: a[r, c].astype("float64"), name="half")
    back = te.compute((4, COLS), lambda r, c: half[r, c].astype("int64"), name="back")
    yield "float64 intermediate buffer", te.create_prim_func([a, back]), {"float64"}
    bf = te.placeholder((4, COLS), "bfloat16", name="bf")
    yield (
        "bfloat16 argument",
        te.create_prim_func(
            [bf, te.compute((4, COLS), lambda r, c: bf[r, c].astype("int32"), name="o")]
        ),
        {"bfloat16"},
    )


@pytest.mark.parametrize(
    "func,floats", [pytest.param(f, fl, id=what) for what, f, fl in _float_kernels()]
)
def test_dtype_walker_finds_floats(func, floats, host):
    assert non_integer_dtypes(func) == floats
    assert floats <= dtypes_used(func)
    with pytest.raises(ValueError, match="non-integer dtypes"):
        build(func, host)


# --------------------------------------------------------------------------- cache


def _fresh_kernel():
    """A new PrimFunc object with identical content on every call."""
    return schedule_rowwise(
        elementwise_func(lambda v, s: fp.rshift_round(v, s, Round.HALF_AWAY) + 3, 2, COLS), "out"
    )


def test_second_build_is_a_cache_hit(host, monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path / "tvm"
    first = build(_fresh_kernel(), host)
    assert not first.cache_hit
    assert first.path.parent.parent == tmp_path / "tvm" and first.path.exists()

    def no_compile(*args, **kwargs):
        raise AssertionError("cache hit must not compile")

    monkeypatch.setattr(build_mod.tvm, "compile", no_compile)
    t0 = time.perf_counter()
    second = build(_fresh_kernel(), host)
    elapsed = time.perf_counter() - t0
    assert second.cache_hit and second.key == first.key and second.path == first.path
    print(
        f"\ncompile+export {first.seconds * 1e3:.1f} ms, cache hit {elapsed * 1e3:.1f} ms (load {second.seconds * 1e3:.2f} ms)"
    )

    v, s = rows(*shift_inputs(np.random.default_rng(RNG_SEED)))
    assert_bit_exact(run(second, v, s), fp.rshift_round(v, s, Round.HALF_AWAY) + 3, v, s)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_library_is_built_again_never_loaded(host, monkeypatch, tmp_path, caplog, damage):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first = build(_fresh_kernel(), host)
    clean = sha256_file(first.path)
    spoil, words = DAMAGES[damage]
    spoil(first.path.parent, first.path.name)
    again = build(_fresh_kernel(), host)
    assert not again.cache_hit and again.path == first.path
    assert sha256_file(again.path) == clean  # the clean build's bytes (the kernel build is reproducible)
    assert str(first.path.parent) in caplog.text and words in caplog.text
    v, s = rows(*shift_inputs(np.random.default_rng(RNG_SEED)))
    assert_bit_exact(run(again, v, s), fp.rshift_round(v, s, Round.HALF_AWAY) + 3, v, s)


def test_cache_key_depends_on_module_and_target(host):
    from dataclasses import replace
    from types import MappingProxyType

    key = build_mod.cache_key(_fresh_kernel(), host)
    assert key == build_mod.cache_key(_fresh_kernel(), host)
    other_mod = schedule_rowwise(
        elementwise_func(lambda v, s: fp.rshift_round(v, s, Round.HALF_AWAY) + 4, 2, COLS), "out"
    )
    assert build_mod.cache_key(other_mod, host) != key
    generic = replace(host, tvm=MappingProxyType({**host.tvm, "mcpu": "x86-64"}))
    assert build_mod.cache_key(_fresh_kernel(), generic) != key


def test_build_refuses_targets_that_do_not_run_here():
    with pytest.raises(ValueError, match="qemu-user"):
        build(_fresh_kernel(), load_target("aarch64"))
