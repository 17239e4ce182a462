#!/usr/bin/env bash
# scripts/gpu_check.sh: qnorm's CUDA kernels on a real NVIDIA GPU, bit-exact and benchmarked.
#
# A GPU host needs only nvcc and python3 (torch optional), neither TVM nor the
# project's venv, so the check runs in two steps:
#
#   1. Where the venv and TVM are: scripts/gpu_check.sh prepare [BUNDLE]
#      TVM writes every verify case's CUDA source (GPU schedule, compilers/tvm/gpu.py),
#      nvcc builds PTX + cubin for sm_80 and sm_90, the golden model writes the inputs
#      and expected outputs (the stored golden vectors plus the edge, exhaustive and
#      random vectors of a default `qnorm verify`), and the int8 norm kernels at
#      (4096,768), (1024,4096) and (49152,64) get benchmark plans.  BUNDLE defaults to
#      out/gpu_bundle (ignored by git, about 20 MiB).  The harness is compiled once
#      too, so a harness that does not build fails here.
#
#      Whole models: every checkpoint `make demo` saved (out/deploy/checkpoints/*: the
#      mixer, the SNN, the integer transformer, the LLaMA-style model) is compiled for
#      CUDA into MODELS/NAME (`qnorm compile CKPT --target cuda`: a cache hit when the
#      model is unchanged), MODELS from $QNORM_CUDA_MODELS, default out/deploy/cuda.
#      Every compiled model in MODELS (put your own there with `-o MODELS/NAME`) gives
#      the bundle models/NAME/model.plan: the model's launches on 64 digits test
#      samples and the QAT model's outputs (scripts/cuda_model_plan.py).  Without any,
#      the bundle has no whole-model plans and says so.
#
#   2. On the GPU host:            scripts/gpu_check.sh run [BUNDLE]
#      builds compilers/tvm/harness/gpu_harness.cu with nvcc, runs every case on the GPU (the cubin
#      built in step 1 for the GPU's architecture, else the PTX, JIT-compiled), compares
#      every output element with the golden output, times the benchmark kernels, and
#      runs every whole-model plan in the bundle (its float32 output bit for bit),
#      times torch.nn.functional.layer_norm / rms_norm on float16 and float32 rows of
#      the same shapes if torch with CUDA is installed (else says so).  Needs nvcc,
#      python3 and a CUDA GPU; takes well under 5 minutes.  Results: gpu_verify.md,
#      gpu_bench.md, gpu_results.json and the harness logs, in $OUT when set, else
#      benchmarks/gpu/.  Exit status 1 if any case or benchmark kernel is not
#      bit-exact.
#
# When the GPU host is another machine, copy the checkout with out/gpu_bundle to it,
# run step 2 there, and bring gpu_*.md and gpu_results.json back into benchmarks/gpu/.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
step="${1:-}"
bundle="${2:-$repo/out/gpu_bundle}"

# The whole-model plans: make demo's checkpoints compiled for CUDA, then one plan per compiled model.
prepare_models() {
  local py="$1" models="${QNORM_CUDA_MODELS:-$repo/out/deploy/cuda}" checkpoint model found=0
  for checkpoint in "$repo"/out/deploy/checkpoints/*/; do
    [[ -d "$checkpoint" ]] || continue
    "$py" -m qnorm.cli compile "$checkpoint" --target cuda -o "$models/$(basename "$checkpoint")"
  done
  rm -rf "$bundle/models"
  for model in "$models"/*/; do
    [[ -f "$model/model.json" ]] || continue
    "$py" "$repo/scripts/cuda_model_plan.py" "$model" "$bundle/models/$(basename "$model")"
    found=$((found + 1))
  done
  if ((found == 0)); then
    echo "no CUDA-compiled model in $models (run make demo first): the bundle has no whole-model plan" >&2
  fi
}

prepare() {
  local py="$repo/.venv/bin/python"
  [[ -x "$py" ]] || { echo "no $py: run 'make venv' first" >&2; exit 2; }
  "$py" "$repo/scripts/gpu_bundle.py" --out "$bundle"
  prepare_models "$py"
  local tmp
  tmp="$(mktemp -d)"
  nvcc -O2 -std=c++17 "$repo/compilers/tvm/harness/gpu_harness.cu" -o "$tmp/gpu_harness"
  rm -rf "$tmp"
  echo "prepared $bundle; on the GPU host: scripts/gpu_check.sh run" >&2
}

run() {
  local out="${OUT:-$repo/benchmarks/gpu}" start=$SECONDS status=0
  [[ -f "$bundle/manifest.json" ]] || { echo "no bundle at $bundle: run '$0 prepare' first" >&2; exit 2; }
  command -v nvcc >/dev/null || { echo "nvcc not found" >&2; exit 2; }
  local device
  device="$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -1)" \
    || { echo "nvidia-smi lists no GPU" >&2; exit 2; }
  mkdir -p "$out"
  local harness="$out/gpu_harness"
  nvcc -O2 -std=c++17 "$repo/compilers/tvm/harness/gpu_harness.cu" -o "$harness"
  echo "GPU: $device; harness built in $((SECONDS - start)) s" | tee "$out/gpu_check.log"
  "$harness" "$bundle"/cases/*/verify.plan >"$out/gpu_verify.log" 2>>"$out/gpu_check.log" || status=$?
  echo "verify plans ran (exit $status) by $((SECONDS - start)) s" | tee -a "$out/gpu_check.log"
  "$harness" "$bundle"/bench/*.plan >"$out/gpu_bench.log" 2>>"$out/gpu_check.log" || status=$?
  echo "benchmark plans ran (exit $status) by $((SECONDS - start)) s" | tee -a "$out/gpu_check.log"
  local plan name ran=0
  for plan in "$bundle"/models/*/model.plan; do
    [[ -f "$plan" ]] || continue
    name="$(basename "$(dirname "$plan")")"
    "$harness" "$plan" >"$out/gpu_model_$name.log" 2>>"$out/gpu_check.log" || status=$?
    echo "whole-model plan $name: $(cat "$out/gpu_model_$name.log") (exit $status)" | tee -a "$out/gpu_check.log"
    ran=$((ran + 1))
  done
  if ((ran == 0)); then
    echo "no whole-model plan in $bundle: skipped" | tee -a "$out/gpu_check.log"
  fi
  python3 "$repo/benchmarks/bench_gpu.py" --bundle "$bundle" --verify-log "$out/gpu_verify.log" \
    --bench-log "$out/gpu_bench.log" --out "$out" --device "$device" || status=$?
  echo "done in $((SECONDS - start)) s, exit $status" | tee -a "$out/gpu_check.log"
  rm -f "$harness"
  exit "$status"
}

case "$step" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run [BUNDLE]   (see the top of this script)" >&2; exit 2 ;;
esac
