"""The regression harness: golden store integrity, golden reproduction, ``qnorm verify``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qnorm.cli import main
from qnorm.ops import IntRMSNorm
from qnorm.ops.multithreshold import BNQuant
from qnorm.qformat import QFormat
from qnorm.verify import backends, golden_store, registry
from qnorm.verify.backends import Backend, Runner
from qnorm.verify.cases import CASES, ROWS, TIME, case_named
from qnorm.verify.golden_store import DEFAULT_DIR, MANIFEST, GoldenStoreError
from qnorm.verify.vectors import as_vectors, edge_vectors, exhaustive_inputs, golden_inputs, run_batches

SMALL = ["int_layernorm.int8.n7.half_even", "bn_quant.int8.c16.relu4", "folded_lif.int4.c8.soft.ge.leak05"]
FAMILIES = sorted({c.op for c in CASES})
FEW = "1000"  # input elements per case in CLI tests (edge and exhaustive sets come on top)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A fresh store of three small cases (one per layout)."""
    golden_store.regenerate(tmp_path, [case_named(n) for n in SMALL])
    return tmp_path


def _rewrite_sha(directory: Path, name: str) -> None:
    """Make the manifest agree with the file's current bytes (a corruption sha256 cannot see)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    entry = manifest["cases"][name]
    entry["sha256"] = golden_store.sha256(directory / entry["file"])
    (directory / MANIFEST).write_text(json.dumps(manifest))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- golden store


def test_store_round_trip(store: Path) -> None:
    manifest = golden_store.read_manifest(store)
    assert sorted(manifest["cases"]) == sorted(SMALL)
    assert manifest["qnorm_version"] == golden_store.qnorm_version()
    for name in SMALL:
        case = case_named(name)
        entry = manifest["cases"][name]
        assert entry["sha256"] == golden_store.sha256(store / entry["file"])
        assert entry["config"] == golden_store.config_json(case)
        got = golden_store.load(store, case)
        x = golden_inputs(case)
        assert np.array_equal(got.x, x)
        assert np.array_equal(got.y, case.build().forward(x))


def test_regenerate_is_byte_identical(store: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    again = tmp_path_factory.mktemp("again")
    golden_store.regenerate(again, [case_named(n) for n in SMALL])
    for path in sorted(store.iterdir()):
        assert path.read_bytes() == (again / path.name).read_bytes(), path.name


def test_modified_file_is_refused(store: Path) -> None:
    case = case_named(SMALL[0])
    path = store / f"{case.name}.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(GoldenStoreError, match=rf"{path.name}.*modified.*sha256"):
        golden_store.load(store, case)


def test_corrupt_npz_is_refused_even_with_matching_sha(store: Path) -> None:
    case = case_named(SMALL[1])
    path = store / f"{case.name}.npz"
    path.write_bytes(path.read_bytes()[:100])
    _rewrite_sha(store, case.name)
    with pytest.raises(GoldenStoreError, match=rf"{path.name} is not a readable integer npz"):
        golden_store.load(store, case)


def test_pickled_npz_is_refused(store: Path) -> None:
    case = case_named(SMALL[1])
    path = store / f"{case.name}.npz"
    with path.open("wb") as f:
        np.savez(f, x=np.array([{"evil": 1}], dtype=object), y=np.zeros(1, dtype=np.int8))
    _rewrite_sha(store, case.name)
    with pytest.raises(GoldenStoreError, match=rf"{path.name} is not a readable integer npz.*pickle"):
        golden_store.load(store, case)


def test_missing_file_manifest_and_case_are_named(store: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = case_named(SMALL[2])
    (store / f"{case.name}.npz").unlink()
    with pytest.raises(GoldenStoreError, match=rf"{case.name}\.npz.*missing"):
        golden_store.load(store, case)
    with pytest.raises(GoldenStoreError, match=r"no golden vectors for case 'int_rmsnorm\.int8\.n64'"):
        golden_store.load(store, case_named("int_rmsnorm.int8.n64"))
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(GoldenStoreError, match=rf"{MANIFEST} not found.*--regenerate"):
        golden_store.load(empty, case)


def test_changed_case_config_is_refused(store: Path) -> None:
    case = case_named(SMALL[0])
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["cases"][case.name]["config"]["eps"] = 1e-3
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(GoldenStoreError, match="catalogue config differs"):
        golden_store.load(store, case)


def test_committed_store_matches_the_catalogue() -> None:
    manifest = golden_store.read_manifest(DEFAULT_DIR)
    assert sorted(manifest["cases"]) == sorted(c.name for c in CASES)
    files = {p.name for p in DEFAULT_DIR.iterdir()}
    assert files == {MANIFEST} | {e["file"] for e in manifest["cases"].values()}
    assert sum((DEFAULT_DIR / f).stat().st_size for f in files) < 2 * 1024 * 1024


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_committed_golden_vectors_are_reproduced(name: str) -> None:
    """The regression check: the current golden model gives the stored outputs, exactly."""
    case = case_named(name)
    stored = golden_store.load(DEFAULT_DIR, case)
    assert np.array_equal(case.build().forward(stored.x), stored.y)


# --------------------------------------------------------------------------- vectors


@pytest.mark.parametrize(
    "name", ["int_layernorm.int8.n64", "bn_quant.int8.c16.relu4", "mpbn_lif.int8.c16.hard.ge.leak0875"]
)
def test_edge_vectors_hold_the_extremes(name: str) -> None:
    case = case_named(name)
    f, w = case.in_fmt, case.width
    edge = edge_vectors(case, complete=True)
    rows = {tuple(r) for r in edge.tolist()}
    for row in ([f.lo] * w, [f.hi] * w, [0] * w, [f.lo, f.hi] * (w // 2), [f.lo] + [f.hi] * (w - 1)):
        assert tuple(row) in rows
    assert edge.min() == f.lo and edge.max() == f.hi


def test_run_batches_meet_the_budget_and_repeat() -> None:
    case = case_named("int_layernorm.int8.n768")
    first = list(run_batches(case, 10**5, seed=3))
    assert sum(b.x.size for b in first) >= 10**5
    assert sum(b.x.size for b in first if b.source == "random") >= 10**5 // 2
    again = list(run_batches(case, 10**5, seed=3))
    assert all(np.array_equal(a.x, b.x) for a, b in zip(first, again, strict=True))


def test_a_derived_case_changes_only_what_it_names() -> None:
    base = case_named("int_rmsnorm.int8.n64")
    wide = base.derived("int_rmsnorm.int8.n256", n=256)
    assert (wide.op, wide.width) == (base.op, 256)
    assert {k: v for k, v in wide.config.items() if k != "n"} == {k: v for k, v in base.config.items() if k != "n"}
    assert base.width == 64  # the catalogue's case is untouched
    again = base.derived("int_rmsnorm.int8.n256", n=256).build()
    assert np.array_equal(again.params.gamma, wide.build().params.gamma)  # the name seeds the parameters


def test_exhaustive_domains() -> None:
    ln = case_named("int_layernorm.int4.n4")
    full = exhaustive_inputs(ln)
    assert full.shape == (16**4, 4) and len({tuple(r) for r in full.tolist()}) == 16**4
    bn = case_named("bn_quant.int8.c16.relu4")
    full = exhaustive_inputs(bn)
    assert all(sorted(full[:, c].tolist()) == list(range(-128, 128)) for c in range(16))
    assert exhaustive_inputs(case_named("int_layernorm.int8.n64")) is None


def test_time_layout_vectors_are_neuron_series() -> None:
    case = case_named("mpbn_lif.int4.c8.soft.ge.leak05")
    assert case.layout == TIME and case_named("int_rmsnorm.int8.n1").layout == ROWS
    x = np.arange(16 * 3 * 8).reshape(16, 3, 8)
    v = as_vectors(case, x)
    assert v.shape == (24, 16) and np.array_equal(v[8 + 5], x[:, 1, 5])


# --------------------------------------------------------------------------- qnorm verify


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_every_case_on_x86(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "verify", "--target", "x86_64", "--json", "--elements", FEW, "--case", f"{family}.*")
    report = json.loads(out)
    assert rc == 0 and report["ok"]
    assert len(report["cases"]) == sum(c.op == family for c in CASES)
    for case in report["cases"]:
        results = case["results"]
        assert list(results) == ["golden", "qat", "x86_64"]
        assert results["golden"]["status"] == "ok" and results["golden"]["vectors"] > 0
        assert results["qat"]["status"] == "ok" and results["qat"]["elements"] >= int(FEW)
        x86 = results["x86_64"]
        assert x86["status"] == "ok" or (x86["status"] == "skip" and x86["reason"]), x86
        assert case["error_vs_float"]["elements"] > 0
    assert all(c["results"]["qat"]["via"].startswith("qnorm.nn.") for c in report["cases"])  # the real layer


def test_qat_falls_back_to_the_op_body_only_where_no_layer_holds_the_op() -> None:
    rng = np.random.default_rng(0)
    op = IntRMSNorm.from_float(rng.normal(1, 0.3, 16), rng.normal(0, 0.2, 16), 1e-5, QFormat(8, 0.05))
    runner = backends.get("qat").prepare(op)
    assert runner.via.startswith("golden op body on torch int64 (qnorm.nn.IntRMSNorm cannot hold this op")
    assert "nonzero β" in runner.via
    x = rng.integers(-128, 128, (64, 16))
    assert np.array_equal(runner.run(x), op.forward(x))


def test_qat_layer_whose_golden_differs_is_a_failure() -> None:
    """A layer that would derive other constants than the op (here: 16- vs 12-bit γ) is reported, not used."""
    case = case_named("bn_quant.int8.c16.relu4")
    ref = case.build().reference
    op = BNQuant.from_float(ref.gamma, ref.beta, ref.mean, ref.var, ref.eps, cfg=case.build().cfg, gamma_bits=12)
    with pytest.raises(backends.BackendError, match=r"BNQuantAct.golden\(\) differs from the case's op in 'gamma_m'"):
        backends.get("qat").prepare(op)


@pytest.fixture
def off_by_one() -> Iterator[str]:
    """A registered backend that adds 1 to element 3 of every output."""

    def prepare(op: object) -> Runner:
        def run(x: np.ndarray) -> np.ndarray:
            y = np.array(op.forward(x), dtype=np.int64)  # type: ignore[attr-defined]
            y.reshape(-1)[3] += 1
            return y

        return Runner(run, "golden + 1 at element 3")

    backends.register(Backend("off-by-one", "deliberately wrong (test)", prepare))
    yield "off-by-one"
    backends.unregister("off-by-one")


def test_broken_backend_fails_and_prints_the_input(off_by_one: str, capsys: pytest.CaptureFixture[str]) -> None:
    name = "int_layernorm.int8.n64"
    rc, out, _ = _run(capsys, "verify", "--target", off_by_one, "--case", name, "--elements", FEW)
    assert rc == 1
    stored = golden_store.load(DEFAULT_DIR, case_named(name))
    assert f"FAIL  {name} × {off_by_one}: first mismatch in golden vector 0, x[0], at positions [3]:" in out
    assert f"input    {stored.x[0].tolist()}" in out
    expected, got = stored.y[0].tolist(), stored.y[0].tolist()
    got[3] += 1
    assert f"expected {expected}" in out and f"got      {got}" in out
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert "FAIL" in row and "ok (" in row  # golden and qat still pass

    rc, out, err = _run(capsys, "verify", "--target", off_by_one, "--case", name, "--elements", FEW, "--json")
    assert rc == 1
    cell = json.loads(out)["cases"][0]["results"][off_by_one]
    assert cell["status"] == "FAIL" and cell["mismatch"]["positions"] == [3]
    assert cell["mismatch"]["input"] == stored.x[0].tolist()
    assert "first mismatch in golden vector 0" in err


def test_crashing_backend_is_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    def prepare(op: object) -> Runner:
        return Runner(lambda x: np.asarray(x, dtype=np.float64), "returns floats")

    backends.register(Backend("floats", "returns the input as floats (test)", prepare))
    try:
        rc, out, _ = _run(capsys, "verify", "--target", "floats", "--case", SMALL[1], "--elements", FEW)
    finally:
        backends.unregister("floats")
    assert rc == 1 and "returned dtype float64, not integers" in out


def test_golden_regression_fails_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stored outputs the golden model does not reproduce fail the golden column and ``qnorm golden``."""
    shutil.copytree(DEFAULT_DIR, tmp_path, dirs_exist_ok=True)
    name = SMALL[1]
    stored = golden_store.load(tmp_path, case_named(name))
    y = stored.y.copy()
    y[5, 2] += 1
    (tmp_path / f"{name}.npz").write_bytes(
        golden_store.npz_bytes({"x": golden_store.narrow(stored.x), "y": golden_store.narrow(y)})
    )
    _rewrite_sha(tmp_path, name)
    rc, out, _ = _run(capsys, "verify", "--golden-dir", str(tmp_path), "--case", name, "--elements", FEW, "--json")
    results = json.loads(out)["cases"][0]["results"]
    assert rc == 1 and results["golden"]["status"] == "FAIL"
    assert results["golden"]["mismatch"]["vector"] == 5 and results["golden"]["mismatch"]["positions"] == [2]
    rc, out, _ = _run(capsys, "golden", "--dir", str(tmp_path), "--case", name)
    assert rc == 1 and "no longer reproduces 1 stored output" in out


