#!/usr/bin/env bash
# One device call's worth of GPU work, logs and JSON under $OUT.
#   ZEROKL_COMMIT=$(git rev-parse --short HEAD) bash tools/bench/h200_run.sh MODE
# MODE: final (issue 8's benches), fp8-sweep / fp8-grouped (issue 50's FP8 tile configs: plain, the experts'), colocate / rl20 / poll (issue 49's runs longer than a call), fp8-train (issue 51), map (issue 53's mismatch map: see its comment), zerokl, numerics3, wave4-check, wave4-final, wave4-rl, wave5, wave2, wave3-a .. wave3-k, wave3-fp8: each says what it runs.
# zerokl: the GPU golden vectors, `zerokl verify`, and the GPU test tier (the zero-KL promise);
# the services' tests need the wheels in .whl/ (grpcio, protobuf, OpenTelemetry, minio).
# Single-GPU benches run concurrently on GPU 0 and GPU 1 when there are two; TP last.
set -u
MODE=${1:-final}
FINAL_OUT=${OUT:-/tmp/zerokl-out}
OUT=/tmp/zerokl-work
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || cat "$OUT/install.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
G1=$(( NGPU > 1 ? 1 : 0 ))
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
# The services' wheels the image lacks (tools/device_wheels.sh -> .whl/), beside the image's packages.
device_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
}
# Issue 37's RL job: 20 steps through `zerokl up --dtype bfloat16`, then the same job in process; $1: time limit
rl_job() {
  timeout "$1" python3 tools/bench/bench_rl_step.py --job "$FINAL_OUT/rl-job.json" --device cuda \
    --dtype bfloat16 --preset small --prompts 64 --group 8 --steps 20 --half-time ${HALF_TIME:-90} \
    > "$FINAL_OUT/rl-job.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)" ; sleep 2     # a fleet a time limit left behind
}
if [ "$MODE" = zerokl ]; then
  ls .whl/*.whl > /dev/null 2>&1 && device_wheels
  timeout 150 python3 tools/update_golden.py --backends triton > "$OUT/golden.log" 2>&1
  cp tests/assets/golden/numerics.json "$FINAL_OUT/numerics.json"
  timeout 120 python3 -m zerokl verify --backend triton --quiet > "$OUT/verify.log" 2>&1
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -s tests/services/test_zero_kl_promise.py \
    tests/services/trainer/test_trainer_device.py tests/kernels/test_ties_and_sampling.py tests/kernels/test_golden.py \
    -k 'cuda or gpu or golden' > "$OUT/zerokl_tests.log" 2>&1
  timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels tests/model -k 'triton or gpu' \
    > "$OUT/gputests.log" 2>&1
elif [ "$MODE" = wave4-check ]; then
  # numerics 0.3.3's Triton entries (bf16/FP8 re-recorded after Model.to kept router fp32), the golden and
  # zero-KL tests on CUDA; the official tinker SDK's RL (LoRA) and SFT (full) loops against `zerokl up
  # --tinker --preset small --dtype bfloat16` (issue 48); the record bench, deltas vs whole files (issue 49)
  device_wheels
  timeout 150 python3 tools/update_golden.py --backends triton > "$OUT/golden.log" 2>&1
  cp tests/assets/golden/numerics.json "$FINAL_OUT/numerics.json"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_golden.py \
    tests/services/test_zero_kl_promise.py -k 'cuda or gpu or golden' > "$OUT/golden_tests.log" 2>&1
  timeout 220 python3 tools/tinker_sdk_check.py --up --preset small --dtype bfloat16 --steps 5 --max-tokens 64 \
    > "$FINAL_OUT/tinker-small-bf16.json" 2> "$OUT/tinker.log"; echo "tinker_sdk_check rc=$?" >> "$OUT/tinker.log"
  pkill -f -- "-m zerokl (up|serve)"; sleep 1
  for kind in deltas whole; do
    flag=""; [ $kind = whole ] && flag=--no-delta
    timeout 110 python3 tools/bench/bench_record.py --device cuda --preset small --steps 6 $flag --out "$FINAL_OUT/record-$kind.json" \
      > "$OUT/record-$kind.log" 2>&1
  done
elif [ "$MODE" = wave4-final ]; then
  # one call: the tinker SDK on small bf16 (issue 48), then issue 49's RL job at the 24-token shape
  device_wheels
  timeout 200 python3 tools/tinker_sdk_check.py --up --preset small --dtype bfloat16 --steps 3 --max-tokens 64 \
    > "$FINAL_OUT/tinker-small-bf16.json" 2> "$OUT/tinker.log"; echo "tinker_sdk_check rc=$?" >> "$OUT/tinker.log"
  pkill -f -- "-m zerokl (up|serve)"; sleep 1
  timeout 340 python3 tools/bench/bench_rl_step.py --job "$FINAL_OUT/rl-job-24.json" --device cuda --dtype bfloat16 \
    --preset small --prompts 64 --group 8 --steps 20 --reward vowel_share --half-time 90 --lr 1e-5 \
    > "$OUT/rl-job.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)"; sleep 1
elif [ "$MODE" = wave4-rl ]; then
  # issue 49's RL job through `zerokl up` vs in process: RL_MAX_TOKENS answers (24: the old shape; 1024 with
  # --ignore-eos: RL-shaped), RL_HALF_TIME seconds a half, RL_DELTAS previous/start/off
  device_wheels
  long=""; [ "${RL_MAX_TOKENS:-24}" -gt 24 ] && long="--ignore-eos --num-blocks 36864 --max-num-batched-tokens 8192"
  timeout 560 python3 tools/bench/bench_rl_step.py --job "$FINAL_OUT/rl-job.json" --device cuda --dtype bfloat16 \
    --preset small --prompts 64 --group 8 --steps 20 --max-tokens "${RL_MAX_TOKENS:-24}" --reward vowel_share $long \
    --half-time "${RL_HALF_TIME:-120}" --lr 1e-5 --record-deltas "${RL_DELTAS:-previous}" > "$OUT/rl-job.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)"; sleep 1
elif [ "$MODE" = wave5 ]; then
  # issue 49, wave 5: the CUDA tests of co-location (sleep / wake, the offloaded optimizer) and the RL job through
  # `zerokl up` vs in process with superseded records and the record process (RL_MAX_TOKENS, RL_HALF_TIME,
  # RL_PROMPTS as wave4-rl; RL_TESTS=0 skips the tests; RL_MICRO: packed tokens per micro-batch, 0 = whole batch;
  # RL_CKPT=0: long answers without activation checkpointing; RL_HALF=service, then RL_HALF=in-process in the next
  # call on the same warm machine: one half a call, the job's workdir and JSON kept in /tmp/rl-job-keep)
  device_wheels
  if [ "${RL_TESTS:-1}" = 1 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/services/engine/test_sleep.py \
      tests/services/trainer/test_offload_optimizer.py -k cuda > "$OUT/colocate_tests.log" 2>&1
  fi
  long=""; [ "${RL_MAX_TOKENS:-24}" -gt 24 ] && long="--ignore-eos --num-blocks 36864 --max-num-batched-tokens 8192"
  [ "${RL_MAX_TOKENS:-24}" -gt 24 ] && [ "${RL_CKPT:-1}" = 1 ] && long="$long --activation-checkpointing"
  job="$FINAL_OUT/rl-job.json"; half=""
  if [ -n "${RL_HALF:-}" ]; then
    [ "$RL_HALF" = service ] && rm -rf /tmp/rl-job-keep     # a fresh job: its fleet's workdir from nothing
    mkdir -p /tmp/rl-job-keep; job=/tmp/rl-job-keep/rl-job.json
    half="--half $RL_HALF --job-workdir /tmp/rl-job-keep/w"
  fi
  timeout "${RL_TIMEOUT:-420}" python3 tools/bench/bench_rl_step.py --job "$job" $half --device cuda \
    --dtype bfloat16 --preset small --prompts "${RL_PROMPTS:-64}" --group 8 --steps 20 --max-tokens "${RL_MAX_TOKENS:-24}" \
    --micro-batch-tokens "${RL_MICRO:-0}" --reward vowel_share $long --half-time "${RL_HALF_TIME:-120}" --lr 1e-5 --record-deltas "${RL_DELTAS:-previous}" \
    > "$OUT/rl-job.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)"; sleep 1
  [ -n "${RL_HALF:-}" ] && cp /tmp/rl-job-keep/rl-job.json /tmp/rl-job-keep/rl-job.png "$FINAL_OUT"/ 2> /dev/null
elif [ "$MODE" = colocate ] || [ "$MODE" = rl20 ] || [ "$MODE" = poll ]; then
  # issue 49's runs longer than a call, each in a session of its own that outlives the call (the machine stays
  # warm 30 s between calls): `poll`, the next call, waits on it again (BG_WAIT seconds a call) and brings back
  # its JSON, PNG and log. colocate: the CUDA sleep and shared-memory release tests and the sleep probe
  # (COLOCATE_TESTS=0 skips them; ZEROKL_CUDA_MEMORY_HISTORY=1 in the caller's environment reaches the trainer), then the GLM-5
  # 2-layer slice's RL job through `zerokl up --colocate` on this GPU (bench_colocate.py, COLOCATE_ARGS added).
  # rl20: the 20-step RL job of 512 answers of 1,024 tokens, through `zerokl up` and then in process (about 11
  # minutes a half on an H100: three calls).
  device_wheels
  keep=/tmp/bg-keep
  if [ "$MODE" != poll ]; then
    rm -rf "$keep"; mkdir -p "$keep"
    df -h /tmp | tail -1; free -g | head -2
  fi
  if [ "$MODE" = colocate ]; then
    if [ "${COLOCATE_TESTS:-1}" = 1 ]; then
      timeout 180 python3 -m pytest -q -p no:cacheprovider -rs tests/services/engine/test_sleep.py \
        tests/services/weightstore/test_sync.py tests/services/trainer/test_offload_optimizer.py tests/services/trainer/test_host_memory.py \
        -k "cuda and not bit_for_bit" > "$OUT/sleep_tests.log" 2>&1
      tail -n 4 "$OUT/sleep_tests.log"
      timeout 60 python3 tools/bench/sleep_probe.py > "$OUT/sleep_probe.log" 2>&1
    fi
    rm -rf /tmp/bench-colocate-glm5-2l
    setsid python3 tools/bench/bench_colocate.py ${COLOCATE_ARGS:-} --out "$keep/colocate.json" \
      > "$keep/bench.log" 2>&1 < /dev/null &
  elif [ "$MODE" = rl20 ]; then
    setsid python3 tools/bench/bench_rl_step.py --job "$keep/rl-job.json" --device cuda --dtype bfloat16 \
      --preset small --prompts 64 --group 8 --steps 20 --max-tokens 1024 --ignore-eos --num-blocks 36864 \
      --max-num-batched-tokens 8192 --micro-batch-tokens 32768 --reward vowel_share --half-time 100000 --lr 1e-5 \
      > "$keep/bench.log" 2>&1 < /dev/null &
  fi
  sleep 2
  end=$(( SECONDS + ${BG_WAIT:-420} ))
  while [ $SECONDS -lt $end ] && pgrep -f "tools/bench/bench_(colocate|rl_step).py" > /dev/null; do
    sleep 5; cp "$keep"/*.json "$keep"/*.png "$keep"/bench.log "$FINAL_OUT"/ 2> /dev/null
  done
  pgrep -f "tools/bench/bench_(colocate|rl_step).py" > /dev/null && echo "still running: call again with MODE=poll" \
    || echo "the bench ended"
  cp "$keep"/*.json "$keep"/*.png "$FINAL_OUT"/ 2> /dev/null; cp "$keep/bench.log" "$OUT/bench.log"
  tail -n 60 /tmp/bench-colocate-glm5-2l/up.log > "$OUT/colocate_up.log" 2> /dev/null
  for svc in trainer decode-0 scheduler weight-store; do     # where a failed step says why (tracebacks)
    log="/tmp/bench-colocate-glm5-2l/fleet/logs/$svc.log"
    # asyncio's "Task exception was never retrieved" floods (grpc's aclose() race, 50k of them at 414ff8e) hide the
    # rest: they are counted, not kept; then the log's first ERROR/Traceback lines and its tail
    { echo "asyncio task-exception lines dropped: $(grep -c 'Task exception was never retrieved' "$log" 2> /dev/null)"
      grep -v "Task exception was never retrieved\|^future: <Task\|^RuntimeError: aclose" "$log" 2> /dev/null \
        | grep -n -m 40 -A 12 "ERROR\|Traceback\|failed" ; echo "--- tail"
      grep -v "Task exception was never retrieved\|^future: <Task\|^RuntimeError: aclose" "$log" 2> /dev/null | tail -n 80
    } > "$OUT/colocate_$svc.log"
  done
  # what the trainer did with its device memory: each closed export (freed, IPC count, holders), each wait
  grep -h "closed the export\|waited\|recorded\|device memory at" /tmp/bench-colocate-glm5-2l/fleet/logs/trainer.log \
    2> /dev/null | cut -c1-400 | tail -n 20
  # what it held on the device after each share (a replica wakes into the rest), with the full report where the
  # allocator held more than the parameters and the exports
  grep -h -A16 "device memory after" /tmp/bench-colocate-glm5-2l/fleet/logs/trainer.log \
    2> /dev/null | cut -c1-300 | head -n 60 > "$OUT/colocate_trainer_memory.log"
  df -h /tmp | tail -1
elif [ "$MODE" = fp8-train ]; then
  # issue 51: the FP8 step from CUDA graphs == eager, bit for bit (and FP8 trainer == engine), the offloaded
  # optimizer's row slices == the on-device step on CUDA, then bench_fp8_serve's trainer part (bf16 vs FP8 step,
  # the re-quantization on the kernel vs the torch ops)
  device_wheels
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/services/trainer/test_fp8_trainer.py \
    tests/services/trainer/test_offload_optimizer.py -k cuda > "$OUT/fp8_tests.log" 2>&1
  tail -n 3 "$OUT/fp8_tests.log"
  timeout 150 python3 tools/bench/bench_fp8_serve.py --parts train --json "$FINAL_OUT/fp8-train.json" \
    > "$OUT/fp8-train.log" 2>&1
  tail -n 3 "$OUT/fp8-train.log"
elif [ "$MODE" = fp8-sweep ]; then
  # issue 50: the FP8 GEMM's tile configs. bench_fp8 --sweep first (every candidate beside cuBLASLt at each
  # shape x M, its bits checked on every case), its log straight to $FINAL_OUT so a cut-off call keeps what
  # ran; then the GPU tests that every config gives the canonical config's bits (and the FP8 goldens)
  timeout ${SWEEP_LIMIT:-330} python3 tools/bench/bench_fp8.py --sweep --ms ${FP8_MS:-1 64 2048 8192} \
    --json "$FINAL_OUT/fp8-sweep.json" > "$FINAL_OUT/fp8-sweep.log" 2>&1
  grep -A40 "^per (N, K, M)" "$FINAL_OUT/fp8-sweep.log" || tail -n 40 "$FINAL_OUT/fp8-sweep.log"
  timeout ${TESTS_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fp8_configs.py tests/kernels/test_fp8.py \
    tests/kernels/test_golden.py -k "fp8 or golden or config" > "$OUT/fp8_config_tests.log" 2>&1
  tail -n 3 "$OUT/fp8_config_tests.log"
elif [ "$MODE" = fp8-grouped ]; then
  # issue 50: the MoE experts' grouped FP8 GEMM tile configs (bench_fp8 --sweep-grouped: every pointer-load candidate
  # at the GLM-5 experts' shapes x tokens, bits against the table's config, time against the HBM bound), then the
  # GPU tests of the FP8 configs and goldens
  timeout ${SWEEP_LIMIT:-330} python3 tools/bench/bench_fp8.py --sweep-grouped --json "$FINAL_OUT/fp8-grouped.json" \
    > "$FINAL_OUT/fp8-grouped.log" 2>&1
  grep -A12 "^per (G, N, K, tokens)" "$FINAL_OUT/fp8-grouped.log" || tail -n 40 "$FINAL_OUT/fp8-grouped.log"
  timeout ${TESTS_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fp8_configs.py tests/kernels/test_fp8.py \
    tests/kernels/test_golden.py -k "fp8 or golden or config" > "$OUT/fp8_config_tests.log" 2>&1
  tail -n 3 "$OUT/fp8_config_tests.log"
elif [ "$MODE" = numerics3 ]; then
  # numerics 0.3.2: the Triton entries recorded under it (update_golden refuses changed fp32/bf16 bits
  # under an unchanged version, so it also checks them) with the FP8 key, the FP8 and golden tests on
  # CUDA, the FP8 GEMM bench; meanwhile, on the host CPU, the code-path test under eight xdist workers
  # with this tree's torch_ops, then (when .carry/torch_ops_ea27dcc.py is carried) with ea27dcc's torch.sqrt
  lscpu | grep -E "Model name|Vendor ID" > "$OUT/cpu.log"
  cp -r . /tmp/cputree && (
    cd /tmp/cputree
    for tree in new old; do
      if [ $tree = old ]; then [ -f .carry/torch_ops_ea27dcc.py ] || break; cp .carry/torch_ops_ea27dcc.py kernels/zerokl/kernels/torch_ops.py; fi
      CUDA_VISIBLE_DEVICES= ZEROKL_BACKEND=torch timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
        tests/kernels/test_stock_torch.py tests/kernels/test_portable_check.py tests/kernels/test_invariance.py \
        -k "torch or code_path or portable or primitive" > "$OUT/cpupath-$tree.log" 2>&1
    done ) &
  timeout 120 python3 tools/update_golden.py --backends triton > "$OUT/golden.log" 2>&1
  cp tests/assets/golden/numerics.json "$FINAL_OUT/numerics.json"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fp8.py tests/kernels/test_golden.py \
    tests/kernels/model/test_fp8_model.py tests/kernels/model/test_parity.py -k "fp8 or golden" > "$OUT/fp8tests.log" 2>&1
  timeout 100 python3 tools/bench/bench_fp8.py --json "$FINAL_OUT/fp8-linear.json" > "$OUT/fp8bench.log" 2>&1
  wait
elif [ "$MODE" = wave3-a ]; then
  # issues 37 and 32 through the product, then the GPU tests of the product path: the 20-step RL job through
  # `zerokl up --dtype bfloat16` beside the same job in process; serving (engine / replica / scheduler,
  # start-up cold and warm, every result == alone); zerokl up on CUDA, the bf16 fleet's RL job, in-place sync.
  # Logs straight to $FINAL_OUT, so a cut-off call still brings back what ran.
  device_wheels
  rl_job ${RL_LIMIT:-240}
  timeout ${SERVING_LIMIT:-190} python3 tools/bench/bench_serving.py --preset small --dtype bfloat16 \
    --out "$FINAL_OUT/serving.json" > "$FINAL_OUT/serving.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)" ; sleep 2
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-160} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 6 --dist load --durations=10 tests/services/routing/test_up_gpu.py tests/services/jobs/test_jobs_bf16.py \
    tests/services/inference/test_weight_sync.py > "$FINAL_OUT/gputests-a.log" 2>&1
elif [ "$MODE" = wave3-b ]; then
  # issue 33's rollout shapes (overlap on and off, compiles after warm-up, decode at 64 vs 2,048 context),
  # issue 35's FP8 serving and trainer ratios, then the engine's GPU tests (long contexts, graphs, overlap,
  # warm-up) and the zero-KL promise on the device
  device_wheels
  timeout ${ROLLOUT_LIMIT:-270} python3 tools/bench/bench_rollout.py --parts cases,scaling \
    --cases small:64x1024x512,small:256x1024x1024 --json "$FINAL_OUT/rollout.json" > "$FINAL_OUT/rollout.log" 2>&1
  timeout ${FP8_LIMIT:-200} python3 tools/bench/bench_fp8_serve.py --json "$FINAL_OUT/fp8-serve.json" \
    > "$FINAL_OUT/fp8-serve.log" 2>&1
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-110} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 6 --dist loadfile --durations=10 tests/services/engine tests/services/test_zero_kl_promise.py \
    > "$FINAL_OUT/gputests-b.log" 2>&1
elif [ "$MODE" = wave3-d ]; then
  # issue 33's rollout shapes (overlap on and off) and target 4's count of compiles after start-up over
  # mixed-length traffic
  timeout ${ROLLOUT_LIMIT:-230} python3 tools/bench/bench_rollout.py --parts cases,scaling \
    --cases small:64x1024x512,small:256x1024x1024 --json "$FINAL_OUT/rollout.json" > "$FINAL_OUT/rollout.log" 2>&1
  timeout ${MIXED_LIMIT:-190} python3 tools/bench/bench_rollout.py --parts mixed --cases small:1x1x1 \
    --mixed-seconds ${MIXED_SECONDS:-140} --json "$FINAL_OUT/mixed.json" > "$FINAL_OUT/mixed.log" 2>&1
elif [ "$MODE" = wave3-e ]; then
  # issue 34's CUDA-graph step (TrainConfig.cuda_graphs, on by default on CUDA): its GPU tests (replay ==
  # eager bit for bit; trainer == engine, KL 0; the RL job through the services), the training bench
  # (eager, graphs, transformers, same call), then the RL step in process (target 4)
  device_wheels
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-200} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 4 --dist loadfile --durations=10 tests/services/trainer/test_step_graphs.py \
    tests/services/trainer/test_trainer_fast_path.py tests/services/trainer/test_trainer_device.py \
    tests/services/test_zero_kl_promise.py tests/services/jobs/test_jobs_bf16.py > "$FINAL_OUT/gputests-e.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)" ; sleep 1
  timeout ${TRAIN_LIMIT:-120} python3 tools/bench/bench_train.py --parts small --backends triton --steps 7 \
    --out "$FINAL_OUT/train" > "$FINAL_OUT/train.log" 2>&1
  timeout ${RL_LIMIT:-120} python3 tools/bench/bench_rl_step.py --device cuda --dtype bfloat16 --preset small \
    --prompts 64 --group 8 --steps 6 --out "$FINAL_OUT/rl" > "$FINAL_OUT/rl-step.log" 2>&1
elif [ "$MODE" = wave3-g ]; then
  # issue 34 after the graph-key fix: the step-graph GPU tests and the trainer's device tests, then the bench
  device_wheels
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-120} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 2 --dist loadfile --durations=10 tests/services/trainer/test_step_graphs.py \
    tests/services/trainer/test_trainer_device.py > "$FINAL_OUT/gputests-g.log" 2>&1
  timeout ${TRAIN_LIMIT:-130} python3 tools/bench/bench_train.py --parts small --backends triton --steps 9 \
    --out "$FINAL_OUT/train" > "$FINAL_OUT/train.log" 2>&1
elif [ "$MODE" = wave3-h ]; then
  # issue 34's targets 2, 3 and 4: the GLM-5 slice at 4 x 4,096 and one 16,384-token sequence, each warmed
  # up and one step profiled; then the RL step in process beside SFT at its token count (graphs on)
  timeout ${SLICE_LIMIT:-330} python3 tools/bench/bench_train.py --parts slice,long --steps 3 \
    --profile slice/zerokl/triton,long/zerokl/triton --out "$FINAL_OUT/train-slice" > "$FINAL_OUT/train-slice.log" 2>&1
  timeout ${RL_LIMIT:-200} python3 tools/bench/bench_train.py --parts rl --steps 5 --rl-steps 10 \
    --out "$FINAL_OUT/train-rl" > "$FINAL_OUT/train-rl.log" 2>&1
elif [ "$MODE" = wave3-i ]; then
  # issue 34 with packed training batches: the trainer's GPU tests, the RL step beside SFT (target 4),
  # then `small` (eager arm profiled by Python function, graphs, transformers)
  device_wheels
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-150} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 3 --dist loadfile --durations=10 tests/services/trainer/test_step_graphs.py \
    tests/services/trainer/test_trainer_fast_path.py tests/services/trainer/test_trainer_device.py \
    tests/services/test_zero_kl_promise.py > "$FINAL_OUT/gputests-i.log" 2>&1
  timeout ${RL_LIMIT:-150} python3 tools/bench/bench_train.py --parts rl --steps 5 --rl-steps 10 \
    --out "$FINAL_OUT/train-rl" > "$FINAL_OUT/train-rl.log" 2>&1
  timeout ${TRAIN_LIMIT:-150} python3 tools/bench/bench_train.py --parts small --backends triton --steps 7 \
    --profile small/zerokl/triton --out "$FINAL_OUT/train" > "$FINAL_OUT/train.log" 2>&1
elif [ "$MODE" = wave3-j ]; then
  # issue 34's key-list dkv: the attention backward's and the model's GPU tests, then the slice and the
  # 16k sequence (the long step profiled)
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-150} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 3 --dist loadfile --durations=10 tests/kernels/test_attention_backward.py \
    tests/kernels/model/test_model.py tests/services/trainer/test_step_graphs.py > "$FINAL_OUT/gputests-j.log" 2>&1
  timeout ${SLICE_LIMIT:-300} python3 tools/bench/bench_train.py --parts slice,long --steps 3 \
    --profile long/zerokl/triton --out "$FINAL_OUT/train-slice" > "$FINAL_OUT/train-slice.log" 2>&1
elif [ "$MODE" = wave3-k ]; then
  # issue 34's own backward kernels for the glue (rms_norm, rope, SwiGLU, split_linear, MoE combine, the head's logits): their GPU tests,
  # `small` (eager arm profiled, graphs, transformers), then the slice (profiled) and the 16k sequence
  # with activation checkpointing on and off, then the RL step beside SFT
  device_wheels
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rs \
    -n 4 --dist loadfile tests/kernels/test_own_backward.py tests/kernels/test_logprob.py tests/kernels/test_moe.py \
    tests/kernels/model/test_model.py tests/services/trainer/test_step_graphs.py \
    tests/services/trainer/test_trainer_fast_path.py tests/services/test_zero_kl_promise.py \
    > "$FINAL_OUT/gputests-k.log" 2>&1
  pkill -f -- "-m zerokl (up|serve)" ; sleep 1
  timeout ${TRAIN_LIMIT:-130} python3 tools/bench/bench_train.py --parts small --backends triton --steps 7 \
    --profile small/zerokl/triton --out "$FINAL_OUT/train" > "$FINAL_OUT/train.log" 2>&1
  timeout ${SLICE_LIMIT:-330} python3 tools/bench/bench_train.py --parts slice,long --steps 3 \
    --profile slice/zerokl/triton --out "$FINAL_OUT/train-slice" > "$FINAL_OUT/train-slice.log" 2>&1
  timeout ${RL_LIMIT:-150} python3 tools/bench/bench_train.py --parts rl --steps 5 --rl-steps 10 \
    --out "$FINAL_OUT/train-rl" > "$FINAL_OUT/train-rl.log" 2>&1
elif [ "$MODE" = wave3-c ]; then
  # what wave3-a's time limits cut, and issue 35's FP8 serving: the 20-step RL job (both halves), the
  # engine's GPU tests (long contexts, graphs, overlap, warm-up), then the FP8 serving / trainer bench
  device_wheels
  rl_job ${RL_LIMIT:-240}
  TRITON_CACHE_DIR=$PWD/.gpu/triton-cache timeout ${TESTS_LIMIT:-100} python3 -m pytest -v -p no:cacheprovider -rs \
    -m gpu -n 4 --dist loadfile --durations=10 tests/services/engine > "$FINAL_OUT/gputests-c.log" 2>&1
  timeout ${FP8_LIMIT:-200} python3 tools/bench/bench_fp8_serve.py --json "$FINAL_OUT/fp8-serve.json" \
    > "$FINAL_OUT/fp8-serve.log" 2>&1
elif [ "$MODE" = wave3-fp8 ]; then
  # issue 35's proof run: the two FP8 arms on `small`, 100 steps from the bf16 run's SFT recipe (docs/rl.md),
  # one command; beside it (timings not taken) the whole GPU test tier on the same device
  device_wheels
  ( OUT=$OUT timeout 560 bash tools/gpu_tier.sh all > "$OUT/gputier.log" 2>&1 ) &
  TRITON_CACHE_DIR=$PWD/runs/triton-cache timeout 580 python3 -m zerokl experiment countdown --preset small \
    --difficulty demo --lr 1e-05 --arms zerokl-fp8,mismatch-fp8 --steps 100 --device cuda --dtype bfloat16 \
    --prompts 64 --group 8 --eval-every 10 --eval-prompts 128 --max-num-seqs 512 --max-num-batched-tokens 8192 \
    --num-blocks 4096 --checkpoint-every 0 --state-dir runs/gpu-state --processes 2 --out runs/gpu-fp8 \
    --max-minutes 9.0 > "$OUT/fp8-arms.log" 2>&1
  tar -C runs -czf "$FINAL_OUT/gpu-fp8.tgz" gpu-fp8
  wait
elif [ "$MODE" = map ]; then
  # issue 53's map: each cell of `zerokl experiment countdown --grid` (MAP_CELLS: names, comma-separated, or
  # short (default: the 8 short-answer cells), trace, all) run by its documented command (the grid's scale,
  # experiment.GPU_SCALE) with these overrides: MAP_STEPS (50), MAP_SEEDS (0; 0,1,2: three RL seeds), MAP_PRESET
  # (small), MAP_PROMPTS (16 prompts x 8 a step), MAP_ARMS (all: the cell's pair and its corrections; pair: zerokl
  # and the mismatched arm only), MAP_DEVICE (cuda), MAP_DTYPE (bfloat16), MAP_EXTRA (more flags; the last value
  # of a flag wins). MAP_PARALLEL cells at once (3), each with every unit (arm x seed) in its own process, all
  # inside MAP_BUDGET_S seconds from the script's start (540): a cell gets --max-minutes of what is left when it
  # starts, and none starts with less than MAP_MIN_CELL_S (75) left. Each finished cell re-renders the map
  # (`zerokl experiment countdown --map`) and re-packs $OUT/map.tgz (every cell's report, metrics.jsonl, plot,
  # run.json, log; map.md, map.png, map-telemetry.png, also copied beside it), so a cut-off call still brings
  # back every cell done. State (SFT warm start, problems, unfinished arms' checkpoints) stays in MAP_STATE
  # (runs/map-state): on a warm machine the same command continues unfinished cells and answers finished ones
  # from their records; a finished cell's checkpoints (~3 GB an arm for `small`) are deleted unless MAP_KEEP_CKPT=1.
  ls .whl/*.whl > /dev/null 2>&1 && device_wheels
  MAP_BUDGET_S=${MAP_BUDGET_S:-540}; MAP_MIN_CELL_S=${MAP_MIN_CELL_S:-75}; MAP_PARALLEL=${MAP_PARALLEL:-3}
  MAP_DIR=${MAP_DIR:-runs/map}; MAP_STATE=${MAP_STATE:-runs/map-state}; MAP_STEPS=${MAP_STEPS:-50}
  mkdir -p "$MAP_DIR" "$MAP_STATE"
  cp -n .gpu/problems/problems-*.json "$MAP_STATE"/ 2> /dev/null
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/runs/triton-cache} TQDM_MININTERVAL=30
  # One line per cell: NAME, its units (arms x seeds: its processes), then its command's flags.
  python3 - > "$OUT/map-cells.txt" <<'PY' || exit 3
import os, shlex
from zerokl.experiment import CELLS, GPU_SCALE, GPU_TRACE_SCALE
pick = os.environ.get("MAP_CELLS", "short")
names = {"short": [c for c in CELLS if "trace" not in c], "trace": [c for c in CELLS if "trace" in c],
         "all": list(CELLS)}.get(pick) or pick.split(",")
seeds = os.environ.get("MAP_SEEDS", "0")
for name in names:
    flags = CELLS[name][1]          # a KeyError names a cell that does not exist
    arms = flags[flags.index("--arms") + 1].split(",")
    arms = arms[:2] if os.environ.get("MAP_ARMS", "all") == "pair" else arms
    units = len(arms) * len(seeds.split(","))
    scale = GPU_SCALE + (GPU_TRACE_SCALE if "trace" in flags else [])
    own = ["--steps", os.environ.get("MAP_STEPS", "50"), "--seeds", seeds, "--preset", os.environ.get("MAP_PRESET", "small"),
           "--prompts", os.environ.get("MAP_PROMPTS", "16"), "--device", os.environ.get("MAP_DEVICE", "cuda"),
           "--dtype", os.environ.get("MAP_DTYPE", "bfloat16"), "--arms", ",".join(arms), "--processes", str(units)]
    print(name, units, shlex.join(["--cell", name, *scale, *own, *shlex.split(os.environ.get("MAP_EXTRA", ""))]))
PY
  # Step lines every 10th step and the last, SFT evaluations, each cell's end and any error reach stdout.
  MAP_SHOW=" step +([0-9]*0|$MAP_STEPS)/$MAP_STEPS |^SFT step|complete;|INCOMPLETE|failed|Error|Traceback"
  map_cell() {  # NAME FLAGS...: the cell's documented command with what is left of the budget
    local cell=$1; shift
    local left=$(( MAP_BUDGET_S - 20 - SECONDS ))
    echo "== $cell: $left s left, $(date -u +%FT%TZ)"
    timeout -k 15 $(( left + 45 )) python3 -m zerokl experiment countdown "$@" --out "$MAP_DIR/$cell" \
      --state-dir "$MAP_STATE" --max-minutes "$(python3 -c "print(f'{$left / 60:.3f}')")" 2>&1 \
      | tee "$MAP_DIR/$cell.log" | grep --line-buffered -E "$MAP_SHOW" | sed -u "s/^/[$cell] /"
    echo "== $cell: exit ${PIPESTATUS[0]} at ${SECONDS} s"
  }
  map_pack() {  # the map of every cell done so far, packed; a finished cell's checkpoints deleted
    local cell
    for cell in $(cut -d' ' -f1 "$OUT/map-cells.txt"); do
      if [ "${MAP_KEEP_CKPT:-0}" != 1 ] && grep -qs '"complete": true' "$MAP_DIR/$cell/run.json"; then
        rm -f "$MAP_STATE/cells/$cell"/*.pt
      fi
    done
    python3 -m zerokl experiment countdown --map "$MAP_DIR" > "$OUT/map-render.log" 2>&1
    cp "$MAP_DIR"/map.md "$MAP_DIR"/map.png "$MAP_DIR"/map-telemetry.png "$FINAL_OUT"/ 2> /dev/null
    tar -czf "$FINAL_OUT/map.tgz.tmp" -C "$(dirname "$MAP_DIR")" "$(basename "$MAP_DIR")" \
      && mv "$FINAL_OUT/map.tgz.tmp" "$FINAL_OUT/map.tgz"
    echo "== packed $(ls "$MAP_DIR"/*/metrics.jsonl 2> /dev/null | wc -l) cell(s) at ${SECONDS} s: $(du -h "$FINAL_OUT/map.tgz" | cut -f1)"
  }
  {
    while read -r cell units flags; do
      while [ "$(jobs -rp | wc -l)" -ge "$MAP_PARALLEL" ]; do wait -n; map_pack; done
      if [ $(( MAP_BUDGET_S - 20 - SECONDS )) -lt "$MAP_MIN_CELL_S" ]; then echo "== $cell: not started (budget)"; continue; fi
      eval "map_cell $cell $flags" &
      sleep 2
    done < "$OUT/map-cells.txt"
    while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; map_pack; done
    map_pack
  } 2>&1 | tee "$OUT/map.log"
  sed -n '/^| cell | arm (vs/,/^$/p' "$MAP_DIR/map.md"
