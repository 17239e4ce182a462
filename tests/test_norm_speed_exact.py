"""The fast derivations of the norm ops equal their exact definitions.

``from_float`` / the QAT ``golden()`` path runs every training step, so the range
analysis is split (a cached row part keyed by the structural config, a vectorized
output part), the per-exponent bounds are integer arithmetic instead of
``Fraction``s, β is rounded vectorized, and the QAT body skips fixedpoint's
per-call range checks inside :func:`qnorm.fixedpoint.proven_ranges`.  None of that
may change an integer: each piece is checked here against the rational definition
it replaced (written out below exactly as it stood before), on random and
adversarial values.
"""

import dataclasses
import functools
import math
import threading
from fractions import Fraction

import numpy as np
import pytest
import torch

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import Round
from qnorm.ops import NORMS, IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops import _normcore as core
from qnorm.ops.shiftnorm import SQRT2, negate_mask, nonzero_mask, round_log2, round_log2_floats, signed_term
from qnorm.qformat import QFormat

# --------------------------------------------------------------------------- the rational definitions


def ref_ratio_on(stat: core.StatBounds, seg: Interval) -> Fraction:
    best = Fraction(0)
    if stat.kappa:
        kink = min(max(Fraction(stat.cap) / stat.kappa + stat.eps, Fraction(seg.lo)), Fraction(seg.hi))
        best = max(min(stat.kappa * (kink - stat.eps), Fraction(stat.cap)), Fraction(0)) / kink
    if stat.outside is not None:
        best = max(best, Fraction(stat.outside, seg.lo))
    return best


def ref_numerator_by_exponent(cfg, stat, segs):
    p, h = cfg.p, cfg.num_shift
    out = {}
    for e, seg in segs.items():
        t = e - h
        rel = core.floor_root(ref_ratio_on(stat, seg) * seg.hi * Fraction(2) ** (p * -t), p) + (t > 0)
        a = stat.num.rshift(t, cfg.rounding) if t > 0 else stat.num * (1 << -t)
        lo, hi = max(a.lo, -rel), min(a.hi, rel)
        if lo <= hi:
            out[e] = Interval(lo, hi)
    return out


def ref_product_bound(cfg, stat, segs, by_exp, r_max):
    p, f, h = cfg.p, cfg.inv_frac_bits, cfg.num_shift
    best = 0
    for e, u in by_exp.items():
        seg, truncated, rounded = segs[e], e > 0, e > h
        rp = ref_ratio_on(stat, seg) * (1 << (p * h))
        x_lo, x_hi = (Fraction(v) / Fraction(2) ** (p * e) for v in (seg.lo, seg.hi))
        main = core.ceil_root(rp * (1 << (p * f)) * x_lo / (x_lo - truncated), p)
        r_err = core.ceil_root(rp * x_hi, p)
        u_err = core.ceil_root(Fraction(1 << (p * f)) / (x_lo - truncated), p) + 1 if rounded else 0
        best = max(best, min(main + r_err + u_err, max(-u.lo, u.hi) * r_max))
    return best


def ref_mantissa_range(e, seg, cfg):
    return seg.rshift(cfg.p * e, Round.FLOOR) if e > 0 else seg * (1 << (-cfg.p * e))


def ref_shift_product_bound(op_cls, cfg, stat, segs, by_exp):
    prod = 0
    h = cfg.num_shift
    for e, u_iv in by_exp.items():
        ratio, u_cap = ref_ratio_on(stat, segs[e]) * (1 << (2 * h)), max(-u_iv.lo, u_iv.hi)
        for cand, _, hi in op_cls._segments(cfg, ref_mantissa_range(e, segs[e], cfg)):
            u = min(u_cap, core.floor_root(ratio * (hi + (e > 0)), 2) + (e > h))
            prod = max(prod, u * cand.value)
    return prod


def ref_inverse_range(op_cls, cfg, m_iv):
    if op_cls in (IntLayerNorm, IntRMSNorm):  # the uncached fixedpoint.rsqrt
        mode = core.rsqrt_mode(cfg.rounding)
        return Interval(fp.rsqrt(m_iv.hi, cfg.inv_frac_bits, mode), fp.rsqrt(m_iv.lo, cfg.inv_frac_bits, mode))
    return op_cls._inverse_range(cfg, m_iv)


def ref_products(op_cls, cfg, stat, segs, inv):
    """Per exponent: (max |num r| as a Fraction, max |u r|), from the rational bounds."""
    by_exp = ref_numerator_by_exponent(cfg, stat, segs)
    out = {}
    for e, u in by_exp.items():
        if op_cls is ShiftLayerNorm:
            pb = ref_shift_product_bound(op_cls, cfg, stat, {e: segs[e]}, {e: u})
        else:
            pb = ref_product_bound(cfg, stat, {e: segs[e]}, {e: u}, inv.hi)
        pb += inv.hi if e > cfg.num_shift else 0
        out[e] = (pb * Fraction(2) ** (e - cfg.num_shift), pb)
    return out


