"""Seeded single-process training: AdamW, cosine learning-rate decay, cross-entropy.

Bitwise reproducibility on CPU: every random source is seeded, the data order comes
from a dedicated generator, nothing runs in DataLoader worker processes, and the
models contain no dropout. Results are reproducible for a fixed torch build and a
fixed `torch.get_num_threads()` (the thread count can change reduction order).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from qnorm.train.data import DigitsData

EVAL_BATCH = 512


@dataclass
class TrainResult:
    history: list[float]  # mean training loss of each epoch
    test_accuracy: float
    predictions: torch.Tensor  # predicted class of each test sample, in dataset order
    seconds: float  # wall time of the training epochs (evaluation excluded)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch; call it before building a model to fix its init."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with `count` intra-op threads, then restore the previous count.

    These models are tiny: per-op thread synchronization costs more than it saves,
    and once the cores are oversubscribed (pytest-xdist, DDP ranks, anything else
    running) OpenMP barriers stall for milliseconds per op. Measured here with one
    core busy elsewhere: log_softmax on 64x10 took 8 ms with 2 threads, 12 us with 1.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Decay only matrices and kernels: decaying norm gains, biases or learned
    # quantizer scales toward zero would fight the normalization/quantization.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.CosineAnnealingLR:
    """Cosine decay to 0 over `total_steps` optimizer steps (stepped once per batch)."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))


def train_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[float, int]:
    """One pass over `loader`; returns (sum of per-sample losses, number of samples)."""
    model.train()
    loss_sum, count = 0.0, 0
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_sum += loss.item() * len(y)
        count += len(y)
    return loss_sum, count


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, torch.Tensor]:
    """Accuracy and predicted classes over `loader` (in eval mode; mode restored)."""
    was_training = model.training
    model.eval()
    predictions, labels = [], []
    for x, y in loader:
        predictions.append(model(x).argmax(dim=1))
        labels.append(y)
    model.train(was_training)
    pred = torch.cat(predictions)
    return (pred == torch.cat(labels)).double().mean().item(), pred


def eval_loader(data: DigitsData) -> DataLoader:
    """The test split in fixed order (predictions line up with `data.test`)."""
    return DataLoader(data.test, batch_size=EVAL_BATCH, shuffle=False)


def train(
    model: nn.Module,
    data: DigitsData,
    epochs: int,
    lr: float,
    seed: int,
    *,
    batch_size: int = 64,
    weight_decay: float = 0.01,
    progress: bool = True,
    num_threads: int = 1,
    desc: str | None = None,
) -> TrainResult:
    """Train `model` in place on `data.train`, then evaluate on `data.test`.

    Seeds every RNG with `seed` (data order included) but does not re-initialize
    `model`: seed before building it for a fully reproducible run. Runs with
    `num_threads` intra-op threads (see `torch_threads` for why 1 is the default).
    `desc` labels the progress bar (default: the model's class name).
    """
    with torch_threads(num_threads):
        seed_everything(seed)
        loader = DataLoader(
            data.train, batch_size=batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        optimizer = make_optimizer(model, lr, weight_decay)
        scheduler = make_scheduler(optimizer, epochs * len(loader))
        history: list[float] = []
        start = time.perf_counter()
        bar = tqdm(range(epochs), desc=desc or f"train {type(model).__name__}", disable=not progress)
        for _ in bar:
            loss_sum, count = train_epoch(model, loader, optimizer, scheduler)
            history.append(loss_sum / count)
            bar.set_postfix(loss=f"{history[-1]:.4f}")
        seconds = time.perf_counter() - start
        accuracy, predictions = evaluate(model, eval_loader(data))
    return TrainResult(history, accuracy, predictions, seconds)
