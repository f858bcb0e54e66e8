"""Every test under tests/gpu needs a CUDA device: marked ``gpu`` and skipped, with the
reason, on machines without one (CI, the 2-core development machine)."""

from __future__ import annotations

import pytest
import torch


@pytest.hookimpl(tryfirst=True)   # mark before `-m gpu` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(config.rootpath / "tests" / "gpu")
    skip = None if torch.cuda.is_available() else pytest.mark.skip(
        reason=f"no CUDA device here (torch {torch.__version__}, cuda build {torch.version.cuda}); "
               "run `pytest -m gpu` on a GPU machine")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
