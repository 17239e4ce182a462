"""Data-parallel training on CPU: DDP over gloo, DistributedSampler, synced BatchNorm.

    torchrun --nproc_per_node 2 -m qnorm.train.distributed --model snn --epochs 8 --out DIR

BatchNorm synchronization. `torch.nn.SyncBatchNorm` refuses CPU tensors (torch
2.13: "SyncBatchNorm expected input tensor to be on GPU or XPU..."), so
`convert_sync_batchnorm` swaps every BatchNorm for `GlooSyncBatchNorm`, which
all-reduces the per-channel sums over the process group in training: every rank
normalizes with the statistics of the global batch and applies the identical
update to its running mean/var. The MPBN neuron keeps its membrane BatchNorm as an
ordinary submodule, so it is converted the same way (sync inside the neuron; its
running statistics need no extra all_reduce). DDP runs with forward_sync_buffers=False
(torch 2.13's name for broadcast_buffers=False; buffers are still synced once at
construction), so no per-step broadcast from rank 0 masks a buffer that is not
synced: at the end of training `replica_mismatches` compares every parameter and
buffer bitwise across ranks, and training fails naming any that differ. A layer
that tracks statistics without being a torch `_BatchNorm` (or a calibrating
quantizer with a running buffer) is not converted: it must reduce its own batch
statistics across ranks, or this check names its buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm

from qnorm.nn.sync import synced_moments
from qnorm.train.checkpoint import save_checkpoint
from qnorm.train.data import DigitsData, load_digits_data
from qnorm.train.loop import (
    TrainResult,
    eval_loader,
    evaluate,
    make_optimizer,
    make_scheduler,
    seed_everything,
    torch_threads,
    train_epoch,
)
from qnorm.train.models import build_model

DEFAULT_LR = {"transformer": 5e-3, "snn": 3e-3}


class GlooSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span all ranks; works on CPU with gloo.

    Outside training, or without an initialized process group, it is plain
    BatchNorm (same state_dict keys, so checkpoints load into unconverted models).
    The statistics come from :func:`qnorm.nn.sync.synced_moments` (two all-reduces,
    bitwise equal on all ranks), so the running statistics stay bitwise equal too.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        self._check_input_dim(x)
        group = self.process_group or dist.group.WORLD
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        centered, mean, var, count = synced_moments(x, group)
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count.item())
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        # Same rule as torch BatchNorm: momentum None means a cumulative average.
        if self.momentum is None:
            factor = 1.0 / self.num_batches_tracked.item()
        else:
            factor = self.momentum
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1.0 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1.0 - factor).add_(unbiased, alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm in `module` by a `GlooSyncBatchNorm` sharing its state.

    Children are replaced in place; the return value differs from `module` only when
    `module` itself is a BatchNorm.
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, GlooSyncBatchNorm):
        converted = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum,
                                      module.affine, module.track_running_stats, process_group)
        # Share, not copy: the optimizer and the caller keep seeing the same tensors.
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted


def replica_mismatches(module: nn.Module) -> list[str]:
    """Names of parameters and buffers whose bytes differ between rank 0 and any rank.

    Compares raw bytes (NaN-safe, no tolerance) with one broadcast of all state and
    one all-reduce of the per-tensor verdicts.
    """
    named = [(n, t) for n, t in chain(module.named_parameters(), module.named_buffers())
             if t is not None]
    local = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    reference = torch.cat(local) if local else torch.empty(0, dtype=torch.uint8)
    reference = reference.clone()
    dist.broadcast(reference, src=0)
    same, offset = [], 0
    for raw in local:
        same.append(int(torch.equal(raw, reference[offset: offset + raw.numel()])))
        offset += raw.numel()
    verdict = torch.tensor(same, dtype=torch.int64)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return [name for (name, _), ok in zip(named, verdict.tolist(), strict=True) if not ok]


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fit(
    ddp: DistributedDataParallel,
    data: DigitsData,
    epochs: int,
    lr: float,
    seed: int,
    batch_size: int,
    weight_decay: float,
    progress: bool,
) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(data.train, batch_size=batch_size // world, sampler=sampler)
    optimizer = make_optimizer(ddp, lr, weight_decay)
    scheduler = make_scheduler(optimizer, epochs * len(loader))
    history: list[float] = []
    bar = tqdm(range(epochs), desc=f"ddp x{world} {type(ddp.module).__name__}",
               disable=not progress or rank != 0)
    for epoch in bar:
        sampler.set_epoch(epoch)
        loss_sum, count = train_epoch(ddp, loader, optimizer, scheduler)
        totals = torch.tensor([loss_sum, count], dtype=torch.float64)
        dist.all_reduce(totals)
        history.append((totals[0] / totals[1]).item())
        bar.set_postfix(loss=f"{history[-1]:.4f}")
    return history


def train_ddp(
    model: nn.Module,
    data: DigitsData,
    epochs: int,
    lr: float,
    seed: int,
    *,
    batch_size: int = 64,
    weight_decay: float = 0.01,
    progress: bool = True,
) -> TrainResult:
    """`loop.train` under DDP; needs an initialized process group.

    `batch_size` is the global batch (each rank takes batch_size / world_size), and
    `history` holds the loss averaged over all ranks. `model` is modified in place
    (trained; its BatchNorms become `GlooSyncBatchNorm`). Every rank evaluates the
    full test set and gets the same result, since the replicas are identical.
    """
    world = dist.get_world_size()
    if batch_size % world:
        raise ValueError(f"batch_size {batch_size} is not divisible by world size {world}")
    # One share of the cores per rank (torchrun already defaults OMP_NUM_THREADS to 1).
    with torch_threads(max(1, _cpus() // world)):
        seed_everything(seed)
        model = convert_sync_batchnorm(model)
        ddp = DistributedDataParallel(model, forward_sync_buffers=False)
        start = time.perf_counter()
        try:
            history = _fit(ddp, data, epochs, lr, seed, batch_size, weight_decay, progress)
        except BaseException as err:
            # The traceback's frames would keep `ddp` alive; see below.
            traceback.clear_frames(err.__traceback__)
            raise
        finally:
            # torch 2.13 + gloo: destroy_process_group() hangs intermittently (about
            # half of the runs here) while a DDP wrapper is still alive. Drop ours
            # before the caller can get there, on success and on error alike.
            del ddp
        seconds = time.perf_counter() - start
        diverged = replica_mismatches(model)
        if diverged:
            raise RuntimeError(f"DDP replicas diverged (not synchronized across ranks): {diverged}")
        accuracy, predictions = evaluate(model, eval_loader(data))
    return TrainResult(history, accuracy, predictions, seconds)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m qnorm.train.distributed",
        description="Train a qnorm digits model with DDP (gloo, CPU).",
    )
    parser.add_argument("--model", choices=sorted(DEFAULT_LR), required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--lr", type=float, help="default: 5e-3 transformer, 3e-3 snn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--norm", help="norm kind (transformer only)")
    parser.add_argument("--neuron", help="neuron kind (snn only)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.norm and args.model != "transformer":
        parser.error("--norm applies to --model transformer only")
    if args.neuron and args.model != "snn":
        parser.error("--neuron applies to --model snn only")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.model]
    config = {k: v for k, v in (("norm", args.norm), ("neuron", args.neuron)) if v}
    dist.init_process_group("gloo")
    try:
        seed_everything(args.seed)
        model = build_model(args.model, **config)
        data = load_digits_data(model.input_layout)
        result = train_ddp(model, data, args.epochs, lr, args.seed, batch_size=args.batch_size,
                           weight_decay=args.weight_decay, progress=not args.no_progress)
        if dist.get_rank() == 0:
            summary = {
                "model": args.model, "world_size": dist.get_world_size(), "epochs": args.epochs,
                "lr": lr, "seed": args.seed, "batch_size": args.batch_size,
                "weight_decay": args.weight_decay, "history": result.history,
                "test_accuracy": result.test_accuracy, "train_seconds": result.seconds,
            }
            save_checkpoint(model, args.out / "checkpoint", metadata={"training": summary})
            (args.out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"test accuracy {result.test_accuracy:.4f} after {args.epochs} epochs "
                  f"({result.seconds:.1f} s); wrote {args.out}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
