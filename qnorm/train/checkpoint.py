"""Pickle-free checkpoints: safetensors weights plus a JSON sidecar.

A checkpoint is a directory holding
  weights.safetensors   every state_dict tensor (parameters and buffers)
  meta.json             {"format", "version", "model", "model_checksums", "metadata",
                         "modules", "weights": {"bytes", "sha256"}}
"model" is `model_spec(model)` (kind + config, enough to rebuild it) and
"model_checksums" the sha256 of each of its fields (`json_fields.field_checksums`),
"metadata" is the caller's dict (hyperparameters, results...), and "modules" maps the
qualified name of every module that has a `qnorm_metadata()` method to what it
returns ("" is the root module; `qnorm.nn.metadata.collect_module_metadata`); this
is how quantized layers publish scales, bit widths, golden integer constants or
folded thresholds without the checkpoint code knowing them.

Loading never unpickles anything and fails with a CheckpointError (a ValueError) that
names the problem: missing file, size or checksum mismatch (truncated / corrupt
weights), unparsable JSON (read by :mod:`qnorm.train.checkpoint_meta`, torch-free),
a model spec that does not match its checksums (naming the fields), safetensors
that do not parse, tensors whose names, shapes or dtypes do not match the model, or
module metadata that the loaded model does not reproduce.  That last check re-derives
every qnorm layer's golden op from the loaded float parameters and calibration and
compares it, field by field, with what was recorded: an edited constant, or code
whose integer definition changed since the save, would otherwise give other integers
than the ones the checkpoint was validated with.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from qnorm.errors import CheckpointError
from qnorm.nn.metadata import collect_module_metadata, metadata_hooks
from qnorm.nn.quantizer import InputQuantizer
from qnorm.ops._normcore import DEFINITION_NOTES
from qnorm.train.checkpoint_meta import (
    FORMAT,
    META,
    VERSION,
    WEIGHTS,
    checkpoint_dir,
    read_metadata,
)
from qnorm.train.json_fields import (
    checksum_differences,
    differences,
    field_checksums,
    listing,
)
from qnorm.train.models import build_model, model_spec


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(
    model: nn.Module, directory: str | Path, metadata: dict[str, Any] | None = None
) -> Path:
    """Write `model`'s state_dict and metadata into `directory` (created if needed)."""
    directory = Path(directory)
    modules = collect_module_metadata(model)
    spec = json.loads(json.dumps(model_spec(model)))  # checksummed as it will be read back (tuples as lists)
    header = {"format": FORMAT, "version": VERSION, "model": spec, "model_checksums": field_checksums(spec),
              "metadata": metadata or {}, "modules": modules}
    # Serialize before touching the disk, so a non-JSON value leaves no half checkpoint.
    try:
        json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as err:
        bad = [name for name, value in modules.items() if not _is_json(value)]
        where = f"qnorm_metadata() of module(s) {bad}" if bad else "the metadata argument"
        raise ValueError(f"checkpoint metadata is not JSON-serializable ({where}): {err}") from err
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / WEIGHTS
    # Parameters can share storage (views, tied weights); safetensors refuses shared
    # storage, so every tensor gets its own contiguous copy.
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
              str(weights))
    header["weights"] = {"bytes": weights.stat().st_size, "sha256": _sha256(weights)}
    (directory / META).write_text(json.dumps(header, indent=2, allow_nan=False) + "\n")
    return directory


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _check_spec(directory: Path, meta: dict[str, Any]) -> None:
    """The model spec must match its recorded field checksums: an edited spec (say the
    norm kind) would rebuild another model around the same weights."""
    changed = checksum_differences(meta["model"], meta["model_checksums"])
    if changed:
        raise CheckpointError(f"checkpoint {directory}: the model spec in {directory / META} does not match "
                              f"its checksums (edited?): {listing(changed)}")


