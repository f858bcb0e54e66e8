"""Build, cache and load syncplane's compiled kernels (``src/syncplane/csrc``).

The extension is compiled with ``torch.utils.cpp_extension`` the first time it is
needed and cached under ``$XDG_CACHE_HOME/syncplane/extensions`` (``~/.cache`` by
default), in a directory named after a hash of the sources, the torch version and the
flags -- so an edit or a torch upgrade rebuilds, and nothing stale is ever loaded.
``syncplane build-ext`` (run by ``make setup``) does the build up front so that the
first training run does not pay for it.

Why JIT-and-cache instead of building at ``pip install`` time: a build-time extension
needs torch inside pip's isolated build environment (another multi-GB download) or
``--no-build-isolation`` everywhere; the cache gives the same result with a visible
message and a clear error when the compiler fails.

The CPU module is required (the comm layer's hot path runs through it). The CUDA
module compiles wherever ``nvcc`` exists; it can only *run* on a machine with a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = ("cpu_kernels.cpp",)
CUDA_SOURCES = ("cuda_kernels.cu",)
CPU_CFLAGS = ("-O3", "-fopenmp")  # -fopenmp: at::parallel_for is OpenMP inside torch's headers
CPU_LDFLAGS = ("-fopenmp",)
CUDA_CFLAGS = ("-O3",)
# Compiled when no GPU is visible to pick an architecture from (compile-only machines).
DEFAULT_CUDA_ARCH = "8.0+PTX"  # PTX lets newer GPUs JIT it


class ExtensionError(RuntimeError):
    """The compiled kernels could not be built or loaded; the message says why."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "syncplane" / "extensions"


def _find_cuda_home() -> str | None:
    """CUDA's install root, resolved the way nvcc itself would be found.

    torch guesses ``dirname(dirname(which nvcc))``; with a wrapper in /usr/local/bin
    that gives /usr/local, which has no CUDA headers. Prefer an explicit CUDA_HOME,
    then the conventional /usr/local/cuda, then the guess.
    """
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return candidate
    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def _build_name(kind: str, sources: tuple[str, ...], flags: tuple[str, ...]) -> str:
    import torch

    digest = hashlib.sha256()
    for src in (*sources, *sorted(p.name for p in CSRC.glob("*.h"))):   # headers: an edit rebuilds
        digest.update((CSRC / src).read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return f"syncplane_{kind}_{digest.hexdigest()[:12]}"


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    library = build_dir / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(kind: str, sources: tuple[str, ...], *, build: bool, verbose: bool) -> ModuleType | None:
    flags = CPU_CFLAGS + CPU_LDFLAGS if kind == "cpu" else CUDA_CFLAGS + (_cuda_arch(),)
    name = _build_name(kind, sources, flags)
    build_dir = cache_root() / name
    module = _import_built(name, build_dir)
    if module is not None or not build:
        return module
    build_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"syncplane: compiling the {kind.upper()} kernel extension into {build_dir} "
        f"(first use only; {'about a minute' if kind == 'cpu' else 'a few minutes'} on 2 cores)...",
        file=sys.stderr,
        flush=True,
    )
    from torch.utils import cpp_extension

    kwargs: dict[str, Any] = {}
    if kind == "cpu":
        kwargs.update(extra_cflags=list(CPU_CFLAGS), extra_ldflags=list(CPU_LDFLAGS))
    else:
        kwargs.update(extra_cuda_cflags=list(CUDA_CFLAGS))
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in sources],
            build_directory=str(build_dir),
            verbose=verbose,
            **kwargs,
        )
    except Exception as exc:  # the compiler's own output is in the exception text
        raise ExtensionError(
            f"building the syncplane {kind.upper()} kernels failed ({build_dir}).\n"
            f"Compiler output:\n{exc}\n"
            "A C++ compiler (g++ >= 10) and ninja are required; "
            + ("CUDA kernels also need nvcc matching torch's CUDA version." if kind == "cuda" else "")
        ) from exc


def _cuda_arch() -> str:
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return DEFAULT_CUDA_ARCH


