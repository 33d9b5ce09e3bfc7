#!/usr/bin/env bash
# GPU check of tensor-parallel serving: `zerokl serve decode --tp 2` (NCCL, the p2p join) and a
# one-GPU replica of the same weights answer the same requests; their JSON (token ids, fp32
# logprobs, text, fingerprint) must be byte-identical apart from the request id.
#   bash tools/bench/check_serve_tp.sh [preset] [dtype]        # on a machine with >= 2 GPUs
set -u
PRESET=${1:-small}
DTYPE=${2:-bfloat16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
python3 -m zerokl serve decode --preset "$PRESET" --dtype "$DTYPE" --tp 2 --port 0 > "$WORK/tp2.log" 2>&1 &
TP2=$!
CUDA_VISIBLE_DEVICES=0 python3 -m zerokl serve decode --preset "$PRESET" --dtype "$DTYPE" --port 0 > "$WORK/tp1.log" 2>&1 &
TP1=$!
trap 'kill $TP2 $TP1 2>/dev/null; wait' EXIT
for log in "$WORK/tp2.log" "$WORK/tp1.log"; do
  for _ in $(seq 240); do grep -q "listening on" "$log" && break; sleep 0.5; done
  grep "listening on" "$log" || { echo "no server: $log"; cat "$log"; exit 1; }
done
addr() { grep -o "listening on [0-9.:]*" "$1" | awk '{print $3}'; }
A2=$(addr "$WORK/tp2.log"); A1=$(addr "$WORK/tp1.log")
status=0
for seed in 1 2 3 4; do
  args=(--prompt-ids "5,6,7,$((seed + 8)),9,10" --temperature 1 --seed "$seed" --max-tokens 32 --ignore-eos --n 2
        --request-id "check-$seed" --json)
  python3 -m zerokl generate --server "$A2" "${args[@]}" > "$WORK/tp2-$seed.json"
  python3 -m zerokl generate --server "$A1" "${args[@]}" > "$WORK/tp1-$seed.json"
  if cmp -s "$WORK/tp2-$seed.json" "$WORK/tp1-$seed.json"; then
    echo "seed $seed: TP=2 == TP=1 ($(head -c 120 "$WORK/tp2-$seed.json")...)"
  else
    echo "seed $seed: DIFFERENT"; diff <(tr ',' '\n' < "$WORK/tp2-$seed.json") <(tr ',' '\n' < "$WORK/tp1-$seed.json") | head
    status=1
  fi
done
exit $status
