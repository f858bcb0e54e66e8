"""syncplane installs like a library: ``scripts/check_wheel_install.sh`` builds the wheel,
installs it into a fresh virtual environment (no ``make``), and trains Lightning's
``BoringModel`` with ``strategy="diloco"`` on 2 CPU ranks from it, with a C++ compiler (the
kernels compile at first use, into a fresh cache) and without one (the pure-torch references,
said once), ``import wandb`` failing both times. The kernels' first compile is most of its time."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="the compiler-present half needs a C++ compiler")
def test_the_built_wheel_trains_a_plain_script_in_a_fresh_venv_with_and_without_a_compiler(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "check_wheel_install.sh"), str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "wheel install check passed" in output
    assert output.count("   ok in ") == 2, output[-2000:]   # compiler present, then absent
