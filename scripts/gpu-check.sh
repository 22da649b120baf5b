#!/usr/bin/env bash
# Run the GPU tests and the benchmark on a CUDA machine straight from the source tree.
# Usage: scripts/gpu-check.sh OUTDIR STEP...
#   tests         GPU tests and the client/core suites
#   bench-8g      peers: 8 GiB in 500 bf16 tensors (issue 13: durable ÷ direct-I/O limit)
#   bench-1g      peers: 1 GiB in 10,000 tensors (issue 13: always finishes, whatever peers do)
#   overlapped    8 GiB / 500 tensors, each save issued while the previous one persists (issue 12)
#   training      ≥ 7 GiB of model + AdamW state, with and without guard() (issues 12, 14)
#   restore       8 GiB / 500 tensors: load cold/warm/memory, restart after SIGKILL (issue 15)
#   dcp-2gpu      DCP through shmstage on 2 GPUs
#   write         the writer alone against the disk's direct-I/O and buffered limits (issue 13)
#   bench-100k    1 GiB in 100,000 tensors of 1-64 KiB: raw copy, first and steady saves (issue 36)
#   publish       7 GiB published to a subscriber: stall, ring copy, first version, wake-up (issue 35)
#   restart       8 GiB restarted after SIGKILL, plain and with prepare_restore (issue 36)
#   frameworks    Lightning and the Hugging Face Trainer on ~1 B parameters, ours against theirs (issue 34)
# Each bench step writes OUTDIR/STEP.json and OUTDIR/STEP.png and appends its text to
# OUTDIR/log.txt (with machine.txt: at most 8 files for 3 bench steps per call). Each is
# bounded by --budget 540 (the bench still writes its report when the budget is spent)
# and killed at 590 s as a last resort, so a step ends within a 10-minute call.
# Wheels for packages the machine lacks may be put in .whl/ (installed to /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-check.sh OUTDIR STEP... (see the header)}; shift
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:daemon:client:bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'
  df -h /dev/shm "${TMPDIR:-/tmp}" /run; findmnt -no FSTYPE,TARGET -T /run; nproc; free -g
  uname -r; } 2>&1 | tee "$out/machine.txt"

bench() {  # bench STEP ARGS...: one bounded bench run, its report in OUTDIR
  local step=$1; shift
  echo "=== $step: shmstage-bench $*" | tee -a "$out/log.txt"
  timeout -k 10 590 python3 -m shmstage_bench "$@" --budget 540 \
    --json "$out/$step.json" --png "$out/$step.png" -q 2>&1 | tee -a "$out/log.txt"
}

synthetic_8g=(--total-bytes 8GiB --tensors 500 --min-tensor-bytes 4KiB --max-tensor-bytes 256MiB
              --dtype bf16)
for what in "$@"; do
  case $what in
    tests) python3 -m pytest -p no:cacheprovider -q -o addopts= tests/client/test_gpu.py \
             tests/client/save/test_guard.py tests/client/restore/test_restoring.py \
             tests/client/restore/test_transfer.py tests/client/restore/test_host_staging.py \
             tests/client/save/test_stager.py tests/core 2>&1 | tee "$out/tests.txt" ;;
    bench-8g) bench bench-8g "${synthetic_8g[@]}" --repeats 3 ;;
    bench-1g) bench bench-1g --total-bytes 1GiB --tensors 10000 --min-tensor-bytes 4KiB \
             --max-tensor-bytes 256MiB --dtype bf16 --repeats 3 --save-timeout 90 ;;
    overlapped) bench overlapped --scenario overlapped "${synthetic_8g[@]}" --saves 6 ;;
    training) bench training --scenario training --guard --saves 4 ;;
    restore) bench restore --scenario restore "${synthetic_8g[@]}" ;;
    bench-100k) bench bench-100k --device cuda --total-bytes 1GiB --tensors 100000 \
             --min-tensor-bytes 1KiB --max-tensor-bytes 64KiB \
             --methods raw-copy,shmstage-first,shmstage-steady --repeats 5 ;;
    publish) timeout -k 10 300 python3 -m shmstage_bench --scenario publish --device cuda \
             --total-bytes 7GiB --json "$out/publish.json" 2>&1 | tee -a "$out/log.txt" ;;
    restart) timeout -k 10 300 python3 scripts/restart_speed.py 2>&1 | tee "$out/restart.txt" ;;
    frameworks) for fw in lightning hf; do  # checkpoints on the root disk; 12 GiB each
             timeout -k 10 330 python3 "scripts/${fw}_gpu_bench.py" --out "/tmp/$fw-bench" \
               --json "$out/$fw.json" 2>&1 | tee -a "$out/frameworks.txt"; rm -rf "/tmp/$fw-bench"
           done ;;
    dcp-2gpu) python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
             scripts/dcp_gpu_bench.py --start-daemon --dir /var/tmp/dcp-bench \
             --json "$out/dcp-2gpu.json" 2>&1 | tee "$out/dcp-2gpu.txt" ;;
    write) wdir=${TMPDIR:-/tmp}/shmstage-wbench  # the daemon's writer against the disk's limits
           for case in "8GiB 500 1" "1GiB 10000 1" "1GiB 100 8"; do
             read -r size tensors jobs <<< "$case"
             python3 scripts/write_bench.py --dir "$wdir" --size "$size" --tensors "$tensors" \
               --jobs "$jobs" --owners "$(( jobs > 1 && EUID == 0 ? 2 : 1 ))" --runs 3 \
               --json "$out/write-$size-$tensors-$jobs.json" 2>&1 | tee -a "$out/write.txt"
           done
           python3 scripts/write_bench.py --dir "$wdir" --size 8GiB --tensors 500 --runs 3 \
             --buffered --skip-limits 2>&1 | tee -a "$out/write.txt"
           rm -rf "$wdir" ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
