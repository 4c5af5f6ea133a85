#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu`) spread over every GPU of one machine: one pytest per test file, handed out
# from a queue to one worker per GPU, largest file first. Worker i sees two GPUs, i and a partner, so the
# tests that need 2 GPUs run too (a 1-GPU test uses the first it sees). docs/testing.md says more.
#
#   bash tests/gpu_suite.sh                        # every test file that has GPU tests
#   bash tests/gpu_suite.sh tests/test_fsdp_gpu.py # only these files
#
# Env: OUT (where the summary and logs go; default outputs/gpu_suite), DEADLINE (seconds after which no file
# starts; default 900; a file still running DEADLINE + 120 s after the start is stopped, rc=124), PYTEST_ARGS
# (more pytest arguments), WORKERS_PER_GPU (files run at once on each GPU; default 1: a one-GPU machine gets through
# more files with 2, as each spends much of its time starting processes and compiling on the CPU).
# Exit 1 when a file failed, was stopped or was not reached.
set -uo pipefail
cd "$(dirname "$0")/.."
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
[ "${gpus:-0}" -ge 1 ] || { echo "gpu_suite.sh: no CUDA GPU here (or no torch for python3); run it on a GPU machine"; exit 2; }
out=${OUT:-outputs/gpu_suite}; logs="$out/logs"; deadline=${DEADLINE:-900}
rm -rf "$logs"; mkdir -p "$logs"; queue=$(mktemp -d)
export PYTHONUNBUFFERED=1 WANDB_MODE=offline

if [ $# -gt 0 ]; then files=("$@"); else
  mapfile -t files < <(grep -lE "mark\.gpu" tests/test_*.py | xargs wc -l | grep -v ' total$' | sort -rn | awk '{print $2}')
fi
for i in "${!files[@]}"; do printf '%s\n' "${files[$i]}" > "$queue/$(printf %04d "$i")"; done
began=$SECONDS

run_queue() {  # $1: the GPUs this worker's pytest sees ("2,3")
  local job file name started
  for job in "$queue"/[0-9]*; do
    [[ $job == *.taken ]] && continue  # another worker's mark, made after that worker listed the queue
    mkdir "$job.taken" 2>/dev/null || continue  # atomic: one worker takes each file
    file=$(cat "$job"); name=$(basename "$file" .py)
    if [ $((SECONDS - began)) -gt "$deadline" ]; then echo "$name: NOT RUN (past DEADLINE=$deadline s)" > "$logs/$name.sum"; continue; fi
    started=$SECONDS
    CUDA_VISIBLE_DEVICES=$1 timeout $((deadline + 120 - (SECONDS - began))) \
      python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $PYTEST_ARGS "$file" > "$logs/$name.txt" 2>&1
    echo "$name: rc=$? $((SECONDS - started)) s on GPUs $1: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$logs/$name.txt" | tail -1)" \
      | tee "$logs/$name.sum"
  done
}

PYTEST_ARGS=${PYTEST_ARGS:-}; per_gpu=${WORKERS_PER_GPU:-1}
echo "gpu_suite.sh: ${#files[@]} files over $gpus GPU(s), $per_gpu at a time on each"
for ((w = 0; w < per_gpu; w++)); do
  for ((g = 0; g < gpus; g++)); do
    if [ "$gpus" -ge 2 ]; then partner=$(( (g ^ 1) < gpus ? (g ^ 1) : (g + 1) % gpus )); run_queue "$g,$partner" &
    else run_queue 0 & fi
  done
done
wait
{ cat "$logs"/*.sum; echo "---- failures"; grep -hE "^(FAILED|ERROR)" "$logs"/*.txt; grep -h "NOT RUN" "$logs"/*.sum
  echo "---- done in $((SECONDS - began)) s"; } > "$out/summary.txt"
sed -n '/^---- failures/,$p' "$out/summary.txt"
rm -rf "$queue"
! grep -qE "rc=[^0]|NOT RUN" "$logs"/*.sum
