#!/usr/bin/env bash
# Run the GPU tests and the benchmark on a CUDA machine straight from the source tree.
# Usage: scripts/gpu-check.sh OUTDIR [tests|bench-8g|bench-1g|dcp-2gpu|write|register]...
# Wheels for packages the machine lacks may be put in .whl/ (installed to /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-check.sh OUTDIR [tests|bench-8g|bench-1g]...}; shift
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:daemon:client${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'
  df -h /dev/shm "${TMPDIR:-/tmp}"; nproc; free -g; } 2>&1 | tee "$out/machine.txt"
for what in "$@"; do
  case $what in
    tests) python3 -m pytest -p no:cacheprovider -q -o addopts= tests/client/test_gpu.py \
             tests/client/test_stager.py tests/core 2>&1 | tee "$out/tests.txt" ;;
    bench-8g) python3 -m shmstage_client.bench --total-bytes 8GiB --tensors 500 \
             --min-tensor-bytes 4KiB --max-tensor-bytes 256MiB --dtype bf16 --repeats 3 \
             --json "$out/bench-8g.json" --png "$out/bench-8g.png" -q 2>&1 | tee "$out/bench-8g.txt" ;;
    bench-1g) python3 -m shmstage_client.bench --total-bytes 1GiB --tensors 10000 \
             --min-tensor-bytes 4KiB --max-tensor-bytes 256MiB --dtype bf16 --repeats 3 --save-timeout 90 \
             --json "$out/bench-1g.json" --png "$out/bench-1g.png" -q 2>&1 | tee "$out/bench-1g.txt" ;;
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
    register) for case in "8GiB 500" "1GiB 10000"; do  # a first save's setup, step by step
             read -r size tensors <<< "$case"
             for threads in 1 8; do
               python3 scripts/registration_bench.py --size "$size" --tensors "$tensors" \
                 --slots 2 --threads "$threads" 2>&1 | tee -a "$out/register.txt"
             done
           done ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
