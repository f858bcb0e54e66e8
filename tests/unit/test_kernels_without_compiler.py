"""Without a C++ compiler every kernel runs its pure-torch reference, said once in the log; with
one, the kernels compile at first use (``ext``), and a compiler that fails is an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from syncplane import kernels
xs = [torch.randn(5), torch.randn(3, 2)]
flat = kernels.pack(xs, scale=2.0)
back = [torch.empty_like(x) for x in xs]
kernels.unpack(flat, back, scale=0.5)
assert all(torch.equal(a, b) for a, b in zip(xs, back))
out = kernels.weighted_combine(xs[0], [torch.ones(5)], [0.5], 0.5)
assert torch.allclose(out, 0.5 * xs[0] + 0.5)
print(dict(kernels.call_counts))
"""


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "XDG_CACHE_HOME": str(tmp_path),
                               **env})


def test_no_compiler_runs_the_references_and_says_so_once(tmp_path):
    done = run(tmp_path, CXX="no-such-compiler-here")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "cannot be compiled here" in line]
    assert len(said) == 1 and "'no-such-compiler-here' is not on PATH" in said[0], done.stderr
    assert "('pack', 'torch'): 1" in done.stdout and "('weighted_combine', 'torch'): 1" in done.stdout
    assert not (tmp_path / "syncplane").exists() or not any((tmp_path / "syncplane").rglob("*.so"))


def test_the_reason_names_what_is_missing_and_a_built_cache_needs_no_compiler(tmp_path, monkeypatch):
    from syncplane import ext

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))   # nothing built here
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    ext.cannot_compile.cache_clear()
    try:
        assert "'no-such-compiler-here' is not on PATH" in ext.cannot_compile("cpu")
        ext.cannot_compile.cache_clear()
        monkeypatch.setenv("CXX", sys.executable)   # a program on PATH: a compiler as far as the check goes
        assert ext.cannot_compile("cpu") is None
    finally:
        ext.cannot_compile.cache_clear()
