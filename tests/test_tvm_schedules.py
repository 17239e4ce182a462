"""The schedule hook: one kernel definition, laid out per kind of target.

The same op built with the serial schedule (loops as written, as plain C for
HLS would have them) and with the CPU schedule must give the same integers as
the golden op: the schedule moves loops, never arithmetic.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("tvm")

from compilers.tvm.build import build
from compilers.tvm.kernels import kernel_for
from compilers.tvm.kernels._base import CompiledKernel
from compilers.tvm.schedules import CPU, SERIAL
from qnorm.targets import load_target
from qnorm.verify.cases import case_named
from qnorm.verify.vectors import random_inputs

ONE_PER_FAMILY = (
    "int_layernorm.int8.n64",
    "shift_layernorm.int8.n64.m2",
    "bn_quant.int8.c16.relu4",
    "multithreshold.int8.c16.s3.floor",
    "mpbn_lif.int8.c16.soft.gt.noleak",
    "int_silu.s16.s16",
    "softmax.int8.n16.causal",
)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_serial_and_cpu_schedules_agree_with_golden(name: str) -> None:
    case = case_named(name)
    op = case.build()
    x = random_inputs(case, np.random.default_rng(case.seed), 64)
    want = op.forward(x)
    host = load_target("x86_64")
    serial = kernel_for(op, SERIAL)
    script = serial.mod.script()
    assert "T.parallel" not in script and "T.vectorized" not in script
    assert "T.parallel" in kernel_for(op, CPU).mod.script()
    got = CompiledKernel(serial, build(serial.mod, host))(x)
    assert np.array_equal(got, want)


def _lanes(op) -> list[int]:
    script = kernel_for(op, CPU).mod.script()
    return [int(v) for v in re.findall(r"T\.vectorized\((?:T\.int64\()?(\d+)", script)]


@pytest.mark.parametrize("n", [3, 12, 67, 100, 768])
def test_cpu_vectors_have_a_power_of_two_lanes(n: int) -> None:
    """Vectors of other lane counts are legalized by widening and splitting in LLVM,
    where its AArch64 backend once dropped a lane of a <3 x i8> store: the CPU
    schedule vectorizes power-of-two lane counts only (an odd row stays scalar)."""
    from qnorm.ops import IntLayerNorm
    from qnorm.qformat import QFormat

    lanes = _lanes(IntLayerNorm.from_float(np.ones(n), np.zeros(n), 1e-5, QFormat(8, 0.05), QFormat(8, 2.0**-5)))
    assert lanes and all(v & (v - 1) == 0 for v in lanes), lanes
    assert (max(lanes) >= 32) == (n % 32 == 0)


@pytest.mark.parametrize("channels,want", [(7, [4, 2, 1]), (13, [8, 4, 1])])
def test_channel_loops_end_in_power_of_two_vectors(channels: int, want: list[int]) -> None:
    """The hand-written channel loops (the LIF neurons): whole registers, then the
    tail in falling powers of two."""
    from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig
    from qnorm.qformat import QFormat
    from tests.test_tvm_kernels import neuron_params

    cfg = LIFConfig(QFormat(6, 0.125), membrane_bits=16, max_steps=8)
    op = FoldedLIFNeuron(cfg, neuron_params(channels, False, np.random.default_rng(0)))
    lanes = set(_lanes(op))
    assert set(want) <= lanes and all(v & (v - 1) == 0 for v in lanes), lanes
