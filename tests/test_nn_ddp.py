"""QAT layers under DDP (2 gloo ranks): BN/MPBN statistics and input calibration are
synchronized, so replicas stay byte-identical and every step's batch statistics are
exactly those of single-process training on the concatenated batch."""

from __future__ import annotations

import faulthandler
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from qnorm.nn import MPBNLIF, BNQuantAct, InputQuantizer
from qnorm.nn._qat import BNQATModule
from qnorm.train.distributed import replica_mismatches

WORLD = 2
STEPS = 4
T, BATCH, FEATURES, C = 3, 16, 5, 4  # BATCH: the global batch; each rank takes BATCH / WORLD rows
TIMEOUT_S = 150
STAT_BUFFERS = [
    "inq.running_max_abs",
    "inq.format_max_abs",
    "lif.running_mean",
    "lif.running_var",
    "lif.input_quant.running_max_abs",
    "lif.input_quant.format_max_abs",
    "act.running_mean",
    "act.running_var",
    "act.input_quant.running_max_abs",
    "act.input_quant.format_max_abs",
]


class Net(nn.Module):
    """A calibrating InputQuantizer, then Linear -> MPBNLIF -> BNQuantAct -> Linear, all trained."""

    def __init__(self) -> None:
        super().__init__()
        self.inq = InputQuantizer(bits=6)  # calibrates a running max |x| in training
        self.fc = nn.Linear(FEATURES, C)
        self.lif = MPBNLIF(C, v_th=0.3, leak=0.5, reset="soft")  # calibrating input quantizer too
        self.act = BNQuantAct(C)  # and here
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (T, B, FEATURES)
        h = self.fc(self.inq(x).dequant)
        spikes = self.lif(h)  # (T, B, C)
        return self.head(self.act(h.mean(0) + spikes.mean(0)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(T, BATCH, FEATURES, generator=g) * (1 + step), torch.randint(0, 3, (BATCH,), generator=g))
        for step in range(STEPS)
    ]


def record_stats(model: Net, log: list[dict]) -> None:
    """Log every BatchStats the BN layers normalize with (the instance attribute wraps the method)."""
    for name, module in model.named_modules():
        if isinstance(module, BNQATModule):
            method = module.training_stats

            def logged(ints, scale, _method=method, _name=name):
                stats = _method(ints, scale)
                log.append({"layer": _name, "mean": stats.mean, "var": stats.var, "var_unbiased": stats.var_unbiased})
                return stats

            module.training_stats = logged


def train(rank: int, sync: bool) -> dict:
    """STEPS DDP steps on this rank's half of each global batch; what the parent checks."""
    torch.manual_seed(0)
    model = Net()
    for m in model.modules():
        if hasattr(m, "sync_stats"):
            m.sync_stats = sync
    log: list[dict] = []
    record_stats(model, log)
    ddp = DistributedDataParallel(model, forward_sync_buffers=False)  # no broadcast masking a divergence
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    before, stats, losses, grads = [], [], [], []
    for x, y in batches():
        before.append({k: v.clone() for k, v in model.state_dict().items()})
        del log[:]
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x[:, rows]), y[rows])
        loss.backward()  # DDP averages the gradients over the ranks
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        optimizer.step()
        stats.append(list(log))
        losses.append(loss.item())
    del ddp  # before destroy_process_group (see qnorm.train.distributed.train_ddp)
    return {
        "before": before,
        "after": {k: v.clone() for k, v in model.state_dict().items()},
        "stats": stats,
        "losses": losses,
        "grads": grads,
        "mismatches": replica_mismatches(model),
    }


def _worker(rank: int, store: str, out: str) -> None:
    faulthandler.dump_traceback_later(TIMEOUT_S - 20, exit=True)  # a hung collective: dump where
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        result = {"synced": train(rank, sync=True), "unsynced": train(rank, sync=False)}
        torch.save(result, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _join(context, deadline: float) -> None:
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"DDP workers did not finish within {TIMEOUT_S} s")


