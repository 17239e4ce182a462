"""The acceptance run of a freshly built model (compilers.tvm.acceptance): its outputs on
the check inputs against the frozen program's, recorded in model.json, a difference refused
and the artifact dropped from the cache."""

import json

import numpy as np
import pytest
import torch
from deploy_helpers import TINY_MIXER, briefly_trained, needs_tools, private_cache

from compilers import toolchains
from compilers.tvm import acceptance
from compilers.tvm.c_api import CApiModel
from compilers.tvm.graph import CompiledModel, compile_model


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield from private_cache(tmp_path_factory, "acceptance-cache")


@pytest.fixture(scope="module")
def mixer(cache):
    return briefly_trained("mixer", **TINY_MIXER)[0]


def test_check_inputs_reach_every_style_and_past_the_range() -> None:
    example = torch.zeros(3, 4, 5)
    x = acceptance.check_inputs(example, -2.0, 1.5)
    assert x.dtype == np.float32 and x.shape == (3 + 4 * acceptance.STYLE_SAMPLES, 4, 5)
    assert x.min() < -2.0 and x.max() > 1.5  # saturating values
    styles = x[3:].reshape(4, acceptance.STYLE_SAMPLES, -1)
    spreads = styles.std(axis=2)
    assert (spreads[2] < 0.05).all()  # near-constant samples: a few LSBs
    assert (styles[3] == 0).mean() > 0.8  # sparse samples
    assert np.array_equal(x, acceptance.check_inputs(example, -2.0, 1.5))  # seeded


def test_unsigned_and_formatless_input_ranges() -> None:
    meta = {"input": {"format": {"bits": 4, "scale": 0.5, "signed": False}}}
    assert acceptance.input_amplitude(meta, torch.zeros(1)) == (0.0, 7.5)
    meta = {"input": {"format": {"bits": 8, "scale": 0.25, "signed": True}}}
    assert acceptance.input_amplitude(meta, torch.zeros(1)) == (-32.0, 31.75)
    assert acceptance.input_amplitude({"input": {"format": None}}, torch.tensor([-3.0, 5.0])) == (-3.0, 5.0)


def test_fresh_builds_pass_and_record_it(mixer, cache) -> None:
    built = compile_model(mixer, mixer.example_input(), "x86_64")
    record = built.metadata["acceptance"]
    assert record["status"] == "passed" and record["samples"] > 4 * acceptance.STYLE_SAMPLES
    again = compile_model(mixer, mixer.example_input(), "x86_64")
    assert again.cache_hit and again.metadata["acceptance"] == record  # from the cache's index


def test_a_differing_build_is_refused_and_not_cached(mixer, cache, monkeypatch) -> None:
    def one_output_off(self, x: np.ndarray) -> np.ndarray:
        out = real(self, x)
        out[5, 1] += np.float32(2.0**-4)
        return out

    real = CompiledModel.__call__
    monkeypatch.setenv("QNORM_CACHE", str(cache / "sub"))
    monkeypatch.setattr(CompiledModel, "__call__", one_output_off)
    with pytest.raises(acceptance.MiscompileError, match=r"differs from the program .* 1 of \d+ outputs.* sample 5, "
                       r"output \(1,\)"):  # fmt: skip
        compile_model(mixer, mixer.example_input(), "x86_64")
    monkeypatch.setattr(CompiledModel, "__call__", real)
    rebuilt = compile_model(mixer, mixer.example_input(), "x86_64")
    assert not rebuilt.cache_hit and rebuilt.metadata["acceptance"]["status"] == "passed"


def test_cross_builds_run_under_qemu_or_say_why_not(mixer, cache, monkeypatch, tmp_path) -> None:
    needs_tools("aarch64")
    built = compile_model(mixer, mixer.example_input(), "aarch64")
    assert isinstance(built, CApiModel) and built.metadata["acceptance"]["status"] == "passed"
    meta = json.loads((built.save(tmp_path / "m") / "model.json").read_text())
    assert meta["acceptance"]["status"] == "passed"
    monkeypatch.setattr(toolchains.shutil, "which", lambda name: None)
    assert "qemu-aarch64 not found" in built.unavailable()
    assert acceptance.accept(built, None, torch.zeros(1))["status"] == "not run"
