#!/usr/bin/env bash
# The two-GPU runs of train.parallel=fsdp2, in one call on a machine with 2 GPUs (nvidia-h200-x2):
#
#   bash scripts/two_gpu_fsdp2.sh [PART ...]      # parts: equal profile resume big ddp tests (default: all)
#
# Each part has a time limit and writes its log and JSON under $OUT (default outputs/two_gpu_fsdp2);
# a summary line per part goes to stdout. What each part shows:
#   equal    fsdp2 graph=full equals eager step for step on 2 GPUs (gpt_tiny and mnist, fp32 and bf16,
#            reshard_after_forward true and false: tests/test_fsdp_gpu.py under torchrun), and
#            GraphedStep with a user's own fully_shard model (scripts/own_loop.py --fsdp2, full vs eager)
#   profile  the 2-GPU fsdp2 graphed gpt2_small step: kernels per stream and the collectives' time
#            beside compute (profile_step.py --streams), eager beside it, and the 1-GPU step to compare
#   resume   a 2-GPU fsdp2 run stopped by SIGTERM resumes on 2 GPUs bit for bit, and on 1 GPU trains on
#   big      a GPT whose fp32 weights, gradients and AdamW state (16 B/parameter) exceed one H200:
#            9.9B parameters (48 x 4096) under fsdp2, eager and full as separate processes, 20 steps,
#            no checkpoints (checkpoint.save=false); the same under DDP must stop with one message
#   ddp      DDP against fsdp2 on gpt2_small at 2 GPUs: tokens/s and peak memory per GPU
#   tests    pytest -m gpu, whole, on 2 GPUs (the DDP checks owed since the buffer-broadcast refactor)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then  # the GPU machine has no package index: the wheels carried with the call (shared/gpu/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
OUT=${OUT:-outputs/two_gpu_fsdp2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TR="torchrun --standalone --nproc_per_node=2"
PARTS=${*:-equal profile resume big ddp tests}

say() { echo "=== $* ($(date +%T))"; }
results() {  # the numbers a results.json holds, one line
  python - "$@" <<'PY'
import glob, json, sys
for root in sys.argv[1:]:
    for path in sorted(glob.glob(f"{root}/**/results.json", recursive=True)):
        r = json.load(open(path))
        keys = ("mode", "world_size", "steps", "perf/step_ms_median", "perf/tokens_per_s", "perf/tokens_per_s_per_gpu",
                "perf/mfu_pct", "perf/peak_allocated_mib", "final/loss")
        print(root, {k: r.get(k) for k in keys})
PY
}

for part in $PARTS; do
  case $part in
  equal)
    say equal
    timeout 900 python -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_fsdp_gpu.py > "$OUT/equal_tests.log" 2>&1
    echo "tests/test_fsdp_gpu.py rc=$?"; grep -E "passed|failed" "$OUT/equal_tests.log" | tail -1
    for mode in eager full; do
      timeout 300 $TR scripts/own_loop.py --fsdp2 --mode $mode --steps 100 --output "$OUT/own_loop_$mode.json" \
        > "$OUT/own_loop_$mode.log" 2>&1; echo "own_loop --fsdp2 --mode $mode rc=$?"
    done
    python - "$OUT" <<'PY'
