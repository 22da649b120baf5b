#!/usr/bin/env bash
# The main job: start shmstaged, train a small model that checkpoints through it, restore
# from the last checkpoint, print the stall against torch.save, stop the daemon cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/shmstage-demo.XXXXXX")
sock="$work/shmstaged.sock"
.venv/bin/shmstaged --socket "$sock" 2>"$work/shmstaged.log" &
daemon=$!
cleanup() {
  kill -TERM "$daemon" 2>/dev/null && wait "$daemon" || true
  echo "shmstaged log: $work/shmstaged.log"
}
trap cleanup EXIT
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
[[ -S $sock ]] || { cat "$work/shmstaged.log"; echo "shmstaged did not start" >&2; exit 1; }
.venv/bin/python -m shmstage_client.demo --socket "$sock" --dir "$work/checkpoints" "$@"
