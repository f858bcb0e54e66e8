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
"$VENV/bin/pip" install --quiet "torch==2.0.1" "numpy<2" wheel "setuptools<70" cmake cloudpickle psutil pyyaml \
  packaging cffi
# Horovod's CMake enables CUDA whenever it finds nvcc (and then fails without a full CUDA
# toolkit); a stand-in nvcc that fails keeps this a CPU/gloo build.
mkdir -p "$VENV/no-nvcc" && printf '#!/bin/sh\nexit 1\n' > "$VENV/no-nvcc/nvcc" && chmod +x "$VENV/no-nvcc/nvcc"
PATH="$VENV/no-nvcc:$PATH" CUDA_HOME= HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO \
  "$VENV/bin/pip" install --no-build-isolation --no-cache-dir "horovod==0.28.1"
"$VENV/bin/python" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else 'ok')"
echo "horovod installed in $VENV"