#: Serializes the first load: ``lru_cache`` lets threads that call at once all run the loader,
#: and a thread could then get the module while another was still initializing it ("module
#: has no attribute 'weighted_combine'": seen with the tree exchange's stream threads).
_load_lock = threading.Lock()


def load_cpu(verbose: bool = False) -> ModuleType:
    """The CPU kernel module, building it on first use; raises ExtensionError if it cannot.
    Thread-safe."""
    with _load_lock:
        return _load_cpu(verbose)


def load_cuda(verbose: bool = False) -> ModuleType:
    """The CUDA kernel module (compiled with nvcc; runs only where a GPU exists). Thread-safe."""
    with _load_lock:
        return _load_cuda(verbose)


@functools.lru_cache(maxsize=None)
def _load_cpu(verbose: bool = False) -> ModuleType:
    module = _load("cpu", CPU_SOURCES, build=True, verbose=verbose)
    assert module is not None
    return module


@functools.lru_cache(maxsize=None)
def _load_cuda(verbose: bool = False) -> ModuleType:
    import torch

    if torch.version.cuda is None:
        raise ExtensionError(
            f"torch {torch.__version__} is a CPU-only build; CUDA kernels need a CUDA build of torch"
        )
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        raise ExtensionError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    os.environ["CUDA_HOME"] = cuda_home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _cuda_arch())
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = cuda_home  # torch resolves it once, at import
    module = _load("cuda", CUDA_SOURCES, build=True, verbose=verbose)
    assert module is not None
    return module


def cpu_build_name() -> str:
    """The name (a hash of sources, flags, torch and Python) the CPU module has when built:
    what a cached measurement of it belongs to, known without compiling."""
    return _build_name("cpu", CPU_SOURCES, CPU_CFLAGS + CPU_LDFLAGS)


@functools.lru_cache(maxsize=None)
def cannot_compile(kind: str) -> str | None:
    """Why the ``kind`` (``cpu`` or ``cuda``) kernels can neither be loaded from the cache nor
    compiled here -- no C++ compiler, no ninja, no nvcc or a CPU-only torch -- or None. Checked
    once per process (``kernels`` then runs the pure-torch references)."""
    import torch
    from torch.utils.cpp_extension import is_ninja_available

    if kind == "cuda" and torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    try:
        if _load(kind, CPU_SOURCES if kind == "cpu" else CUDA_SOURCES, build=False, verbose=False) is not None:
            return None                       # built before: nothing to compile
    except Exception:                         # a stale or corrupt entry: it will be rebuilt
        pass
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH"
    if not is_ninja_available():
        return "ninja is not installed"
    if kind == "cuda" and _find_cuda_home() is None:
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernels can neither be loaded from the cache nor compiled here, or None.
    Checked before a GPU job starts, so a missing ``nvcc`` is one clear message up front
    instead of a compiler error in every worker."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; the CUDA kernels need a CUDA build of torch"
    try:
        if _load("cuda", CUDA_SOURCES, build=False, verbose=False) is not None:
            return None                       # built before: nothing to compile
    except Exception:                         # a stale or corrupt entry: it will be rebuilt
        pass
    if _find_cuda_home() is None:
        return (f"they compile on first use and need nvcc (a CUDA {torch.version.cuda} toolkit), which was not "
                "found: install it, put nvcc on PATH or set CUDA_HOME -- or use strategy=ddp, which needs no "
                "kernels of ours")
    return None


def status() -> dict[str, Any]:
    """What is built right now, without compiling anything (for ``syncplane info``)."""
    import torch

    result: dict[str, Any] = {"built": False, "cuda_kernels": False, "cache": str(cache_root())}
    try:
        result["built"] = _load("cpu", CPU_SOURCES, build=False, verbose=False) is not None
    except Exception as exc:  # a corrupt cache entry is reported, not hidden
        result["error"] = f"cpu: {exc}"
    if torch.version.cuda is not None:
        try:
            result["cuda_kernels"] = _load("cuda", CUDA_SOURCES, build=False, verbose=False) is not None
        except Exception as exc:
            result["cuda_error"] = str(exc)
    result["nvcc"] = _find_cuda_home() is not None
    return result
