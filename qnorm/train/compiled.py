"""A checkpoint compiled into a library: where the checkpoint format meets the compiler.

:func:`compile_checkpoint` loads a :func:`~qnorm.train.checkpoint.save_checkpoint`
directory and compiles its model (:func:`compilers.tvm.graph.compile_model`);
:func:`checkpoint_source` is what ``model.json`` records about the checkpoint a model
came from.  The compiler knows nothing of checkpoints, so this lives with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compilers.cache import sha256_file
from compilers.tvm.c_api import CApiModel
from compilers.tvm.graph import CompiledModel, artifact_kind, compile_model, compile_target
from qnorm.train.checkpoint import load_checkpoint
from qnorm.train.checkpoint_meta import META


def compile_checkpoint(
    checkpoint: str | Path, target: str = "x86_64", c_api_requested: bool = False
) -> tuple[CompiledModel | CApiModel, dict[str, Any]]:
    """Compile a ``save_checkpoint`` directory: the compiled model and its ``source`` record
    (``c_api_requested``: the C API for x86_64 too, see :func:`compile_model`)."""
    resolved = compile_target(target)  # refuse an unsupported target before loading anything
    artifact_kind(resolved, c_api_requested)
    model, meta = load_checkpoint(checkpoint)
    compiled = compile_model(model, model.example_input(), resolved, c_api_requested=c_api_requested)
    return compiled, checkpoint_source(checkpoint, meta)


def checkpoint_source(checkpoint: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What ``model.json`` records about the checkpoint a model was compiled from."""
    path = Path(checkpoint)
    return {
        "checkpoint": str(path.resolve()),
        "model": meta["model"],
        "weights_sha256": meta["weights"]["sha256"],
        "meta_sha256": sha256_file(path / META),
    }
