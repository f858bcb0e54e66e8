"""Canary's settings and engine refuse bad input by field name, before any communication."""

from __future__ import annotations

import pytest

from syncplane.algorithms.canary import CanaryConfig, CanaryEngine
from syncplane.comm import GradientSketch, Int8Blockwise
from syncplane.config import ConfigError


@pytest.mark.parametrize("field, value", [("compression", "zip"), ("exact_fraction", 1.5),
                                          ("exact_fraction", -0.1), ("quantile_weight", 2.0),
                                          ("nics", 0), ("nics", "two"), ("bucket_cap_mb", 0.0),
                                          ("first_bucket_cap_mb", 0.0),
                                          ("sync_timeout_s", -1.0), ("exchange", "tree")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        CanaryConfig(**{field: value})


def test_codec_follows_the_settings():
    assert CanaryConfig().codec() == GradientSketch()
    assert CanaryConfig(exact_fraction=0.01, quantile_weight=1.0).codec() == GradientSketch(0.01, quantile_weight=1.0)
    assert CanaryConfig(compression="int8").codec() == Int8Blockwise()


class _NoTransport:
    """Never called: the engine must refuse before it communicates."""

    def allreduce_mean_(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("communicated despite bad input")

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        pass


def test_more_pieces_than_elements_is_refused():
    with pytest.raises(ConfigError, match=r"^pieces: 4 pieces per colayer .* colayer 1's 3 elements"):
        CanaryEngine([100, 3, 50], 4, _NoTransport())
    with pytest.raises(ConfigError, match="^pieces: must be at least 1"):
        CanaryEngine([100], 0, _NoTransport())


class _Doubling:
    """A stand-in exchange that records the order colayers reach it (positions), and
    doubles them so the result is visibly the exchange's."""

    def __init__(self) -> None:
        self.offsets: list[int] = []

    def allreduce_mean_(self, flat, meter=None, *, offset=0, total=None):  # type: ignore[no-untyped-def]
        self.offsets.append(offset)
        flat.mul_(2.0)
        return True

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        pass


def test_pipeline_hands_colayers_over_in_order_whatever_order_they_complete(test_seed):
    import torch

    from syncplane.algorithms.canary import BackwardPipeline

    g = torch.Generator().manual_seed(test_seed)
    grads = [torch.randn(n, generator=g) for n in (5, 7, 3, 4)]
    transport = _Doubling()
    pipeline = BackwardPipeline(CanaryEngine([5, 7, 3, 4], 2, transport), lambda i: grads[i].clone())
    pipeline.ready(2)                    # completes early: must wait for 0 and 1
    pipeline.ready(0)
    assert pipeline.early == 1
    pipeline.ready(1)                    # releases 1, then 2
    results = pipeline.finish()          # 3 never reported ready (an unused parameter): sent now
    assert transport.offsets == [0, 5, 12, 15] and pipeline.early == 3
    for got, want in zip(results, grads):
        assert torch.equal(got, want * 2)
    pipeline.ready(1)                    # the next step starts from scratch
    assert pipeline.early == 3
    assert [torch.equal(a, b * 2) for a, b in zip(pipeline.finish(), grads)] == [True] * 4
    pipeline.close()


class _Residuals(_NoTransport):
    """A stand-in with residuals and a shape (``radices``), recording what it was given back."""

    def __init__(self, radices):  # type: ignore[no-untyped-def]
        self.radices, self.loaded = radices, []

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {"residuals": "r"}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        self.loaded.append(state)


def test_residuals_of_another_exchange_shape_are_not_loaded(caplog):
    saved = CanaryEngine([100, 50], 4, _Residuals([2, 2])).state_dict()
    assert saved["exchange"] == "_Residuals[2, 2]"
    same = _Residuals([2, 2])
    CanaryEngine([100, 50], 4, same).load_state_dict(saved)
    assert same.loaded == [{"residuals": "r"}]
    other = _Residuals([4])
    CanaryEngine([100, 50], 4, other).load_state_dict(saved)
    assert other.loaded == [] and "residuals start from zero" in caplog.text


class _CountingTransport:
    """Averages nothing: records the slices the engine hands over."""

    lanes, streams, exchange = 1, 1, None

    def __init__(self) -> None:
        self.slices: list[tuple[int, int]] = []

    def allreduce_mean_(self, flat, meter=None, *, offset=0, total=None):  # type: ignore[no-untyped-def]
        self.slices.append((offset, flat.numel()))
        return True


def test_the_bench_cuts_its_payload_into_colayers_of_bucket_cap_mb(monkeypatch):
    """The bench's row runs the colayer size it names (the cost model prices that size)."""
    import torch

    from syncplane.algorithms.canary import bench
    from syncplane.comm import CommMeter

    transport = _CountingTransport()
    monkeypatch.setattr(bench, "make_transport", lambda config, job: transport)
    monkeypatch.setattr(bench.dist, "get_world_size", lambda: 2)
    step = bench.CanaryStep({"bucket_cap_mb": 1}, job=None)  # type: ignore[arg-type]
    step(torch.zeros(3 * 2**18 + 5), 0, CommMeter())
    per = 2**18                                             # 1 MiB of fp32
    assert transport.slices == [(0, per), (per, per), (2 * per, per), (3 * per, 5)]
    default = bench.CanaryStep({}, job=None)  # type: ignore[arg-type]
    assert default.config.bucket_bytes == CanaryConfig().bucket_bytes == 25 * 2**20
    assert default.config.first_bucket_bytes == CanaryConfig().first_bucket_bytes == 4 * 2**20
    transport.slices.clear()                                # the first colayer smaller, as training cuts it
    bench.CanaryStep({"bucket_cap_mb": 1, "first_bucket_cap_mb": 0.25}, job=None)(  # type: ignore[arg-type]
        torch.zeros(2 * per + 7), 0, CommMeter())
    quarter = per // 4
    assert transport.slices == [(0, quarter), (quarter, per), (quarter + per, per - quarter + 7)]


def test_the_first_colayer_holds_the_last_layers_up_to_its_own_cap():
    """Training's colayers: backward order (the model's last parameters first), the first
    closed at ``first_bucket_cap_mb``, never above ``bucket_cap_mb``."""
    import torch

    from syncplane.algorithms.canary.colayers import Colayers

    params = [torch.zeros(n) for n in (300, 200, 100, 50, 50)]     # fp32: 4 bytes each
    config = CanaryConfig(bucket_cap_mb=1600 / 2**20, first_bucket_cap_mb=400 / 2**20)
    colayers = Colayers(params, config.bucket_bytes, config.first_bucket_bytes)
    assert colayers.sizes == [100, 300, 300] and colayers.counts() == [2, 2, 1]
    assert Colayers(params, config.bucket_bytes).sizes == [400, 300]
    assert CanaryConfig(bucket_cap_mb=1, first_bucket_cap_mb=8).first_bucket_bytes == 2**20