import json, sys
e, f = (json.load(open(f"{sys.argv[1]}/own_loop_{m}.json")) for m in ("eager", "full"))
worst = max(abs(a - b) / abs(a) for a, b in zip(e["losses"], f["losses"]))
print(f"own_loop --fsdp2 full vs eager: max relative loss difference {worst:.2e} over {len(e['losses'])} steps")
PY
    ;;
  profile)
    say profile
    for mode in full eager; do
      timeout 600 $TR scripts/profile_step.py recipe=gpt2_small train.parallel=fsdp2 graph=$mode --steps 20 --streams \
        --top 15 --output "$OUT/profile_2gpu_$mode.json" > "$OUT/profile_2gpu_$mode.log" 2>&1
      echo "profile 2 GPUs $mode rc=$?"; grep -E "step_ms|stream" "$OUT/profile_2gpu_$mode.log" | head -8
    done
    timeout 600 python scripts/profile_step.py recipe=gpt2_small train.parallel=fsdp2 graph=full --steps 20 \
      --output "$OUT/profile_1gpu_full.json" > "$OUT/profile_1gpu_full.log" 2>&1
    echo "profile 1 GPU full rc=$?"; grep step_ms "$OUT/profile_1gpu_full.log" | head -2
    ;;
  resume)
    say resume
    ARGS="recipe=gpt_tiny train.parallel=fsdp2 graph=full train.epochs=1 train.max_steps=400 checkpoint.every_steps=50
          logger=none train.progress=false"
    rm -rf "$OUT/resume" "$OUT/unbroken"
    timeout 600 $TR train.py $ARGS run_dir="$OUT/unbroken" > "$OUT/unbroken.log" 2>&1; echo "unbroken rc=$?"
    $TR train.py $ARGS run_dir="$OUT/resume" > "$OUT/stopped.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do [ -d "$OUT/resume/checkpoints/step_00000100.dcp" ] && break; sleep 0.5; done
    kill -TERM $pid; wait $pid; echo "stopped by SIGTERM rc=$?"; ls "$OUT/resume/checkpoints"
    timeout 600 $TR train.py $ARGS run_dir="$OUT/resume" > "$OUT/resumed.log" 2>&1; echo "resumed on 2 GPUs rc=$?"
    python - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/{d}/results.json")) for d in ("unbroken", "resume"))
print("resumed on 2 GPUs equals unbroken bit for bit:", a["param_digests"] == b["param_digests"], a["param_digests"])
PY
    timeout 600 python train.py $ARGS train.max_steps=450 run_dir="$OUT/resume" > "$OUT/resumed_1gpu.log" 2>&1
    echo "resumed on 1 GPU (to step 450) rc=$?"; grep -E "resumed from|reseeded|final/loss" "$OUT/resumed_1gpu.log"
    ;;
  big)
    say big
    BIG="recipe=gpt_1b recipe.model.n_layer=48 recipe.model.d_model=4096 recipe.model.n_head=32 recipe.data.batch_size=1
         train.max_steps=20 train.log_every=1 train.eval=false checkpoint.save=false logger=none train.progress=false"
    for mode in eager full; do
      timeout 1200 $TR train.py $BIG graph=$mode output_root="$OUT/big_$mode" > "$OUT/big_$mode.log" 2>&1
      echo "9.9B fsdp2 $mode rc=$?"; results "$OUT/big_$mode"
    done
    python - "$OUT" <<'PY'
import glob, json, sys
rows = {}
for mode in ("eager", "full"):
    path = glob.glob(f"{sys.argv[1]}/big_{mode}/**/metrics.jsonl", recursive=True)[0]
    rows[mode] = [r["train/loss"] for r in map(json.loads, open(path)) if "train/loss" in r]
worst = max(abs(a - b) / abs(a) for a, b in zip(rows["eager"], rows["full"]))
print(f"9.9B full vs eager: max relative loss difference {worst:.2e} over {len(rows['full'])} steps")
PY
    timeout 1200 $TR train.py $BIG train.parallel=ddp train.fsdp.init=host graph=full output_root="$OUT/big_ddp" \
      > "$OUT/big_ddp.log" 2>&1
    echo "9.9B under DDP rc=$? (expected: one 'out of GPU memory' line per rank)"; grep -c "out of GPU memory" "$OUT/big_ddp.log"
    ;;
  ddp)
    say ddp
    for parallel in ddp fsdp2; do
      timeout 600 $TR train.py recipe=gpt2_small train.parallel=$parallel graph=full train.max_steps=200 train.eval=false \
        logger=none train.progress=false output_root="$OUT/gpt2_$parallel" > "$OUT/gpt2_$parallel.log" 2>&1
      echo "gpt2_small $parallel rc=$?"; results "$OUT/gpt2_$parallel"
    done
    ;;
  tests)
    say tests
    timeout 1500 python -m pytest -q -p no:cacheprovider -m gpu -rf > "$OUT/gpu_tests.log" 2>&1
    echo "pytest -m gpu rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -15
    ;;
  *) echo "unknown part $part: equal profile resume big ddp tests"; exit 2 ;;
  esac
done
say done
