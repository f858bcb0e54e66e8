"""torch hook peers' settings and traffic model: bad settings named before any process
starts; the bench payload's shapes cover it exactly; the cost pattern sends half of DDP's
bytes for fp16 and PowerSGD's r·(rows + cols) per matrix."""

from __future__ import annotations

import pytest

from syncplane.algorithms import CostOptions, spec_for
from syncplane.algorithms.torch_hooks import HookConfig, payload_shapes
from syncplane.cluster.profile import load_profile
from syncplane.config import ConfigError
from syncplane.strategies import strategy_class


@pytest.mark.parametrize("field,value", [("matrix_approximation_rank", 0), ("start_powerSGD_iter", 1),
                                         ("min_compression_rate", 0.5)])
def test_bad_powersgd_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        HookConfig(name="torch_powersgd", **{field: value})
    with pytest.raises(ConfigError, match=field):
        strategy_class("torch_powersgd")(**{field: value})


def test_payload_shapes_cover_the_payload() -> None:
    for numel in (1, 2559, 2560 * 3 + 7, 25_557_032):
        shapes = payload_shapes(numel)
        assert sum(a * (b[0] if b else 1) for a, *b in shapes) == numel


def test_cost_pattern_bytes() -> None:
    profile = load_profile("multi_nic")
    payload = 4.0 * 2560 * 2560          # one 25 MiB bucket: one 2560 x 2560 matrix
    sent = {name: sum(b for step in spec_for(name).cost(name, profile, payload, CostOptions())
                      for phase in step for _, _, b in phase) for name in ("ddp", "torch_fp16", "torch_powersgd")}
    assert sent["torch_fp16"] == pytest.approx(sent["ddp"] / 2)
    assert sent["torch_powersgd"] == pytest.approx(sent["ddp"] * (2560 + 2560) / (2560 * 2560))