def _check_modules(directory: Path, model: nn.Module, recorded: dict[str, Any]) -> None:
    """Every module's `qnorm_metadata()`, re-derived from the loaded model (golden ops
    from the loaded float parameters and calibration), must equal the recorded one."""
    hooks = metadata_hooks(model)
    problems = [f"module {name!r} was recorded but the model has no such metadata hook"
                for name in recorded if name not in hooks]
    for name, hook in hooks.items():
        try:
            derived = json.loads(json.dumps(hook(), allow_nan=False))
        except ValueError as err:
            raise CheckpointError(f"checkpoint {directory}: re-deriving module {name!r}'s metadata from the "
                                  f"loaded parameters failed: {err}") from err
        if name not in recorded:
            problems.append(f"module {name!r} has metadata that {META} does not record")
            continue
        _check_definition(directory, name, recorded[name], derived)
        problems += [f"module {name!r} {d}" for d in differences(recorded[name], derived)]
    if problems:
        raise CheckpointError(f"checkpoint {directory}: the loaded model does not reproduce the module metadata "
                              f"recorded in {directory / META}: {listing(problems)}")


def _check_definition(directory: Path, name: str, recorded: Any, derived: Any) -> None:
    """A layer recorded under another version of its op's integer definition is refused
    with what changed, before its constants are compared one by one."""
    golden = [m.get("golden") if isinstance(m, dict) else None for m in (recorded, derived)]
    if not all(isinstance(g, dict) for g in golden):
        return
    was, now = golden[0].get("definition", 1), golden[1].get("definition", 1)
    if was != now:
        raise CheckpointError(
            f"checkpoint {directory}: module {name!r} was saved with version {was} of the "
            f"{golden[1].get('op')} integer definition; this qnorm computes version {now} "
            f"({DEFINITION_NOTES.get(now, 'a different integer algorithm')}), so its recorded "
            "integers would be reinterpreted. Load the float parameters into a freshly built model "
            "and save it again (qnorm train writes the current version)"
        )


def _read_weights(directory: Path, recorded: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: missing weights file {path}")
    size = path.stat().st_size
    if size != recorded.get("bytes"):
        raise CheckpointError(f"checkpoint {directory}: weights file {path} is truncated or padded: "
                         f"{size} bytes, meta.json records {recorded.get('bytes')}")
    if _sha256(path) != recorded.get("sha256"):
        raise CheckpointError(f"checkpoint {directory}: weights file {path} is corrupt: "
                         "its sha256 does not match meta.json")
    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise CheckpointError(f"checkpoint {directory}: {path} is not a valid safetensors file: "
                         f"{err}") from err


def _check_match(directory: Path, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors: {listing(missing, ', ')}")
    if unexpected:
        problems.append(f"unexpected tensors: {listing(unexpected, ', ')}")
    mismatched = [
        f"{k} {tuple(tensors[k].shape)}/{tensors[k].dtype} vs model {tuple(v.shape)}/{v.dtype}"
        for k, v in expected.items()
        if k in tensors and (tensors[k].shape != v.shape or tensors[k].dtype != v.dtype)
    ]
    if mismatched:
        problems.append(f"shape/dtype mismatch: {listing(mismatched, ', ')}")
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not match {type(model).__name__}: "
                         + "; ".join(problems))


def _format_ranges_of_v2(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A version-2 checkpoint's input quantizers made their format from the running range
    (there was no dead band): their ``format_max_abs`` is that range, so every golden op
    re-derives as it was saved (and ``_check_modules`` compares them)."""
    tensors = dict(tensors)
    for name, module in model.named_modules():
        if isinstance(module, InputQuantizer):
            prefix = f"{name}." if name else ""
            running = tensors.get(prefix + "running_max_abs")
            if running is not None and prefix + "format_max_abs" not in tensors:
                tensors[prefix + "format_max_abs"] = running.clone()
    return tensors


def load_checkpoint(
    directory: str | Path, model: nn.Module | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Load a checkpoint into `model` (or into a model rebuilt from meta.json).

    Returns the model, in eval mode, and the parsed meta.json.
    """
    directory = checkpoint_dir(directory)
    meta = read_metadata(directory)
    _check_spec(directory, meta)
    tensors = _read_weights(directory, meta["weights"])
    if model is None:
        spec = meta["model"]
        try:
            model = build_model(spec["kind"], **spec["config"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint {directory}: invalid model spec {spec!r}: {err}") from err
    if meta["version"] == 2:
        tensors = _format_ranges_of_v2(model, tensors)
    _check_match(directory, model, tensors)
    model.load_state_dict(tensors, strict=True)
    _check_modules(directory, model, meta["modules"])
    return model.eval(), meta
