#!/usr/bin/env bash
# Wheels for the bench's nvidia-resiliency-ext, DLRover and ML Flashpoint rows on the GPU
# machine (CPython 3.12, x86_64, glibc 2.39, no network): put them in the repository's .whl/,
# which scripts/gpu-check.sh installs to /tmp/site (carry .whl with the run).
# Usage: scripts/fetch_peer_wheels.sh DIR
#
# DLRover Flash Checkpoint: dlrover is pure Python; importing its flash checkpoint pulls in
# grpc, requests and psutil (not protobuf, kubernetes, ray or pynvml), so exactly those are
# fetched, each without its own dependencies (~9 MiB in all).
#
# nvidia-resiliency-ext (NVRx) 0.7.0 is a cp312 wheel for manylinux_2_39 only (0.4.1 is the
# newest for manylinux_2_31; none for 2_28 or manylinux2014). Its async checkpointing,
# all the bench drives, imports torch, numpy and (optionally) psutil, which the GPU image
# has; its other requirements (fastapi, grpcio-tools, pydantic, uvicorn, ...) serve its
# launcher and attribution tools, so it is fetched without them (~1 MiB).
#
# ML Flashpoint 0.0.10 is an sdist only, with two C++ extensions (pybind11 + abseil-cpp,
# which its CMake fetches from GitHub at build time). It is built here for CPython 3.12 when
#   PY312   a python3.12 (default: python3.12 on PATH) and
#   ABSEIL  a git repository or checkout of abseil-cpp (tag 20250814.1 is checked out)
# are given; MLF_WHEEL=path copies a wheel built before instead. Built as it comes, its
# wheel lacks both extensions (CMake writes them into the source tree, whose .gitignore
# lists *.so, and scikit-build-core leaves ignored files out), so that line goes first. The
# result needs glibc >= 2.34 and libstdc++ from GCC >= 12 (GLIBCXX_3.4.30) where it runs.
set -euo pipefail
dir=${1:?usage: scripts/fetch_peer_wheels.sh DIR}
mkdir -p "$dir"
pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --no-deps -d "$dir" dlrover==0.6.1 grpcio==1.85.3 requests==2.34.2 urllib3==2.8.0 \
  idna==3.20 charset-normalizer==3.5.3 certifi==2026.10.19.post1 psutil==7.2.2
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_39_x86_64 --no-deps -d "$dir" nvidia-resiliency-ext==0.7.0

if [[ -n ${MLF_WHEEL:-} ]]; then
  cp "$MLF_WHEEL" "$dir/"
elif [[ -n ${ABSEIL:-} ]]; then
  py312=${PY312:-python3.12}
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  pip download -q --no-deps --no-binary=ml-flashpoint -d "$work" ml-flashpoint==0.0.10
  tar -xzf "$work"/ml_flashpoint-0.0.10.tar.gz -C "$work"
  git clone -q "$ABSEIL" "$work/abseil"
  git -C "$work/abseil" -c advice.detachedHead=false checkout -q 20250814.1
  "$py312" -m venv "$work/venv"
  "$work/venv/bin/pip" install -q pybind11==3.0.1 scikit-build-core==0.11.6 cmake==3.31.10 \
    ninja==1.11.1.3 setuptools-scm==9.2.2 wheel
  src="$work/ml_flashpoint-0.0.10"
  sed -i '/^\*\.so$/d' "$src/.gitignore"
  (cd "$src" && PATH="$work/venv/bin:$PATH" SETUPTOOLS_SCM_PRETEND_VERSION=0.0.10 \
    SKBUILD_CMAKE_ARGS="-DBUILD_TESTING=OFF;-DFETCHCONTENT_SOURCE_DIR_ABSEIL-CPP=$work/abseil;-DFETCHCONTENT_FULLY_DISCONNECTED=ON" \
    "$work/venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/out" .)
  # its extensions are built for this CPython, not for the stable ABI its tag claims
  "$work/venv/bin/wheel" tags --remove --python-tag cp312 --abi-tag cp312 "$work"/out/*.whl
  cp "$work"/out/*.whl "$dir/"
else
  echo "ml-flashpoint: not fetched (set ABSEIL, and PY312 if python3.12 is not on PATH," \
    "or MLF_WHEEL; see the header); its bench row will say it is not installed" >&2
fi
ls -l "$dir"
