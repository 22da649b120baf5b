#!/usr/bin/env bash
# The main job: start shmstaged, train a small model that checkpoints through it, restore
# from the last checkpoint, print the stall against torch.save, stop the daemon cleanly.
# Everything lives in one scratch directory, removed at the end; `--keep` (make demo
# KEEP=1) keeps it to look at the checkpoints and the daemon's log.
set -euo pipefail
cd "$(dirname "$0")/.."
keep=0
args=()
for arg in "$@"; do
  if [[ $arg == --keep ]]; then keep=1; else args+=("$arg"); fi
done
work=$(mktemp -d "${TMPDIR:-/tmp}/shmstage-demo.XXXXXX")
sock="$work/shmstaged.sock"
echo "starting shmstaged on $sock (log: $work/shmstaged.log)"
.venv/bin/shmstaged --socket "$sock" 2>"$work/shmstaged.log" &
daemon=$!
cleanup() {
  status=$?
  kill -TERM "$daemon" 2>/dev/null && wait "$daemon" || true
  if (( keep )); then
    echo "kept: checkpoints in $work/checkpoints, shmstaged log $work/shmstaged.log"
  else
    (( status == 0 )) || { echo "shmstaged log:"; tail -n 20 "$work/shmstaged.log"; }
    rm -rf "$work"
    echo "removed $work (make demo KEEP=1 keeps it)"
  fi
}
trap cleanup EXIT
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
[[ -S $sock ]] || { cat "$work/shmstaged.log"; echo "shmstaged did not start" >&2; exit 1; }
.venv/bin/python -m shmstage_client.demo --socket "$sock" --dir "$work/checkpoints" \
  ${args[@]+"${args[@]}"}