elif [ "$MODE" = wave2 ]; then
  # issues 17 and 22 in one call: golden vectors (compared with the previous version's cuda-sm90
  # digests when .gpu/golden-previous.json is carried), the GPU test tier, serving and trainer benches
  ls .whl/*.whl > /dev/null 2>&1 && device_wheels
  timeout 100 python3 tools/update_golden.py --backends triton > "$OUT/golden.log" 2>&1
  cp tests/assets/golden/numerics.json "$FINAL_OUT/numerics.json"
  [ -f .gpu/golden-previous.json ] && python3 -c 'import json; a = json.load(open(".gpu/golden-previous.json"))["entries"]; b = json.load(open("tests/assets/golden/numerics.json"))["entries"]; print({k: a[k]["digests"] == b[k]["digests"] for k in a if k.startswith("triton/cuda") and k in b})' >> "$OUT/golden.log" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/kernels/test_moe.py tests/kernels/test_attention_backward.py \
    tests/services/engine tests/services/trainer tests/services/test_zero_kl_promise.py > "$OUT/gputests.log" 2>&1
  timeout 170 python3 tools/bench/bench_serve.py --parts small,slice,prefill,busy,invariance --new-tokens 64 \
    --json "$FINAL_OUT/bench_serve.json" > "$OUT/serve.log" 2>&1
  timeout 120 python3 tools/bench/bench_train.py --parts small,slice --steps 2 --out "$FINAL_OUT/train" > "$OUT/train.log" 2>&1
else
  # issue 8's figures in one call (the GPU test tier: tools/gpu_tier.sh); the linear grid times
  # GPU work only (CUDA-graph replays), so it shares the host with e2e on the other GPU
  mkdir -p "$OUT/bench"
  ( CUDA_VISIBLE_DEVICES=0 timeout 160 python3 tools/bench/bench_linear.py --out "$OUT/bench" > "$OUT/linear.log" 2>&1;
    CUDA_VISIBLE_DEVICES=0 timeout 130 python3 tools/bench/bench_attn_moe.py --out "$OUT/bench" > "$OUT/attn.log" 2>&1 ) &
  ( CUDA_VISIBLE_DEVICES=$G1 timeout 290 python3 tools/bench/bench_e2e.py --out "$OUT/bench" > "$OUT/e2e.log" 2>&1 ) &
  wait
  [ "$NGPU" -gt 1 ] && timeout 220 torchrun --nproc-per-node="$NGPU" tools/bench/bench_tp.py --repeats 5 --out "$OUT/bench" > "$OUT/tp.log" 2>&1
fi
for f in "$OUT"/*.log; do echo "=== $f"; cat "$f"; done > "$FINAL_OUT/run.log"
tar -C "$OUT" -cf "$FINAL_OUT/results.tar" .
for f in "$OUT"/*.log; do echo "=== $f"; tail -n 40 "$f"; done
