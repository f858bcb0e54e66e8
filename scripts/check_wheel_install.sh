#!/usr/bin/env bash
# Install syncplane like a library and train a plain Lightning script with it, without `make`:
# build the wheel, install it into a fresh virtual environment that sees this machine's torch and
# Lightning (--system-site-packages: works offline), then run Lightning's BoringModel with
# strategy="diloco" on 2 CPU ranks (Lightning's own launcher) -- once with a C++ compiler (the
# kernels compile at first use, into a fresh cache) and once without one (the pure-torch
# references, said once), each time with `import wandb` made to fail (the core needs no wandb).
#   bash scripts/check_wheel_install.sh [WORK_DIR]     (default: a temporary folder, removed after)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${1:-$(mktemp -d -t syncplane-wheel-XXXXXX)}"
[ -n "${1:-}" ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
echo "== building the wheel (no network: this machine's setuptools)"
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/syncplane-*.whl)"
echo "   $WHEEL"
echo "== a fresh virtual environment, seeing this machine's packages"
"$PYTHON" -m venv --system-site-packages --without-pip "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install --quiet --no-index --no-deps "$WHEEL"
if "$VPY" -m pip check 2>&1 | grep -i "^syncplane"; then echo "syncplane's requirements are not met"; exit 1; fi
cat > "$WORK/plain.py" <<'PY'
import sys
sys.modules["wandb"] = None            # `import wandb` fails: the core must not need it
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
import syncplane
import syncplane.strategies            # registers "diloco", "atc", ... with Lightning

trainer = pl.Trainer(strategy="diloco", accelerator="cpu", devices=2, max_steps=40, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[syncplane.RunReport(sys.argv[1], "diloco", "boring")])
trainer.fit(BoringModel())
if trainer.global_rank == 0:
    print(f"trained {trainer.global_step} steps; syncplane from {syncplane.__file__}")
PY
cd "$WORK"
# a job of its own: no rendezvous inherited from the calling shell (or test run)
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK GROUP_RANK
for compiler in present absent; do
    echo "== plain script, C++ compiler $compiler"
    export XDG_CACHE_HOME="$WORK/cache-$compiler"      # nothing built before: first use
    if [ "$compiler" = absent ]; then export CXX=no-such-compiler; else unset CXX; fi
    start=$(date +%s)
    "$VPY" plain.py "$WORK/report-$compiler" > "$WORK/log-$compiler" 2>&1 || { tail -40 "$WORK/log-$compiler"; exit 1; }
    grep -q "trained 40 steps; syncplane from $WORK/venv/" "$WORK/log-$compiler" || {
        echo "not trained from the wheel:"; tail -20 "$WORK/log-$compiler"; exit 1; }
    test -s "$WORK/report-$compiler/summary.json"
    if [ "$compiler" = absent ]; then
        grep -q "cannot be compiled here" "$WORK/log-$compiler" || { echo "no message about the references"; exit 1; }
    else
        ls "$XDG_CACHE_HOME"/syncplane/extensions/*/*.so >/dev/null || { echo "kernels not compiled"; exit 1; }
    fi
    echo "   ok in $(( $(date +%s) - start )) s: $(grep -h "compiling\|cannot be compiled" "$WORK/log-$compiler" | head -1)"
done
unset CXX
echo "wheel install check passed"