def ref_shifts(cfg, e, j):
    k0 = e + cfg.inv_frac_bits - cfg.frac_bits - cfg.num_shift
    jr = min(max(k0, 0), j)
    up = max(jr - k0, 0)
    return jr, up, k0 - jr + up


def ref_span(cfg):
    lo, hi = cfg.in_fmt.lo, cfg.in_fmt.hi
    return hi - lo if cfg.centered else max(-lo, hi)


def ref_xa(cfg, products, j):
    best = 0
    for e, (num_r, _) in products.items():
        jr, up, _ = ref_shifts(cfg, e, j)
        best = max(best, math.floor(num_r * 2**up / 2**jr) + (ref_span(cfg) + 1 if jr else 0))
    return best


def ref_row(op_cls, cfg, stat, segs, inv, rep):
    """mult, offset, z_shift of the narrow-lane definition (per exponent, then hulls)."""
    products = ref_products(op_cls, cfg, stat, segs, inv)
    fits = [j for j in range(63) if ref_xa(cfg, products, j) < 2 ** (cfg.lanes - 2)]
    if not fits:
        raise OverflowRiskError(f"{cfg.n}-element rows do not fit a {cfg.lanes}-bit datapath at any multiplier shift")
    j = fits[0]
    shifts = {ref_shifts(cfg, e, j) for e in segs}
    nr = Interval(inv.lo * cfg.num_mult, inv.hi * cfg.num_mult)
    a_ends = [(nr.rshift(jr, cfg.rounding), up) for jr, up, _ in shifts]
    rep.add("mult", Interval(min(a.lo << up for a, up in a_ends), max(a.hi << up for a, up in a_ends)))
    if cfg.centered:
        lo, hi = cfg.in_fmt.lo, cfg.in_fmt.hi
        offs = [Interval(min(lo * a.hi, lo * a.lo) - 1, max(hi * a.hi, hi * a.lo) + 1) * (1 << up) for a, up in a_ends]
        rep.add("offset", Interval(min(v.lo for v in offs), max(v.hi for v in offs)))
    ks = [k for *_, k in shifts]
    rep.add("z_shift", Interval(min(ks), max(ks)))
    rep.check()
    return products, j


def ref_normalized(cfg, products, j, rep):
    if rep is not None:
        xa = ref_xa(cfg, products, j)
        rep.add("xa", Interval(-xa, xa))
    t = Fraction(0)
    for e, (_, pb) in products.items():
        jr, _, k = ref_shifts(cfg, e, j)
        err = Fraction(ref_span(cfg) + 1, 2**k) if jr else 0
        t = max(t, Fraction(pb, 2 ** (cfg.inv_frac_bits - cfg.frac_bits)) + err + (1 if k > 0 else 0))
    z = Interval(-math.floor(t), math.floor(t))
    return z if rep is None else rep.add("z", z)


