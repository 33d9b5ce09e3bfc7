#!/usr/bin/env bash
# The GPU test tier: every test that runs on CUDA when a GPU is there.
#   bash tools/gpu_tier.sh [kernels|services|all]      (default all; logs and JUnit XML under $OUT or /tmp)
#
#   kernels   tests/kernels (and tests/kernels/model): the Triton kernels compiled for the GPU, the model on
#             the Triton backend, the golden vectors' cuda key, the fused backward, the MoE GEMMs
#             (TP tests need several GPUs: tests/kernels/model/test_tensor_parallel.py is left to CPU/gloo)
#   services  every `gpu`-marked test under tests/services: the engine's CUDA graphs, trainer == engine
#             logprobs in bf16 (KL == 0.0), a GRPO step on the device, the trainer's fast path
#
# Compiling Triton kernels is host work, so the tests run in parallel processes (pytest-xdist, on the
# device image) sharing the GPU; the compile cache lives in the checkout's ignored .gpu/ so a warm
# machine's next call starts compiled.
set -u
PART=${1:-all}
LOGS=${OUT:-/tmp}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.gpu/triton-cache} PYTHONUNBUFFERED=1
mkdir -p "$TRITON_CACHE_DIR" "$LOGS"
WORKERS=${GPU_TIER_WORKERS:-8}
XDIST=""
python3 -c 'import xdist' 2> /dev/null && XDIST="-n $WORKERS --dist loadfile"
status=0
if [ "$PART" = kernels ] || [ "$PART" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -rs --durations=15 $XDIST --junitxml="$LOGS/gpu_kernels.xml" \
    tests/kernels --ignore=tests/kernels/model/test_tensor_parallel.py 2>&1 | tee "$LOGS/gpu_kernels.log"
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$PART" = services ] || [ "$PART" = all ]; then
  # only the files with gpu tests: the others need the CPU tier's extras (kubernetes, moto, cryptography).
  # One pytest per directory: the tests import their directory's helpers as `conftest`, and a session
  # given files of several directories loads every conftest.py first (the last one wins that name).
  : > "$LOGS/gpu_services.log"
  for dir in $(grep -rlE "mark\.gpu|marks=pytest\.mark\.gpu" tests/services --include='test_*.py' | xargs -n1 dirname | sort -u); do
    files=$(grep -lE "mark\.gpu|marks=pytest\.mark\.gpu" "$dir"/test_*.py)
    python3 -m pytest -q -p no:cacheprovider -rs --durations=15 -m gpu ${XDIST/loadfile/load} \
      --junitxml="$LOGS/gpu_services_$(basename "$dir").xml" $files 2>&1 | tee -a "$LOGS/gpu_services.log"
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
exit $status