def test_unknown_target_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "verify", "--target", "x86_64", "sparc")
    assert rc == 2
    assert "unknown target 'sparc'" in err
    assert all(t in err for t in ("aarch64", "riscv64", "cuda", "opencl", "fpga-hls", "x86_64"))


def test_unimplemented_and_unavailable_targets_skip_with_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(backends, "_KERNELS", "compilers.tvm.kernels_absent")
    monkeypatch.delitem(registry._REGISTRY, "aarch64", raising=False)  # a target without a backend
    rc, out, _ = _run(
        capsys, "verify", "--target", "aarch64", "x86_64", "--case", SMALL[1], "--elements", FEW, "--json"
    )
    assert rc == 0
    report = json.loads(out)
    results = report["cases"][0]["results"]
    assert results["aarch64"] == {"status": "skip", "vectors": 0, "elements": 0, "reason": "backend not implemented"}
    assert results["x86_64"]["status"] == "skip"
    assert results["x86_64"]["reason"] == "unavailable: compilers.tvm.kernels_absent not present"
    assert report["columns"]["x86_64"]["available"] is False


def test_matrix_text(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delitem(registry._REGISTRY, "cuda", raising=False)  # a target without a backend
    rc, out, _ = _run(capsys, "verify", "--target", "cuda", "--case", *SMALL, "--elements", FEW)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["case", "golden", "qat", "cuda", "max", "err", "(LSB)", "mean", "err", "(LSB)"]
    for name in SMALL:
        row = next(line for line in lines if line.startswith(name))
        assert row.count("ok (") == 2 and " skip " in row
    assert "skip  cuda: backend not implemented (every case)" in lines
    assert "0 FAIL" in lines[-1]
