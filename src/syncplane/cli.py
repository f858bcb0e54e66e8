"""``syncplane`` command line: ``info`` and ``build-ext`` (more verbs land with their issues)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def emulation_support() -> dict[str, Any]:
    """Can this machine build emulated clusters (network namespaces + tc shaping)?"""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return {"available": False, "reason": f"missing tools: {', '.join(missing)} (install iproute2)"}
    if os.geteuid() != 0:
        return {"available": False, "reason": "needs root (network namespaces and tc)"}
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return {"available": False, "reason": f"`ip netns` failed: {probe.stderr.strip()}"}
    return {"available": True, "reason": None}


def collect_info() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from syncplane import __version__, ext
    from syncplane.strategies import registry

    return {
        "syncplane": __version__,
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "lightning", "hydra-core", "wandb", "torchvision")},
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "cuda_available": torch.cuda.is_available(),
            "torch_cuda_version": torch.version.cuda,
        },
        "extension": ext.status(),
        "strategies": registry.describe(),
        "emulation": emulation_support(),
    }


def _print_info(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"syncplane {info['syncplane']}", show_header=False)
    table.add_column("item")
    table.add_column("value")
    table.add_row("python", info["python"])
    for name, ver in info["versions"].items():
        table.add_row(name, ver or "not installed")
    for name, value in info["backends"].items():
        table.add_row(name, str(value))
    extension = info["extension"]
    table.add_row("extension built", str(extension["built"]) + ("" if extension["built"] else
                                                                "  (run: syncplane build-ext)"))
    table.add_row("CUDA kernels built", str(extension["cuda_kernels"]))
    emulation = info["emulation"]
    table.add_row("cluster emulation", "available" if emulation["available"] else f"no: {emulation['reason']}")
    console.print(table)
    strategies = Table(title="strategies", show_header=True)
    strategies.add_column("name")
    strategies.add_column("description")
    for name, description in info["strategies"].items():
        strategies.add_row(name, description)
    console.print(strategies)


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def cmd_build_ext(args: argparse.Namespace) -> int:
    from syncplane import ext

    ext.load_cpu(verbose=args.verbose)
    print("syncplane: CPU kernels ready", flush=True)
    if args.cuda:
        ext.load_cuda(verbose=args.verbose)
        print("syncplane: CUDA kernels compiled (they run only where a GPU exists)", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="syncplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, backends, extension status, strategies, emulation support")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    build = sub.add_parser("build-ext", help="compile the kernel extension now (cached afterwards)")
    build.add_argument("--cuda", action="store_true", help="also compile the CUDA kernels with nvcc")
    build.add_argument("--verbose", action="store_true", help="show compiler commands")
    build.set_defaults(func=cmd_build_ext)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:  # a CLI prints one clear line, not a traceback
        from syncplane.ext import ExtensionError

        if isinstance(exc, ExtensionError):
            print(f"syncplane: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
