"""``scripts/calibrate_tcp.py``'s fit: the one-flow goodput and the per-flow loss from the
measured / formula ratios of 1, 2 and 4 flows on a link (its measurements need the emulator:
``docs/calibration/``)."""

from __future__ import annotations

import numpy as np
import pytest

from syncplane.cluster.cost import LinkTcp
from tests.helpers.scripts import load_script


@pytest.mark.parametrize("goodput, loss", [(0.886, 0.0), (0.86, 0.06), (0.7, 0.2)])
def test_the_fit_recovers_the_terms_that_priced_the_ratios(goodput: float, loss: float) -> None:
    tcp = LinkTcp(goodput=goodput, per_flow_loss=loss)
    ratios = {k: 1.0 / float(tcp.factor(np.array([float(k)]))[0]) for k in (1, 2, 4)}
    assert load_script("calibrate_tcp").fit_sharing(ratios) == pytest.approx((goodput, loss), abs=1e-9)


def test_a_noisy_point_is_fitted_by_least_squares_through_the_one_flow_ratio() -> None:
    fitted_goodput, fitted_loss = load_script("calibrate_tcp").fit_sharing({1: 1.13, 2: 1.13, 4: 1.39})
    assert fitted_goodput == pytest.approx(1 / 1.13)
    assert fitted_loss == pytest.approx((0 * 1 + (1.39 / 1.13 - 1) * 3) / (1 + 9))
