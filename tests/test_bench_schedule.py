"""The CPU schedule tuning measured by the kernel benchmarks keeps its shape.

Two layout choices of :func:`compilers.tvm.cpu.schedule_rowwise` made the norm
kernels faster (see benchmarks/bench_kernels.py): per-element stages computed one
vector register of columns at a time, and the row reductions that read only the
input sharing one loop.  A reduction that reads another one's result must keep
its own loop: TVM's ``merge`` does not check that dataflow, and a merged
L1LayerNorm reads S before it is complete.  Bit-exactness of every kernel is
tests/test_tvm_kernels.py's job; these tests pin the structure.
"""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402

from compilers.tvm.cpu import _VECTOR_BITS, ROW_BLOCK
from compilers.tvm.kernels import kernel_for
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm
from qnorm.qformat import QFormat

N = 768
SHORT = 64


def scheduled(cls: type, n: int = N) -> tvm.s_tir.Schedule:
    rng = np.random.default_rng(0)
    gamma = rng.normal(1.0, 0.1, n).astype(np.float32)
    beta = None if cls is IntRMSNorm else rng.normal(0.0, 0.1, n).astype(np.float32)
    return tvm.s_tir.Schedule(kernel_for(cls.from_float(gamma, beta, 1e-5, QFormat(8, 0.05))).mod)


def innermost(sch: tvm.s_tir.Schedule, block: str):
    return sch.get(sch.get_loops(sch.get_sblock(block))[-1])


@pytest.mark.parametrize("n", [N, SHORT])
def test_layernorm_sums_share_one_loop_l1_sums_do_not(n):
    # in a block of rows, the sums' updates (their zero initializations run first)
    ln = scheduled(IntLayerNorm, n)
    assert innermost(ln, "row_sum_update").same_as(innermost(ln, "row_sum_1_update"))
    l1 = scheduled(L1LayerNorm, n)  # Σ|N·x − S| reads S = Σx
    assert not innermost(l1, "row_sum_update").same_as(innermost(l1, "row_sum_1_update"))


@pytest.mark.parametrize("cls", [IntLayerNorm, L1LayerNorm, IntRMSNorm])
def test_per_element_stages_work_one_register_at_a_time(cls):
    """A tile of _VECTOR_BITS of the widest per-element value: the chain's int32
    (1024 / 32 = 32 lanes, four AVX2 registers); the int64 per-row multiplier and
    offset it reads are cast to 32 bits where they are loaded, so they do not
    count at 64 (that halved the tile: x86-64-v3 kernels 3-10 % slower)."""
    lanes = _VECTOR_BITS // 32
    sch = scheduled(cls)
    stages = [
        b
        for b in sch.get_child_blocks(sch.get_sblock("root"))
        if sch.get(b).name_hint.startswith("out_s")
    ]
    assert stages
    tile = sch.get(sch.get_loops(sch.get_sblock("out"))[-2])
    assert int(tile.extent) == N // lanes
    for block in [*stages, sch.get_sblock("out")]:
        loops = sch.get_loops(block)
        assert sch.get(loops[-2]).same_as(tile)
        assert int(sch.get(loops[-1]).extent) == lanes
        assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED


@pytest.mark.parametrize("cls", [IntLayerNorm, L1LayerNorm, IntRMSNorm])
def test_per_row_chain_is_one_vector_of_a_block_of_short_rows(cls):
    """The per-row stages (ε, split, inverse, multiplier, offset, shift) each run
    as one ROW_BLOCK-lane vector without a row predicate; the row sums keep
    theirs, one row at a time."""
    sch = scheduled(cls, SHORT)
    chain = ("stat", "exp", "mant", "inv", "mult", "zshift")
    for name in chain:
        lanes = sch.get(sch.get_loops(sch.get_sblock(name))[-1])
        assert lanes.kind == tvm.tirx.ForKind.VECTORIZED and int(lanes.extent) == ROW_BLOCK
    predicates = {}

    def visit(node, visitor):
        if isinstance(node, tvm.s_tir.SBlockRealize):
            predicates[node.block.name_hint] = node.predicate
        return visitor.default_visit(node)

    tvm_ffi.structural_visit(sch.mod["main"].body, visit)
    for name in (*chain, "row_sum_init"):
        assert isinstance(predicates[name], tvm.tirx.IntImm) and predicates[name].value == 1, name
    assert not isinstance(predicates["row_sum_update"], tvm.tirx.IntImm)


@pytest.mark.parametrize("n", [SHORT, N, 4096])
def test_rows_of_every_length_run_their_chain_in_blocks(n):
    """The chain runs as a vector over a block of rows, however long the rows."""
    sch = scheduled(IntLayerNorm, n)
    loops = sch.get_loops(sch.get_sblock("stat"))
    assert len(loops) == 2 and int(sch.get(loops[-1]).extent) == ROW_BLOCK
