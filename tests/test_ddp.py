"""DDP on CPU: 2 gloo ranks keep bitwise-identical replicas, BN/MPBN stats included."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel

from qnorm.train.checkpoint import load_checkpoint
from qnorm.train.data import load_digits_data
from qnorm.train.distributed import GlooSyncBatchNorm, replica_mismatches, train_ddp
from qnorm.train.loop import eval_loader, evaluate, seed_everything, torch_threads
from qnorm.train.models import build_model

WORLD = 2
TIMEOUT_S = 150


def _unsynced_bn_mismatches(train: tuple[torch.Tensor, ...], rank: int) -> list[str]:
    """Negative control: the SNN under DDP without BN synchronization.

    DDP still averages gradients, so the parameters agree, but every rank's running
    statistics come from its own half of the batch and must be caught. A helper, so
    the DDP object is freed before the process group is destroyed (see the note in
    `train_ddp`: destroying it first hangs intermittently).
    """
    seed_everything(0)
    plain = build_model("snn")
    ddp = DistributedDataParallel(plain, forward_sync_buffers=False)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    x, y = train
    for step in range(2):
        rows = slice(64 * step + 32 * rank, 64 * step + 32 * (rank + 1))
        optimizer.zero_grad()
        F.cross_entropy(ddp(x[rows]), y[rows]).backward()
        optimizer.step()
    return replica_mismatches(plain)


def _worker(rank: int, store: str, out: str) -> None:
    # A hung collective would otherwise only show as the parent's timeout: dump where.
    faulthandler.dump_traceback_later(TIMEOUT_S - 20, exit=True)
    torch.set_num_threads(1)  # two ranks on two cores; see loop.torch_threads
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        seed_everything(0)
        model = build_model("snn")
        data = load_digits_data(model.input_layout)
        result = train_ddp(model, data, epochs=2, lr=3e-3, seed=0, progress=False)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  f"{out}/rank{rank}.safetensors")
        synced = sorted(n for n, m in model.named_modules() if isinstance(m, GlooSyncBatchNorm))
        unsynced = _unsynced_bn_mismatches(data.train.tensors, rank)
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "history": result.history, "accuracy": result.test_accuracy,
            "synced_modules": synced, "unsynced_mismatches": unsynced,
        }))
    finally:
        dist.destroy_process_group()


def _join(context, deadline: float) -> None:
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"DDP workers did not finish within {TIMEOUT_S} s")


def test_ddp_replicas_and_norm_statistics_stay_bitwise_identical(tmp_path):
    context = mp.start_processes(
        _worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=False,
        start_method="spawn",
    )
    _join(context, time.monotonic() + TIMEOUT_S)

    states = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(WORLD)]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    # The MPBN neurons' BatchNorms were synced, and their statistics really moved
    # (otherwise equality above would be vacuous).
    assert reports[0]["synced_modules"] == ["neurons.0.bn", "neurons.1.bn"]
    for layer in ("neurons.0.bn", "neurons.1.bn"):
        # 2 epochs x 23 steps (ceil(ceil(1437 / 2) / 32)) x T=4 membrane updates.
        assert states[0][f"{layer}.num_batches_tracked"].item() == 2 * 23 * 4
        assert states[0][f"{layer}.running_mean"].abs().sum() > 0
        assert not torch.equal(states[0][f"{layer}.running_var"], torch.ones_like(
            states[0][f"{layer}.running_var"]))
    assert reports[0]["history"] == reports[1]["history"]
    first, last = reports[0]["history"]
    assert last < 0.5 * first, reports[0]["history"]
    assert reports[0]["accuracy"] == reports[1]["accuracy"] > 0.8
    # Without sync, exactly the BN running statistics diverge and are named.
    assert reports[0]["unsynced_mismatches"] == reports[1]["unsynced_mismatches"] == [
        f"neurons.{i}.bn.{stat}" for i in (0, 1) for stat in ("running_mean", "running_var")
    ]


def test_torchrun_entry_point_trains_and_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={WORLD}", "-m", "qnorm.train.distributed", "--model", "transformer",
         "--epochs", "3", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == WORLD and len(metrics["history"]) == 3
    assert metrics["history"][-1] < metrics["history"][0]
    model, meta = load_checkpoint(out / "checkpoint")
    assert meta["model"]["kind"] == "transformer"
    assert meta["metadata"]["training"] == metrics
    data = load_digits_data(model.input_layout)
    with torch_threads(1):
        accuracy, _ = evaluate(model, eval_loader(data))
    # Same weights, same evaluation: the accuracy rank 0 recorded is reproduced exactly.
    assert accuracy == metrics["test_accuracy"] > 0.5
