"""The transformer latency section runs end to end on a one-block transformer with tiny loops.

Functionality only (no timing is asserted): the tables are well formed, a failing
``torch.compile`` becomes a cell, and the per-op groups count the model's kernels.
``make bench`` measures the demo's models.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tvm")

from benchmarks import bench_transformer as bt

TINY = ("transformer", {"norm": "int_ln", "integer": True, "depth": 1})
TINY_REFERENCE = ("transformer", {"norm": "float", "depth": 1})
BATCH = 4


class NoCompiler(RuntimeError):
    pass


def failing_compile(_model):
    """A torch.compile stand-in whose compiled function fails at its first call, as inductor can."""

    def run(_x):
        raise NoCompiler("C++ compile error\nkernel.cpp:34:70: error: no matching function | for call\nmore")

    return run


def tables(text: str) -> list[list[list[str]]]:
    """Each markdown table of ``text`` as rows of cells (an escaped ``\\|`` stays in its cell)."""
    found, current = [], []
    for line in [*text.split("\n"), ""]:
        if line.startswith("|"):
            current.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
        elif current:
            found.append(current)
            current = []
    return found


@pytest.fixture(scope="module")
def results():
    """Two subjects of the one tiny model (compiled once, then a cache hit): torch.compile
    fails for the first and is the model itself for the second."""
    wrappers = iter([failing_compile, lambda model: model])
    subjects = [bt.prepare(name, TINY, lambda model: next(wrappers)(model)) for name in ("tiny-a", "tiny-b")]
    data = bt.load_digits_data("tokens", seed=0).test.tensors[0]
    inputs = {1: data[:1].contiguous(), BATCH: data[:BATCH].contiguous()}
    reference = bt.calibrated(*TINY_REFERENCE)
    return bt.measure(subjects, reference, inputs, rounds=1, min_loop_s=0.0, profile_runs=1, step_repeats=1)


def test_the_latency_table_has_every_way_of_every_model(results):
    text = bt.transformer_markdown(results, rounds=1, min_loop_s=0.0, test_samples=360)
    assert text.startswith("## Transformer latency")
    assert f"batch {BATCH} (time per sample)" in text  # not the whole test set
    latency, _ = tables(text)
    assert latency[0] == ["model", "runs as", "batch 1: latency", "× compiled", f"batch {BATCH}: time per sample",
                          "× compiled"]
    body = latency[2:]
    assert [row[:2] for row in body] == [[name, way] for name in ("tiny-a", "tiny-b") for way in bt.WAYS]
    assert all(len(row) == len(latency[0]) for row in latency)
    for row in body:
        if row[1] == bt.COMPILED:
            assert row[3] == row[5] == "1.00×"
    failed = body[bt.WAYS.index(bt.TORCH_COMPILE)]
    want = r"failed: NoCompiler: C++ compile error (no matching function \| for call)"
    assert failed[2:] == [want, "—", "not run (failed at batch 1)", "—"]
    timed = body[len(bt.WAYS) + bt.WAYS.index(bt.TORCH_COMPILE)]
    assert timed[2].endswith("s") and timed[3].endswith("×")


def test_the_share_table_groups_the_kernels_by_op(results):
    _, shares = tables(bt.transformer_markdown(results, rounds=1, min_loop_s=0.0, test_samples=360))
    assert shares[0] == ["op kind", "tiny-a, batch 1", f"tiny-a, batch {BATCH}", "tiny-b, batch 1",
                         f"tiny-b, batch {BATCH}"]
    assert [row[0] for row in shares[2:]] == [*bt.GROUPS, "**total per call**"]
    for part in (p for r in results for p in r.breakdown.values()):
        # one block: norm1, norm2 and the final norm; one softmax; one GELU
        assert (part.calls[bt.NORM], part.calls[bt.SOFTMAX], part.calls[bt.ACTIVATION]) == (3, 1, 1)
        assert part.calls[bt.MATMUL] > 0 and part.calls[bt.ELEMENTWISE] > 0
        assert set(part.seconds) == set(bt.GROUPS) and min(part.seconds.values()) >= 0.0


def test_steps_map_to_op_kinds():
    int_ops = {"blocks.0.norm1": "IntLayerNorm", "blocks.0.attn.softmax": "IntSoftmax", "blocks.0.mlp.act": "IntSiLU"}
    want = {
        "qnorm_blocks_0_norm1": bt.NORM,
        "qnorm_blocks_0_attn_softmax": bt.SOFTMAX,
        "qnorm_blocks_0_mlp_act": bt.ACTIVATION,
        "qnorm_blocks_0_norm1_quantize": bt.ELEMENTWISE,
        "qnorm_blocks_0_attn_softmax_dequantize": bt.ELEMENTWISE,
        "matmul3": bt.MATMUL,
        "fused_matmul_add1": bt.MATMUL,
        "divide2": bt.ELEMENTWISE,
        "tir_round": bt.ELEMENTWISE,
        "fused_divide_tir_round_tir_clip_multiply": bt.ELEMENTWISE,
        "transpose4": bt.OTHER,
        "strided_slice1": bt.OTHER,
        "mean": bt.OTHER,
        "qnorm_unknown_quantize": bt.OTHER,  # not a kernel of this model's ops
        "shape_func": None,
    }
    assert {symbol: bt.step_group(symbol, int_ops) for symbol in want} == want


def test_an_error_is_one_line_naming_its_type():
    assert bt.error_text(ValueError("bad shape")) == "ValueError: bad shape"
    assert bt.error_text(ValueError("")) == "ValueError: "
    long = bt.error_text(RuntimeError("x" * 500))
    assert len(long) == 240 and long.startswith("RuntimeError: xxx") and long.endswith("…")
