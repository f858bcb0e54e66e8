"""``cluster=PATH`` on the Hydra command line: a user's own profile YAML, not only a shipped name.

Hydra reads ``cluster=VALUE`` as "option VALUE of the config group ``cluster``" and looks
for ``configs/cluster/VALUE.yaml``, so ``cluster=./mine.yaml`` failed ("Could not find
'cluster/./mine.yaml'") and the docs told users to copy their file into the package. Here
every ``cluster=`` override whose value is a path (it has a ``/`` or ends in ``.yaml``/``.yml``)
is loaded and validated with ``load_profile`` (a missing or invalid file is a ConfigError
naming it, before Hydra composes anything), registered in Hydra's ConfigStore under the
``cluster`` group, and the override is rewritten to name that entry. Sweeps
(``-m cluster=./a.yaml,two_racks``) are rewritten value by value.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from syncplane.cluster import load_profile

_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2})cluster=(?P<value>.+)$")


def is_profile_path(value: str) -> bool:
    """A ``cluster=`` value that names a file rather than a shipped profile."""
    return "/" in value or value.endswith((".yaml", ".yml"))


def store_name(path: str) -> str:
    """The ConfigStore option a profile file is registered as: its stem plus a short hash of
    its absolute path (two ``x.yaml`` in different folders stay two options)."""
    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:8]
    return f"file_{re.sub(r'[^A-Za-z0-9_]', '_', Path(path).stem)}_{digest}"


def register_profile_file(path: str) -> str:
    """Load and validate the profile at ``path``, register it in the ``cluster`` group, and
    return the option name that selects it. Raises ConfigError if the file is missing or invalid."""
    from hydra.core.config_store import ConfigStore

    profile = load_profile(path)
    name = store_name(path)
    ConfigStore.instance().store(group="cluster", name=name, node=profile.to_dict())
    return name


def rewrite_cluster_overrides(overrides: list[str]) -> list[str]:
    """The same overrides with every ``cluster=PATH`` (or ``cluster=PATH,NAME,...`` in a sweep)
    pointing at a registered ConfigStore option instead of a file."""
    out = []
    for override in overrides:
        match = _OVERRIDE.match(override)
        if match is None or not any(is_profile_path(v) for v in match["value"].split(",")):
            out.append(override)
            continue
        values = [register_profile_file(v) if is_profile_path(v) else v for v in match["value"].split(",")]
        out.append(f"{match['prefix']}cluster={','.join(values)}")
    return out
