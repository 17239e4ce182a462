"""The whole-model part of the GPU check (scripts/gpu_check.sh prepare): needs TVM.

Reads a directory written by ``qnorm compile CHECKPOINT --target cuda -o DIR`` and
writes ``OUT/model.plan`` with the model's PTX and cubins: the first 64 samples of
the digits test set quantized as the model's first quantizer does, every launch of
the model, and the checkpoint's QAT model outputs on those samples, which the GPU's
float32 output must equal bit for bit (compilers/tvm/harness/gpu_harness.cu).

Usage: .venv/bin/python scripts/cuda_model_plan.py DIR OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from compilers.tvm.graph import load_compiled
from qnorm.train.checkpoint import load_checkpoint
from qnorm.train.data import load_digits_data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="directory written by qnorm compile --target cuda")
    parser.add_argument("out", type=Path, help="directory for model.plan and its files")
    args = parser.parse_args()
    compiled = load_compiled(args.model, "cuda")
    model, _ = load_checkpoint(compiled.metadata["source"]["checkpoint"])
    x = load_digits_data(model.input_layout, seed=0).test.tensors[0][:64]
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    plan = compiled.harness_plan(compiled.quantize(x.numpy()), expected, args.out)
    print(f"wrote {plan} ({len(x)} samples of the digits test set)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