def single_process_step(state: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, list[dict], dict]:
    """One training step of a fresh model loaded with ``state`` on the whole batch (no process group):
    the state after the forward, the batch statistics used, the gradients."""
    model = Net()
    model.load_state_dict(state)
    log: list[dict] = []
    record_stats(model, log)
    model.train()
    F.cross_entropy(model(x), y).backward()
    return model.state_dict(), log, {k: p.grad for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("nn_ddp")
    context = mp.start_processes(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=False,
                                 start_method="spawn")  # fmt: skip
    _join(context, time.monotonic() + TIMEOUT_S)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_replicas_stay_byte_identical(ranks):
    a, b = (r["synced"] for r in ranks)
    assert a["mismatches"] == b["mismatches"] == []
    assert a["after"].keys() == b["after"].keys()
    for name in a["after"]:
        raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a["after"][name], b["after"][name])]
        assert torch.equal(*raw), name
    # the statistics really moved (equality is not vacuous), once per BN call
    final = a["after"]
    assert int(final["lif.num_batches_tracked"]) == STEPS * T and int(final["act.num_batches_tracked"]) == STEPS
    for name in STAT_BUFFERS:
        assert float(final[name].abs().sum()) > 0, name
    assert a["losses"] != b["losses"]  # the ranks did see different shards
    assert all(np.isfinite(a["losses"]))


def test_batch_statistics_equal_single_process_on_the_concatenated_batch(ranks):
    """Integer sums reduced across ranks: every step's statistics (and the calibrated scales)
    are bit for bit those of one process on the whole batch, from the same state."""
    synced = ranks[0]["synced"]
    for step, (x, y) in enumerate(batches()):
        state, log, _ = single_process_step(synced["before"][step], x, y)
        for rank in ranks:
            ddp_log = rank["synced"]["stats"][step]
            assert [e["layer"] for e in ddp_log] == [e["layer"] for e in log] == ["lif"] * T + ["act"]
            for got, want in zip(ddp_log, log, strict=True):
                for key in ("mean", "var", "var_unbiased"):
                    assert np.array_equal(got[key], want[key]), (step, got["layer"], key)
        after = synced["before"][step + 1] if step + 1 < STEPS else synced["after"]
        for name in STAT_BUFFERS + ["lif.num_batches_tracked", "act.num_batches_tracked"]:
            assert torch.equal(after[name], state[name]), (step, name)


def test_without_sync_exactly_the_statistics_diverge(ranks):
    """Negative control (sync_stats = False): DDP keeps the parameters equal, and every
    statistics buffer differs between the ranks and is named by replica_mismatches."""
    a, b = (r["unsynced"] for r in ranks)
    assert a["mismatches"] == b["mismatches"] == STAT_BUFFERS
    shard_stats = [r["stats"][0][0]["mean"] for r in (a, b)]  # step 1, the first MPBN step
    assert not np.array_equal(*shard_stats)
    assert not np.array_equal(shard_stats[0], ranks[0]["synced"]["stats"][0][0]["mean"])




def test_gradients_are_single_process_gradients(ranks):
    """The surrogate's BN statistics span the ranks too (synced_batch_norm): DDP's averaged
    gradients are one process's on the concatenated batch, up to float summation order
    (measured); with per-rank statistics they are not."""
    x, y = batches()[0]
    for mode, bound in (("synced", 1e-5), ("unsynced", None)):
        run = ranks[0][mode]
        _, _, want = single_process_step(run["before"][0], x, y)
        assert run["grads"][0].keys() == want.keys()
        scale = torch.cat([g.flatten() for g in want.values()]).norm()  # fc.bias's own gradient is ~0 (BN)
        errors = {k: float((run["grads"][0][k] - want[k]).norm() / scale) for k in want}
        for k, g in run["grads"][0].items():
            assert torch.equal(g, ranks[1][mode]["grads"][0][k]), k  # DDP's average: the same on every rank
        if bound is not None:
            assert max(errors.values()) < bound, errors
        else:  # per-rank statistics normalize differently: a visibly different gradient
            assert errors["lif.weight"] > 1e-3 and errors["act.weight"] > 1e-3, errors
