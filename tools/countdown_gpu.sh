#!/bin/bash
# The countdown proof run (docs/rl/gpu/README.md): the sweep, then the three arms at the sweep's
# best point, in pieces. Run it again until it exits 0 (75: work left); state lives in runs/.
# Each piece stops by DEADLINE_MIN minutes after it starts and packs what exists into
# $OUTBACK/results.tgz (the report folders, the sweep, the logs, docs/rl.md).
# Env (defaults are the H200 run): DEVICE PRESETS DIFFS LRS SWEEP_STEPS STEPS PROMPTS SWEEP_PROCS ARM_PROCS
#   DEADLINE_MIN DTYPE OUTBACK EXTRA (flags appended to both commands; the last value of a flag wins)
# Problem sets may be pre-drawn into .gpu/problems (tools/draw_countdown_problems.py; the 4-number set
# takes ~8 CPU minutes).
set -u
T0=$(date +%s)
DEVICE=${DEVICE:-cuda}; PRESETS=${PRESETS:-small}; DIFFS=${DIFFS:-demo}; LRS=${LRS:-1e-5,3e-5,1e-4}
SWEEP_STEPS=${SWEEP_STEPS:-100}; STEPS=${STEPS:-100}; SWEEP_PROCS=${SWEEP_PROCS:-3}; PROMPTS=${PROMPTS:-64}; DEADLINE_MIN=${DEADLINE_MIN:-8.2}
DTYPE=${DTYPE:-bfloat16}; OUTBACK=${OUTBACK:-${OUT:-runs/gpu-back}}; EXTRA=${EXTRA:-}; ARM_PROCS=${ARM_PROCS:-3}
STATE=runs/gpu-state; RES=runs/gpu-out
mkdir -p $STATE $RES $OUTBACK
if [ -d .whl ]; then      # a machine without a package registry: carried wheels, then the package itself
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 3
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
fi
if [ "$DEVICE" = cuda ]; then
  export TRITON_CACHE_DIR=$PWD/runs/triton-cache
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
fi
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
cp -n .gpu/problems/problems-*.json $STATE/ 2>/dev/null || true
left() { python3 -c "import time; print(f'{max(0.0, $DEADLINE_MIN - (time.time() - $T0) / 60):.3f}')"; }
COMMON="--device $DEVICE --dtype $DTYPE --prompts $PROMPTS --group 8 --eval-every 10 --eval-prompts 128 \
 --max-num-seqs 512 --max-num-batched-tokens 8192 --num-blocks 4096 --checkpoint-every 0 --state-dir $STATE $EXTRA"
pack() {
  cp docs/rl.md $RES/rl.md 2>/dev/null
  tar czf $OUTBACK/results.tgz -C $RES . && cp $RES/gpu/experiment.png $OUTBACK/ 2>/dev/null
  du -sh $STATE 2>/dev/null; echo "driver wall $(( $(date +%s) - T0 )) s"
}
echo "== sweep $(date -u +%FT%TZ)"
python3 -m zerokl experiment countdown --sweep --steps $SWEEP_STEPS --sweep-presets $PRESETS \
  --sweep-difficulties $DIFFS --sweep-lrs $LRS $COMMON --processes $SWEEP_PROCS --out $RES/sweep \
  --max-minutes $(left) 2>&1 | tee -a $RES/sweep.log
rc=${PIPESTATUS[0]}; echo "sweep exit $rc"
if [ $rc -ne 0 ]; then pack; exit $rc; fi
if [ ! -f $STATE/choice.env ]; then
  python3 - $RES/sweep/sweep.jsonl > $STATE/choice.env <<'PY' || exit 5
import collections, json, math, re, sys
from zerokl.experiment import trend
points = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    points[r["point"]].append(r["reward"])
t = {p: trend(rs)["t"] for p, rs in points.items()}
# The documented rule: a point learns at t >= 2; of those (all one size here) the clearest rise.
best = max(points, key=lambda p: -math.inf if math.isnan(t[p]) else t[p])
preset, difficulty, lr = re.fullmatch(r"(.+?)-(.+?)-lr(.+)", best).groups()     # "small-demo-lr3e-05"
print(f"PRESET={preset} DIFF={difficulty} LR={float(lr)!r} # t={t[best]:.2f} of {sorted(t.items())}")
PY
fi
cat $STATE/choice.env; eval "$(cut -d'#' -f1 $STATE/choice.env)"
echo "== arms $(date -u +%FT%TZ)"
python3 -m zerokl experiment countdown --preset $PRESET --difficulty $DIFF --lr $LR \
  --arms zerokl,mismatch,mismatch-tis --steps $STEPS $COMMON --processes $ARM_PROCS --out $RES/gpu \
  --update-doc docs/rl.md --max-minutes $(left) 2>&1 | tee -a $RES/arms.log
rc=${PIPESTATUS[0]}; echo "arms exit $rc"
pack; exit $rc
