#!/usr/bin/env bash
# Build Horovod 0.28.1 (gloo only) in its own virtualenv, for side-by-side comparisons.
#
# Why a separate venv with torch 2.0.1: Horovod 0.28.1 compiles its torch extension as
# C++14, and the headers of torch >= 2.3 need C++17/20, so it does not build against
# the torch syncplane uses. torch 2.0.1 on Python 3.11 works (gloo only, no MPI/NCCL).
# Takes ~10 min on 2 cores and ~2 GB of wheels. Usage: scripts/setup_horovod.sh [VENV]
set -euo pipefail
VENV=${1:-"$HOME/.cache/syncplane/horovod-venv"}
PYTHON=${PYTHON:-python3}
if [ -x "$VENV/bin/horovodrun" ]; then
  echo "horovod already installed in $VENV"; exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "torch==2.0.1" "numpy<2" wheel "setuptools<70" "cmake<4" cloudpickle psutil pyyaml \
  packaging cffi
# Horovod builds its torch binding with CUDA whenever torch is a CUDA build *and* torch
# finds a CUDA toolkit (nvcc on PATH or /usr/local/cuda); with this machine's CUDA 13
# toolkit and torch 2.0.1+cu117 that configuration fails. Build in a private mount
# namespace where /usr/local (nvcc, /usr/local/cuda) is hidden: a CPU + gloo build.
BUILD_ENV="HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_NVTX=1 HOROVOD_CPU_OPERATIONS=GLOO CMAKE_POLICY_VERSION_MINIMUM=3.5"
BUILD="env -u CUDA_HOME -u CUDA_PATH $BUILD_ENV $VENV/bin/pip install --no-build-isolation --no-cache-dir horovod==0.28.1"
if [ -d /usr/local/cuda ] || command -v nvcc > /dev/null; then
  unshare --mount --propagation private sh -c "mount -t tmpfs none /usr/local && PATH=\"$VENV/bin:/usr/bin:/bin\" $BUILD"
else
  sh -c "$BUILD"
fi
"$VENV/bin/python" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else 'ok')"
echo "horovod installed in $VENV"
