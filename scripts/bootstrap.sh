#!/usr/bin/env bash
# Create .venv with the three packages and the benchmark (bench/) editable and a pinned CPU
# torch. Idempotent: it reinstalls only when a pyproject or the constraints change. `--test` also installs the
# test tools, and systemd's analysis tools when the machine lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "shmstage needs Python 3.11 or newer; set PYTHON=python3.11 (found $("$PYTHON" -V))" >&2
  exit 1
}
say() { echo "bootstrap: $*" >&2; }
if [[ ! -x $VENV/bin/python ]]; then
  say "creating the virtualenv $VENV with $("$PYTHON" -V)"
  "$PYTHON" -m venv "$VENV"
fi

# setup.py and the C it builds (shmstage._readsum, optional: skipped without a compiler)
stamp="$VENV/.shmstage-$(cat pyproject.toml setup.py shmstage/_readsum.c daemon/pyproject.toml \
  client/pyproject.toml bench/pyproject.toml constraints.txt scripts/bootstrap.sh |
  sha256sum | cut -c1-16)-$want_test"
if [[ ! -e $stamp ]]; then
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt)
  # This machine's pip configuration names index folders that may be absent: hide that noise.
  quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
  say "installing shmstage, shmstaged, the client and the bench (editable), torch $(grep -o '^torch==.*' constraints.txt | cut -d= -f3) (CPU), matplotlib — about a minute the first time"
  quiet "${pip[@]}" -e . -e daemon -e client -e bench
  if (( want_test )); then
    say "installing the test tools: pytest, pytest-xdist, safetensors, hypothesis, ruff, atheris"
    quiet "${pip[@]}" pytest pytest-timeout pytest-xdist safetensors hypothesis ruff
    # The frameworks the integrations are tested against (the client's extras, and TRL, whose
    # trainers build on the Hugging Face Trainer): about 40 s and 0.5 GB more.
    say "installing the frameworks for the integration tests: lightning, transformers, accelerate, trl, torchtitan"
    quiet "${pip[@]}" -e "client[lightning,hf,torchtitan]" trl
    # atheris (the coverage-guided protocol fuzzer) only from a binary wheel: building it
    # needs clang/libFuzzer; without it that one fuzz test skips, hypothesis still runs.
    quiet "${pip[@]}" --only-binary=atheris atheris ||
      echo "atheris has no wheel for this Python; its fuzz test will be skipped" >&2
  fi
  rm -f "$VENV"/.shmstage-*
  touch "$stamp"
  say "done: $VENV/bin has shmstaged, shmstage and shmstage-bench"
fi

if (( want_test )) && ! command -v systemd-analyze >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing systemd's tools for the unit tests (apt-get install systemd)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd \
      >/dev/null) || echo "could not install systemd; its unit tests will be skipped" >&2
  else
    echo "systemd-analyze not found; the unit-file tests will be skipped" >&2
  fi
fi
