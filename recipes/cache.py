"""What the text recipes prepare once and keep: a cache folder per content key.

A trained tokenizer or a tokenized corpus is keyed by everything it depends on
(``fingerprint``) and written by ``publish`` into a temporary folder that is then
renamed, so concurrent builders (one per node, or per emulated host) never see a
half-written result and every later run reuses it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fingerprint(*parts: Any) -> str:
    """A short, stable key for JSON-able ``parts`` (16 hex digits of their SHA-1)."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def publish(build: Callable[[Path], None], target: Path) -> None:
    """Build into a temporary folder beside ``target``, then rename: concurrent builders
    (one per node, or per emulated host) never see a half-written result."""
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