def ref_window(cfg, m, b0, z):
    """(lo, hi, off, bias) of one channel, in Python ints (NormOp's output window)."""
    top, bot = (cfg.out_fmt.hi + 1) << cfg.shift, (cfg.out_fmt.lo - 1) << cfg.shift
    if m == 0:
        return 0, 0, 0, b0
    off = -(b0 // m)
    b = b0 + off * m
    ends = sorted([Fraction(top - b, m), Fraction(bot - b, m)])
    wl, wh = math.floor(ends[0]), math.ceil(ends[1])
    fl, fh = z.lo - off, z.hi - off
    lo, hi = max(wl, fl), min(wh, fh)
    if lo > hi:
        high = (m > 0) == (fl > wh)
        return 0, 0, 0, top if high else bot
    return lo + off, hi + off, off, b


def ref_ranges(op_cls, cfg) -> RangeReport:
    """The unsplit analysis, per channel, in rationals."""
    rep = RangeReport(op_cls.name)
    stat = core.add_eps_ranges(rep, op_cls._statistic_ranges(cfg, rep), cfg)
    rep.check()
    segs = core.exponent_segments(stat.w, cfg)
    rep.add("exp", Interval(min(segs), max(segs)))
    mants = [ref_mantissa_range(e, seg, cfg) for e, seg in segs.items()]
    m_iv = rep.add("mant", Interval(min(m.lo for m in mants), max(m.hi for m in mants)))
    inv = rep.add(op_cls.inverse_name, ref_inverse_range(op_cls, cfg, m_iv))
    products, j = ref_row(op_cls, cfg, stat, segs, inv, rep)
    z = ref_normalized(cfg, products, j, rep)
    rep.check()
    zs = [z] * cfg.n
    if op_cls is IntRMSNorm and cfg.prefix < cfg.n:
        inner = ref_products(op_cls, cfg, dataclasses.replace(stat, outside=None), segs, inv)
        zs = [ref_normalized(cfg, inner, j, None)] * cfg.prefix + [z] * (cfg.n - cfg.prefix)
    wins = [ref_window(cfg, m, b, zc) for m, b, zc in zip(cfg.gain, cfg.bias, zs, strict=True)]
    zcs = [Interval(lo - off, hi - off) for lo, hi, off, _ in wins]
    rep.add("zc", Interval(min(v.lo for v in zcs), max(v.hi for v in zcs)))
    prods = [zc * m for zc, m in zip(zcs, cfg.gain, strict=True)]
    rep.add("scaled", Interval(min(v.lo for v in prods), max(v.hi for v in prods)))
    sums = [v + w[3] for v, w in zip(prods, wins, strict=True)]
    acc = rep.add("acc", Interval(min(v.lo for v in sums), max(v.hi for v in sums)))
    rep.check()
    y = rep.add("y", acc.rshift(cfg.shift, cfg.rounding))
    rep.add("out", y.clamp(cfg.out_fmt.lo, cfg.out_fmt.hi))
    core.check_lanes(rep, cfg)
    return rep


def outcome(f):
    """The report's entries, or the refusal's type and message."""
    try:
        return list(f().items.items())
    except OverflowRiskError as err:
        return ("refused", str(err))


# --------------------------------------------------------------------------- random configs

KINDS = {
    "ln": (IntLayerNorm, {}),
    "l1": (L1LayerNorm, {}),
    "shift1": (ShiftLayerNorm, {"mantissa_terms": 1}),
    "shift2": (ShiftLayerNorm, {"mantissa_terms": 2}),
    "rms": (IntRMSNorm, {}),
    "prms": (IntRMSNorm, {"partial": 0.3}),
}


def random_op(seed: int):
    rng = np.random.default_rng([99, seed])
    cls, kw = KINDS[list(KINDS)[seed % len(KINDS)]]
    n = int(rng.integers(1, 17)) if rng.random() < 0.3 else int(np.exp(rng.uniform(np.log(17), np.log(4096))))
    scale = float(2.0 ** rng.integers(-14, 5) * rng.uniform(1, 2))
    in_fmt = QFormat(int(rng.integers(4, 17)), scale, rng.random() < 0.9)
    out_fmt = (
        QFormat.power_of_two(int(rng.choice([4, 8, 16])), int(rng.integers(-12, 1)))
        if rng.random() < 0.5
        else QFormat(int(rng.choice([4, 8, 16])), float(rng.uniform(0.001, 0.5)), rng.random() < 0.9)
    )
    eps = float(rng.choice([0.0, 1e-6, 1e-5, 1e-2, 1.0, 1e3]))
    gamma = rng.normal(1.0, 0.5, n) * rng.choice([1.0, -1.0], n, p=[0.85, 0.15])
    gamma[rng.random(n) < 0.05] = 0.0
    beta = rng.normal(0, 0.5, n) * (1e12 if rng.random() < 0.1 else 1.0)
    widths = {}
    if rng.random() < 0.3:
        widths["mant_bits"] = int(rng.choice([8, 12, 20]))
    if rng.random() < 0.3:
        widths["frac_bits"] = int(rng.choice([0, 3, 7]))
    mode = list(Round)[int(rng.integers(0, len(Round)))]
    return cls.from_float(gamma, beta, eps, in_fmt, out_fmt, rounding=mode, **kw, **widths)


@pytest.mark.parametrize("seed", range(60))
def test_split_cached_analysis_equals_the_unsplit_rational_one(seed):
    op = random_op(seed)
    want = outcome(lambda: ref_ranges(type(op), op.config))
    core.row_cache_clear()
    assert outcome(op.ranges) == want  # cold: computed
    assert outcome(op.ranges) == want  # warm: from the cache


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_neighbouring_guards_and_widths_refuse_exactly_as_before(seed):
    """Configs around the built one (more or fewer ε guard bits, other F_z): the same
    report, or the same refusal with the same message."""
    op = random_op(seed)
    cfg = op.config
    eps_s = cfg.eps_exact(op.params.eps)
    variants = []
    for g in range(0, 62 // cfg.p + 1, 3):
        variants.append(dataclasses.replace(cfg, eps_shift=g, eps=core.round_rational(eps_s * (1 << (cfg.p * g)))))
    variants.append(dataclasses.replace(cfg, frac_bits=cfg.inv_frac_bits))
    for v in variants:
        report = functools.partial(type(op)._report, v, np.asarray(v.gain), np.asarray(v.bias))
        assert outcome(report) == outcome(functools.partial(ref_ranges, type(op), v))


def test_row_analysis_depends_only_on_its_key():
    """Input scale, output format, gains, biases and shift are not in the key: configs
    differing only there share one cached row analysis, and each one's full report
    still equals its own rational analysis."""
    core.row_cache_clear()
    rng = np.random.default_rng(4)
    n, fmt = 48, QFormat(8, 0.05)
    ops = [
        IntLayerNorm.from_float(rng.normal(1, 0.3, n), rng.normal(0, 0.3, n), 1e-5, fmt, QFormat(8, s), frac_bits=9)
        for s in (1 / 32, 0.07, 1 / 8)
    ]
    cfgs = [dataclasses.replace(op.config, in_fmt=QFormat(8, 0.3)) for op in ops]  # same ε_int, other scale
    assert len({core.row_key(c) for c in [op.config for op in ops] + cfgs}) == 1
    for cfg in [op.config for op in ops] + cfgs:
        want = outcome(lambda: ref_ranges(IntLayerNorm, cfg))  # noqa: B023 (called at once)
        assert outcome(lambda: IntLayerNorm(cfg, ops[0].params).ranges()) == want  # noqa: B023
    info = core._cached_row_analysis.cache_info()
    assert info.misses == 1


def test_eps_guard_search_and_final_constructor_hit_the_cache(monkeypatch):
    """One row analysis per guard tried (refused ones included); the constructor
    reuses the accepted one; a second from_float of the same structural config (new
    γ, β with the same F_z: a training step) computes none."""
    calls = []
    real = IntLayerNorm._row_ranges.__func__

    def counting(cls, cfg):
        calls.append(cfg.eps_shift)
        return real(cls, cfg)

    monkeypatch.setattr(IntLayerNorm, "_row_ranges", classmethod(counting))
    guard = core.eps_guard_bits
    # start the search far too high, so the analysis refuses guard after guard
    monkeypatch.setattr(core, "eps_guard_bits", lambda eps_s, stat_hi, p, stat_floor, stat_bits: 61 // p)
    core.row_cache_clear()
    fmt = QFormat(8, 0.03)
    a = IntLayerNorm.from_float(np.ones(64), None, 1e-5, fmt)
    assert calls == list(range(30, a.config.eps_shift - 1, -1)) and len(calls) > 5
    b = IntLayerNorm.from_float(np.full(64, 0.9), np.full(64, 0.2), 1e-5, fmt)
    assert len(calls) == 31 - a.config.eps_shift and b.config.eps_shift == a.config.eps_shift
    monkeypatch.setattr(core, "eps_guard_bits", guard)
    core.row_cache_clear()
    calls.clear()
    c = IntLayerNorm.from_float(np.ones(64), None, 1e-5, fmt)
    assert calls == [c.config.eps_shift]  # accepted at once; the constructor reuses it
    assert c.config.eps_shift <= a.config.eps_shift  # the largest guard the analysis accepts


def test_refusal_is_cached_and_raised_every_time():
    core.row_cache_clear()
    for _ in range(2):
        with pytest.raises(OverflowRiskError, match="'n_sum_sq'"):
            IntLayerNorm.from_float(np.ones(1 << 17), in_fmt=QFormat(16, 1.0))
        with pytest.raises(OverflowRiskError, match="eps = 1e\\+30 is"):
            IntRMSNorm.from_float(np.ones(8), eps=1e30)


# --------------------------------------------------------------------------- integer bounds


def random_stat(rng) -> tuple[core.StatBounds, list[Interval]]:
    kappa = Fraction(int(rng.integers(0, 5000)), int(rng.choice([1, 2])) << int(rng.integers(0, 40)))
    cap = int(rng.integers(0, 1 << int(rng.integers(1, 60))))
    eps = int(rng.integers(0, 1 << int(rng.integers(1, 40))))
    outside = None if rng.random() < 0.6 else int(rng.integers(0, 1 << 30))
    stat = core.StatBounds(Interval(0, 1), Interval(-1, 1), kappa, cap, outside, eps)
    segs = []
    for _ in range(8):
        lo = int(rng.integers(1, 1 << int(rng.integers(1, 62))))
        segs.append(Interval(lo, lo + int(rng.integers(0, 1 << int(rng.integers(0, 40))))))
    if kappa:  # segments that start, end or sit exactly at the kink cap/kappa + eps
        kink = Fraction(cap) / kappa + eps
        k = math.ceil(kink)
        if k >= 1:
            segs += [Interval(k, k + 5), Interval(max(1, k - 5), k), Interval(k, k), Interval(k + 1, k + 9)]
    return stat, segs


@pytest.mark.parametrize("seed", range(40))
def test_integer_ratio_equals_the_rational_sup(seed):
    rng = np.random.default_rng([7, seed])
    stat, segs = random_stat(rng)
    for seg in segs:
        n, d = stat.ratio_terms(seg)
        assert d > 0 and Fraction(n, d) == ref_ratio_on(stat, seg) == stat.ratio_on(seg)


@pytest.mark.parametrize("seed", range(60))
def test_integer_per_exponent_bounds_equal_the_rational_ones(seed):
    """numerator_by_exponent and product_bound on the ops' own statistics, with
    random ε, guards and widths (both p = 1 and p = 2)."""
    op = random_op(seed)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        g = int(rng.integers(0, 62 // op.config.p + 1))
        cfg = dataclasses.replace(op.config, eps_shift=g, eps=int(rng.integers(0, 1 << int(rng.integers(1, 40)))))
        rep = RangeReport("t")
        stat = core.add_eps_ranges(rep, type(op)._statistic_ranges(cfg, rep), cfg)
        try:
            rep.check()  # as the analysis does before going on
        except OverflowRiskError:
            continue
        segs = core.exponent_segments(stat.w, cfg)
        by_exp = core.numerator_by_exponent(cfg, stat, segs)
        assert by_exp == ref_numerator_by_exponent(cfg, stat, segs)
        for e, seg in segs.items():
            assert core.mantissa_range(e, seg, cfg) == ref_mantissa_range(e, seg, cfg)
        if by_exp and not isinstance(op, ShiftLayerNorm):
            r_max = int(rng.integers(1, 1 << 20))
            want = ref_product_bound(cfg, stat, segs, by_exp, r_max)
            assert core.product_bound(cfg, stat, segs, by_exp, r_max) == want
        if by_exp and isinstance(op, ShiftLayerNorm):
            got = ShiftLayerNorm._product_bound(cfg, stat, segs, by_exp, Interval(1, 2))
            assert got == ref_shift_product_bound(ShiftLayerNorm, cfg, stat, segs, by_exp)


def ref_output_ranges(rep, cfg, gain, bias, zs):
    wins = [ref_window(cfg, int(m), int(b), z) for m, b, z in zip(gain, bias, zs, strict=True)]
    zcs = [Interval(lo - off, hi - off) for lo, hi, off, _ in wins]
    rep.add("zc", Interval(min(v.lo for v in zcs), max(v.hi for v in zcs)))
    prods = [zc * int(m) for zc, m in zip(zcs, gain, strict=True)]
    rep.add("scaled", Interval(min(v.lo for v in prods), max(v.hi for v in prods)))
    sums = [v + w[3] for v, w in zip(prods, wins, strict=True)]
    acc = rep.add("acc", Interval(min(v.lo for v in sums), max(v.hi for v in sums)))
    rep.check()
    y = rep.add("y", acc.rshift(cfg.shift, cfg.rounding))
    rep.add("out", y.clamp(cfg.out_fmt.lo, cfg.out_fmt.hi))


@pytest.mark.parametrize("seed", range(40))
def test_vectorized_output_stage_equals_the_per_channel_hull(seed):
    """Runs of channels with their own z, constant and varying biases, and products
    too wide for int64 (the exact Python-int path, then a refusal by name)."""
    rng = np.random.default_rng([11, seed])
    n = int(rng.integers(1, 300))
    cfg = dataclasses.replace(IntLayerNorm.from_float(np.ones(n)).config, shift=int(rng.integers(0, 50)))
    gain = rng.integers(-(1 << 15), 1 << 15, n)
    bias = np.full(n, int(rng.integers(-100, 100))) if seed % 4 == 0 else rng.integers(-(1 << 40), 1 << 40, n)
    zbits = int(rng.choice([10, 30, 47, 50, 60]))
    cut = int(rng.integers(0, n + 1))
    runs = [(0, cut), (cut, n)] if 0 < cut < n else [(0, n)]
    chans = []
    for a, b in runs:
        lo = -int(rng.integers(0, 1 << zbits))
        chans.append((a, b, Interval(lo, lo + int(rng.integers(0, 1 << zbits)))))
    zs = [iv for a, b, iv in chans for _ in range(b - a)]
    got, want = RangeReport("t"), RangeReport("t")

    def vectorized() -> RangeReport:
        hulls = core.channel_hulls(gain, core.output_window(cfg, gain, bias, tuple(chans)))
        core.output_ranges(got, cfg, hulls)
        return got

    g = outcome(vectorized)
    w = outcome(lambda: (ref_output_ranges(want, cfg, gain, bias, zs), want)[1])
    assert g == w


# --------------------------------------------------------------------------- β in accumulator units


def exact_bias(beta, shift, s_out):
    return [core.round_rational(Fraction(float(b)) * (1 << shift) / Fraction(s_out)) for b in beta]


def adversarial_betas(rng, shift: int, s_out: float, count: int) -> np.ndarray:
    """Ties (k + 1/2) s_out 2^-shift where float64 holds them exactly, values a few
    ulps either side, random values of every size, zeros, subnormals, huge values."""
    k = rng.integers(-(1 << 20), 1 << 20, count).astype(np.float64)
    ties = np.ldexp((k + 0.5) * s_out, -shift)
    near = np.concatenate([np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)])
    near2 = np.concatenate([np.nextafter(np.nextafter(ties, np.inf), np.inf), np.nextafter(near[count:], -np.inf)])
    wide = rng.normal(0, 1, count) * 10.0 ** rng.integers(-300, 300, count)
    big = np.ldexp(rng.normal(0, 1, count), rng.integers(30, 70, count) - shift)  # |β 2^s / s_out| near 2^36 .. 2^62
    special = np.array([0.0, -0.0, 5e-324, -5e-324, 1e-310, np.finfo(np.float64).max, -np.finfo(np.float64).max])
    return np.concatenate([ties, near, near2, wide, big, rng.normal(0, 0.5, count), special])


SCALES = [2.0**-5, 2.0**-12, 0.375, 3 * 2.0**-9, 0.03, 0.1, 1 / 3, 0.7071067811865476]


@pytest.mark.parametrize("s_out", SCALES)
@pytest.mark.parametrize("shift", [0, 1, 13, 27, 51])
def test_scaled_round_equals_exact_rounding(s_out, shift):
    rng = np.random.default_rng([shift, SCALES.index(s_out)])
    beta = adversarial_betas(rng, shift, s_out, 400)
    got, left = core.scaled_round(beta, shift, s_out)
    want = exact_bias(beta[~left], shift, s_out)
    assert got[~left].tolist() == want
    exact = [Fraction(float(b)) * (1 << shift) / Fraction(s_out) for b in beta]
    exact_ties = [i for i, x in enumerate(exact) if x.denominator == 2]
    if Fraction(s_out).numerator < 8:  # s_out = a 2^-k with a small: (k + 1/2) s_out is exact
        assert len(exact_ties) > 50  # the ties are really there
    if math.frexp(s_out)[0] != 0.5:
        assert left[exact_ties].all()  # a division's ties go to the rational rule
    _, plain = core.scaled_round(rng.normal(0, 0.5, 10000), shift, s_out)
    if shift <= 13:
        assert plain.mean() < 0.01  # ordinary values are not left over


@pytest.mark.parametrize("seed", range(30))
def test_vectorized_output_bias_equals_the_rational_one(seed):
    rng = np.random.default_rng([3, seed])
    n = int(rng.integers(1, 800))
    scale = SCALES[seed % len(SCALES)]
    out_fmt = QFormat(int(rng.choice([4, 8, 12, 16])), scale, rng.random() < 0.9)
    shift = int(rng.integers(0, 59 - out_fmt.bits + 1))
    gain = rng.integers(-(1 << 15), 1 << 15, n)
    gain[rng.random(n) < 0.1] = 0
    cfg = IntLayerNorm.from_float(np.ones(n), out_fmt=out_fmt).config
    cfg = dataclasses.replace(cfg, gain=gain, shift=shift)
    beta = rng.permutation(adversarial_betas(rng, shift, scale, n))[:n]
    for z_abs in (0, 1, int(rng.integers(1, 1 << 30)), 1 << 45):
        assert core._output_bias(beta, cfg, z_abs) == core._output_bias_exact(beta, cfg, z_abs)


@pytest.mark.parametrize("seed", range(24))
def test_from_float_constants_equal_the_rational_derivation(seed):
    """The whole derivation: the built op's bias is the rational rule's for its z."""
    op = random_op(seed)
    z = op.ranges()["z"]
    assert op.config.bias == core._output_bias_exact(op.params.beta, op.config, max(-z.lo, z.hi))


# --------------------------------------------------------------------------- the shift norm's conditional negate


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_signed_term_is_sign_times_value(backend):
    rng = np.random.default_rng(0)
    v = rng.integers(-(1 << 61), 1 << 61, (3, 1000))
    sign = np.array([[-1], [0], [1]])
    want = v * sign
    if backend == "torch":
        v, sign = torch.from_numpy(v), torch.from_numpy(sign)
    got = signed_term(v, negate_mask(sign), nonzero_mask(sign))
    assert np.array_equal(np.asarray(got), want)


def ref_shift_quantize_gain(gains, mult_bits, max_shift):
    logs = [None if g == 0 else round_log2(abs(Fraction(float(g)))) for g in gains]
    live = [q for q in logs if q is not None]
    if not live:
        return (0,) * len(gains), 0
    s = min(max_shift, mult_bits - 2 - max(live))
    if s < 0:
        raise ValueError(f"a gain of 2^{max(live)} per z LSB does not fit a {mult_bits}-bit power-of-two multiplier")
    signs = np.sign(gains).astype(int).tolist()
    return tuple(0 if q is None or q + s < 0 else sg << (q + s) for q, sg in zip(logs, signs, strict=True)), s


def log2_boundaries(rng, count: int) -> np.ndarray:
    """sqrt(2) 2^e and powers of two (the rounding boundaries of log2) with their
    float neighbours, random values of every size, subnormals, zeros."""
    e = rng.integers(-1070, 1000, count)
    edges = np.concatenate([np.ldexp(SQRT2, e), np.ldexp(1.0, e)])
    vals = [edges, np.nextafter(edges, np.inf), np.nextafter(edges, 0.0)]
    vals += [rng.normal(0, 1, count) * 10.0 ** rng.integers(-300, 300, count), np.array([5e-324, 0.0, -0.0, 1.0, -2.0])]
    v = np.concatenate(vals)
    return v * rng.choice([1.0, -1.0], v.size)


def test_vectorized_round_log2_equals_the_rational_one():
    rng = np.random.default_rng(8)
    v = log2_boundaries(rng, 3000)
    got = round_log2_floats(v)
    assert got.tolist() == [0 if x == 0 else round_log2(abs(Fraction(float(x)))) for x in v]


def ref_ceil_log2(v: float) -> int:
    q = Fraction(v)
    k = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** k < q:
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return k


def test_ceil_log2_equals_the_rational_one():
    """F_z's exponent (every derivation) read by frexp: powers of two, their float
    neighbours, subnormals and random sizes give the exact rule's k."""
    v = np.abs(log2_boundaries(np.random.default_rng(9), 3000))
    v = v[v > 0].tolist() + [5e-324, 2.0**-1022, math.nextafter(2.0**-1022, 0.0), 1.7976931348623157e308]
    assert [core.ceil_log2(x) for x in v] == [ref_ceil_log2(x) for x in v]
    with pytest.raises(ValueError, match="must be finite"):  # a non-finite gain is refused
        core.ceil_log2(math.inf)


@pytest.mark.parametrize("seed", range(20))
def test_vectorized_shift_gains_equal_the_rational_ones(seed):
    rng = np.random.default_rng([21, seed])
    n = int(rng.integers(1, 900))
    gains = rng.permutation(log2_boundaries(rng, n))[:n] * (1.0 if seed % 2 else 0.0 + (seed % 3 != 0))
    if seed % 5 == 0:  # realistic: one scale, a few zeros
        gains = rng.normal(0, 2.0 ** int(rng.integers(-20, 10)), n) * (rng.random(n) > 0.1)
    for mult_bits, max_shift in ((16, 51), (8, 20), (2, 62)):
        want = outcome_value(functools.partial(ref_shift_quantize_gain, gains, mult_bits, max_shift))
        assert outcome_value(functools.partial(ShiftLayerNorm._quantize_gain, gains, mult_bits, max_shift)) == want


def outcome_value(f):
    try:
        return f()
    except ValueError as err:
        return ("refused", str(err))


@pytest.mark.parametrize("gains", [(0, 1, -2, 4, 1 << 14, -(1 << 14), 0, 8), (-(1 << 10), 1, 2, 4, 0, 0, 0, 0)])
def test_shift_exponents_of_the_gains(gains):
    cfg = dataclasses.replace(ShiftLayerNorm.from_float(np.ones(8)).config, gain=gains)
    op = ShiftLayerNorm(cfg, ShiftLayerNorm.from_float(np.ones(8)).params)
    assert op._log2.tolist() == [max(abs(g).bit_length() - 1, 0) for g in gains]


# --------------------------------------------------------------------------- proven_ranges


def test_proven_ranges_skips_array_checks_only_inside_the_block():
    wide = np.array([1 << 62])
    with pytest.raises(OverflowError, match="rshift_round value"):
        fp.rshift_round(wide, 1)
    with pytest.raises(OverflowError):
        fp.isqrt(torch.tensor([-4]))
    assert not fp.ranges_proven()
    with fp.proven_ranges():
        assert fp.ranges_proven()
        fp.rshift_round(wide, 1)  # not checked: the caller proved its operands
        fp.isqrt(torch.tensor([4]))
        with pytest.raises(OverflowError, match="shift amount"):
            fp.rshift_round(5, 63)  # Python ints are still checked
        with pytest.raises(ValueError, match="integer array"):
            fp.rshift_round(np.array([1.5]), 1)  # and dtypes
    assert not fp.ranges_proven()
    with pytest.raises(OverflowError):
        fp.rshift_round(wide, 1)


def test_proven_ranges_is_restored_after_an_error_and_is_per_thread():
    with pytest.raises(RuntimeError):
        with fp.proven_ranges():
            raise RuntimeError
    assert not fp.ranges_proven()
    seen = []
    with fp.proven_ranges():
        with fp.proven_ranges():
            pass
        assert fp.ranges_proven()  # nested exits restore, not clear
        t = threading.Thread(target=lambda: seen.append(fp.ranges_proven()))
        t.start()
        t.join()
    assert seen == [False]


@pytest.mark.parametrize("kind", list(KINDS))
def test_qat_layer_runs_only_its_body_in_proven_ranges(kind, monkeypatch):
    """The QAT forward's per-row body on numpy (the op's own ``row_inverse``, which the
    fused element chain follows; the compiled loop of the ``fast`` extra is turned off
    here) runs inside proven_ranges and the output equals the checked body; the golden
    op's numpy forward outside it still refuses out-of-range input."""
    from qnorm.nn import jitchain
    from qnorm.nn import IntLayerNorm as QIntLayerNorm
    from qnorm.nn import IntRMSNorm as QIntRMSNorm
    from qnorm.nn import L1LayerNorm as QL1LayerNorm
    from qnorm.nn import ShiftLayerNorm as QShiftLayerNorm

    qcls = {
        IntLayerNorm: QIntLayerNorm, L1LayerNorm: QL1LayerNorm, ShiftLayerNorm: QShiftLayerNorm, IntRMSNorm: QIntRMSNorm
    }
    cls, kw = KINDS[kind]
    fmt = QFormat(8, 0.03)
    layer = qcls[cls](96, in_fmt=fmt, **kw)
    x = torch.randn(4, 5, 96) * 2
    x[0, 0] = 100.0  # saturates: the quantizer clips into the format
    flags = []
    body = cls.row_inverse

    def spy(self, xi, trace=None):
        flags.append(fp.ranges_proven())
        return body(self, xi, trace)

    monkeypatch.setattr(cls, "row_inverse", spy)
    monkeypatch.setattr(jitchain, "available", lambda: False)
    y = layer(x)
    assert flags == [True] and not fp.ranges_proven()
    monkeypatch.undo()
    op = layer.golden(fmt)
    ints = fmt.quantize(x.detach().numpy())
    assert torch.equal(y, torch.from_numpy(op.forward(ints)).float() * op.out_fmt.scale)
    with pytest.raises(ValueError, match="outside the declared"):
        op.forward(np.full((1, 96), 200))


@pytest.mark.parametrize("cls", NORMS)
def test_unchecked_torch_body_equals_checked_numpy_body(cls):
    rng = np.random.default_rng(NORMS.index(cls))
    fmt = QFormat(8, 0.05)
    op = cls.from_float(rng.normal(1, 0.4, 64), rng.normal(0, 0.4, 64), 1e-5, fmt)
    x = np.concatenate([rng.integers(-128, 128, (50, 64)), np.full((2, 64), -128), np.full((2, 64), 127)])
    x[-1, 3] = -128
    with fp.proven_ranges():
        got = op._forward(torch.from_numpy(x), None)
    assert np.array_equal(got.numpy(), op.forward(x))


# --------------------------------------------------------------------------- the QAT layer's golden memo


@pytest.mark.parametrize("kind", ["ln", "shift1", "prms"])
def test_golden_is_reused_only_while_its_arguments_are_unchanged(kind):
    from qnorm.nn import IntLayerNorm as QIntLayerNorm
    from qnorm.nn import IntRMSNorm as QIntRMSNorm
    from qnorm.nn import ShiftLayerNorm as QShiftLayerNorm

    cls, kw = KINDS[kind]
    qcls = {IntLayerNorm: QIntLayerNorm, ShiftLayerNorm: QShiftLayerNorm, IntRMSNorm: QIntRMSNorm}[cls]
    layer = qcls(32, **kw)
    x = torch.randn(6, 32)
    layer(x)  # calibrates
    layer.eval()
    fmt = layer.input_quant.fmt

    def fresh():
        beta = None if layer.bias is None else layer.bias.detach().double().numpy()
        return cls.from_float(layer.weight.detach().double().numpy(), beta, layer.eps, fmt, layer.out_fmt,
                              rounding=layer.rounding, **layer._op_options())  # fmt: skip

    a = layer.golden()
    assert layer.golden() is a and a.config == fresh().config
    with torch.no_grad():
        layer.weight[3] += 1e-3  # an optimizer step's in-place update
    b = layer.golden()
    assert b is not a and b.config == fresh().config and b.params.gamma[3] != a.params.gamma[3]
    layer.eps = 0.5
    c = layer.golden()
    assert c is not b and c.config == fresh().config
    layer.rounding = Round.FLOOR
    d = layer.golden()
    assert d is not c and d.config.rounding is Round.FLOOR and d.config == fresh().config
    other = QFormat(fmt.bits, fmt.scale * 2)
    assert layer.golden(other).in_fmt == other and layer.golden().in_fmt == fmt
