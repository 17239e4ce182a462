"""`qnorm compile CHECKPOINT --target x86_64 -o DIR`: the round trip through a checkpoint and
a compiled directory, the refusals (targets, a transformer), and corrupt directories."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from cache_damage import DAMAGES
from torch.utils.data import TensorDataset

from compilers import cache
from compilers.tvm.build import cache_dir
from compilers.tvm.graph import compile_target, load_compiled, model_key, sha256_file
from qnorm.cli import main
from qnorm.train.checkpoint import load_checkpoint, save_checkpoint
from qnorm.train.data import load_digits_data
from qnorm.train.loop import seed_everything, train
from qnorm.train.models import build_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A briefly trained deployable mixer, saved as `qnorm train` saves models; its test inputs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QNORM_CACHE", str(tmp_path_factory.mktemp("compile-cache")))
        seed_everything(1)
        model = build_model("mixer", dim=16, depth=1, token_hidden=8, channel_hidden=16)
        data = load_digits_data("tokens", seed=0)
        x, y = data.train.tensors
        train(model, replace(data, train=TensorDataset(x[:128], y[:128])), 1, 5e-3, 1, progress=False)
        path = save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "mixer")
        yield path, data.test.tensors[0]


@pytest.fixture(scope="module")
def compiled_dir(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    out = tmp_path_factory.mktemp("compiled") / "mixer"
    assert main(["compile", str(path), "--target", "x86_64", "-o", str(out)]) == 0
    return out


def test_compile_round_trip_gives_the_checkpoint_model_outputs(checkpoint, compiled_dir):
    path, x = checkpoint
    model, meta = load_checkpoint(path)
    with torch.no_grad():
        want = model(x).numpy()
    loaded = load_compiled(compiled_dir)
    assert np.array_equal(loaded(x.numpy()), want)
    info = json.loads((compiled_dir / "model.json").read_text())
    assert info["library"]["sha256"] == sha256_file(compiled_dir / "model.so")
    assert info["source"]["weights_sha256"] == meta["weights"]["sha256"] and info["source"]["model"] == meta["model"]
    assert info["input"]["shape"] == [None, 8, 8] and info["target"]["name"] == "x86_64"
    assert set(info["versions"]) == {"qnorm", "tvm", "torch", "brevitas"}


def test_x86_alias_recompiles_from_the_cache(checkpoint, compiled_dir, tmp_path, capsys):
    path, _ = checkpoint
    assert main(["compile", str(path), "--target", "x86", "-o", str(tmp_path / "again")]) == 0
    assert "cache hit for x86_64" in capsys.readouterr().out
    assert (tmp_path / "again" / "model.so").read_bytes() == (compiled_dir / "model.so").read_bytes()


def recompile_and_check(checkpoint, compiled_dir, out, capsys) -> str:
    """`qnorm compile` again into ``out``: its library must be the clean build's, byte for
    byte, and give the QAT model's outputs; returns how it was obtained ("compiled" or
    "cache hit")."""
    path, x = checkpoint
    assert main(["compile", str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    written = json.loads((out / "model.json").read_text())["library"]["sha256"]
    assert written == sha256_file(out / "model.so") == sha256_file(compiled_dir / "model.so")
    model, _ = load_checkpoint(path)
    with torch.no_grad():
        want = model(x).numpy()
    assert np.array_equal(load_compiled(out)(x.numpy()), want)
    return "compiled" if "  compiled for x86_64" in printed else "cache hit"


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated"])
def test_a_damaged_cached_library_is_compiled_again_never_written_out(
    checkpoint, compiled_dir, tmp_path, capsys, caplog, damage
):
    """The reported failure: one flipped bit in the cached model.so was a 'cache hit' whose
    library was written out with its own sha256 and disagreed with the QAT model."""
    library_key = json.loads((compiled_dir / "model.json").read_text())["cache_key"]
    entry = cache_dir() / "models" / library_key
    spoil, words = DAMAGES[damage]
    spoil(entry, "model.so")
    assert recompile_and_check(checkpoint, compiled_dir, tmp_path / "again", capsys) == "compiled"
    assert str(entry) in caplog.text and words in caplog.text


def test_a_garbled_model_index_is_written_again_and_finds_the_library(checkpoint, compiled_dir, tmp_path, capsys, caplog):
    path, _ = checkpoint
    model, _ = load_checkpoint(path)
    index = cache_dir() / "models" / f"index-{model_key(model, model.example_input(), compile_target('x86_64'))}"
    spoil, words = DAMAGES["garbled-manifest"]
    spoil(index, "index.json")
    assert recompile_and_check(checkpoint, compiled_dir, tmp_path / "again", capsys) == "cache hit"
    assert str(index) in caplog.text and words in caplog.text
    assert cache.lookup(index) is not None  # written again: the next compile needs no export


@pytest.mark.parametrize(
    "target, message",
    [("vax", "unknown target 'vax'; known targets: ")],
)
def test_unknown_target_is_refused(checkpoint, tmp_path, capsys, target, message):
    path, _ = checkpoint
    assert main(["compile", str(path), "--target", target, "-o", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fpga_hls_writes_a_project_per_norm_layer_whose_csim_passes(checkpoint, tmp_path, capsys):
    from compilers.fpga import csim, csource
    from qnorm.deploy import integer_ops
    from qnorm.targets import load_target

    path, _ = checkpoint
    out = tmp_path / "hls"
    assert main(["compile", str(path), "--target", "fpga-hls", "-o", str(out)]) == 0
    model, _ = load_checkpoint(path)
    names = list(integer_ops(model))
    assert names and sorted(p.name for p in out.iterdir()) == sorted(names)
    printed = capsys.readouterr().out
    assert all(f"  {name}: " in printed for name in names)
    target = load_target("fpga-hls")
    if csim.compiler_unavailable(target) is not None:
        pytest.skip(csim.compiler_unavailable(target))
    assert printed.count("    C simulation: qnorm_tb: PASS: ") == len(names)  # run by compile itself
    project = out / names[0]
    assert "set_top qnorm_top" in (project / csource.TCL).read_text()
    done = csim.run_testbench(csim.build_csim(project, target).binary, project / csource.VECTORS)
    assert done.returncode == 0 and "PASS" in done.stdout, done.stderr


def test_fpga_hls_project_whose_csim_differs_is_refused(checkpoint, tmp_path, capsys, monkeypatch):
    """The last golden output of every project's vectors.bin off by one bit as it is
    written: the C simulation compile runs must report the mismatch, and compile fail."""
    from compilers.fpga import csim, hls
    from qnorm.targets import load_target

    if csim.compiler_unavailable(load_target("fpga-hls")) is not None:
        pytest.skip(csim.compiler_unavailable(load_target("fpga-hls")))
    write = hls.write_vectors

    def one_golden_output_off(path, units, in_bytes, out_bytes, want=None):
        want = want.copy()
        want.flat[-1] ^= 1
        return write(path, units, in_bytes, out_bytes, want)

    monkeypatch.setattr(hls, "write_vectors", one_golden_output_off)
    path, _ = checkpoint
    assert main(["compile", str(path), "--target", "fpga-hls", "-o", str(tmp_path / "hls")]) == 1
    err = capsys.readouterr().err
    assert "the C simulation of the written project failed (exit 1): qnorm_tb: MISMATCH in vector" in err
    assert "do not synthesize it" in err


def test_transformer_checkpoint_is_refused_naming_softmax_and_gelu(tmp_path, capsys):
    model = build_model("transformer", norm="int_ln")
    model.train()(torch.randn(8, 8, 8))  # calibrate the integer norms
    path = save_checkpoint(model, tmp_path / "transformer")
    assert main(["compile", str(path), "-o", str(tmp_path / "out")]) == 1  # refused: an error, not a usage error
    err = capsys.readouterr().err
    assert "qnorm compile: error: model is not deployable bit-exactly" in err
    assert "blocks.0.attn: aten._softmax (softmax) has no exact float form" in err
    assert "blocks.0: aten.gelu (GELU) has no exact float form" in err
    assert "embed: the weights are not on a coarse power-of-two grid" in err  # Int8WeightPerTensorFloat


def corrupt_library(d):
    data = bytearray((d / "model.so").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "model.so").write_bytes(bytes(data))


def other_library_hash(d):
    meta = json.loads((d / "model.json").read_text())
    meta["library"]["sha256"] = "0" * 64
    (d / "model.json").write_text(json.dumps(meta))


def foreign_tvm(d):
    meta = json.loads((d / "model.json").read_text())
    meta["versions"]["tvm"] = "0.1.0"
    (d / "model.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, message",
    [
        (corrupt_library, "model.so is corrupt or not the one model.json describes"),
        (other_library_hash, "model.so is corrupt or not the one model.json describes"),
        (lambda d: (d / "model.so").unlink(), "missing model.so"),
        (lambda d: (d / "model.json").write_text("{"), "model.json is not valid JSON"),
        (lambda d: (d / "model.json").write_text('{"format": "other"}'), "is not a qnorm.compiled version 1 file"),
        (foreign_tvm, "was built with TVM 0.1.0"),
    ],
)
def test_corrupt_or_foreign_directory_is_refused(compiled_dir, tmp_path, damage, message):
    d = tmp_path / "copy"
    shutil.copytree(compiled_dir, d)
    damage(d)
    with pytest.raises(ValueError, match=message):
        load_compiled(d)


def test_qnorm_run_gives_the_integers_of_a_model_so(checkpoint, compiled_dir, tmp_path, capsys):
    path, x = checkpoint
    model, _ = load_checkpoint(path)
    scale = json.loads((compiled_dir / "model.json").read_text())["output"]["format"]["scale"]
    with torch.no_grad():
        want = model(x).numpy().astype(np.float64) / scale  # exact: a power-of-two grid
    np.save(tmp_path / "x.npy", x.numpy())
    assert main(["run", str(compiled_dir), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]) == 0
    got = np.load(tmp_path / "y.npy")
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert "360 sample(s) run natively" in capsys.readouterr().out
