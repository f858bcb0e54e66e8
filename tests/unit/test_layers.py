"""The layer contracts hold, there is no import cycle in ``syncplane``, and the check would
catch a violation (a forbidden import planted in a staged copy makes it fail)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "scripts" / "lint_imports.py")
lint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint)


def test_contracts_kept_and_no_cycles():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_imports.py")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "9 kept, 0 broken" in result.stdout and "no import cycles" in result.stdout
    assert "the fork server preloads no tool module" in result.stdout


@pytest.mark.parametrize(("module", "planted", "expected"), [
    ("cluster/profile.py", "import syncplane.comm.meter", "cluster imports none of the layers above it BROKEN"),
    ("comm/meter.py", "import syncplane.algorithms.spec", "strategies -> algorithms -> exchanges -> comm -> kernels BROKEN"),
    ("strategies/torch_hooks.py", "import syncplane.comm.meter", "strategies reach transport only through their algorithm BROKEN"),
    ("algorithms/canary/config.py", "import syncplane.algorithms.diloco.config", "algorithm families do not import each other BROKEN"),
    ("comm/meter.py", "import syncplane.exchanges.choose", "comm is transport only BROKEN"),
    ("exchanges/mesh.py", "import lightning", "algorithms and exchanges know no Lightning, runtime or tools BROKEN"),
    ("runtime/report.py", "import syncplane.experiments.chaos", "the product never imports the experiment tools BROKEN"),
    ("runtime/replan.py", "import syncplane.algorithms.diloco.config",
     "the runtime reaches an algorithm only through its spec BROKEN"),
    ("cluster/probe.py", "import syncplane.job", "cluster imports none of the layers above it BROKEN"),
    ("runtime/report.py", "import syncplane.bench.compare", "the product never imports the bench BROKEN"),
    ("job.py", "import syncplane.bench.runner", "the product never imports the bench BROKEN"),
    ("runtime/forkserver.py", "PRELOAD = [*PRELOAD, 'syncplane.bench.worker']",
     "the fork server preloads a tool module: syncplane.bench.worker"),
    ("comm/errors.py", "import syncplane.comm.meter\nimport syncplane.comm.p2p", "import cycle"),
])
def test_a_planted_violation_fails_the_check(tmp_path, capfd, module, planted, expected):
    staged = lint.stage(tmp_path)
    target = staged / "syncplane" / module
    target.write_text(target.read_text() + "\n" + planted + "\n")
    assert lint.check(staged) == 1
    out = capfd.readouterr().out
    assert expected in out
