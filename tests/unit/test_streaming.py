"""Streaming DiLoCo's fragments without processes: the cut, the schedule, per-fragment
outer state, and the configuration errors of ``diloco``'s streaming options."""

from __future__ import annotations

import pytest
import torch

from syncplane.algorithms.diloco.streaming import FragmentedOuter, fragment_bounds, fragment_offsets


def test_fragments_split_the_parameters_evenly_and_the_buffers_join_the_last_one():
    assert fragment_bounds(49, extra=0, fragments=1) == [(0, 49)]
    assert fragment_bounds(49, extra=0, fragments=3) == [(0, 17), (17, 33), (33, 49)]
    assert fragment_bounds(49, extra=6, fragments=2) == [(0, 25), (25, 55)]


def test_more_fragments_than_parameter_values_is_refused_with_both_numbers():
    with pytest.raises(ValueError, match="cannot split 4 parameter values into 5 fragments"):
        fragment_bounds(4, extra=0, fragments=5)


def test_offsets_spread_over_the_round():
    assert fragment_offsets(10, 3) == [0, 3, 6]
    assert fragment_offsets(10, 1) == [0]


def _identity_average(flat: torch.Tensor, offset: int) -> bool:
    return True   # one rank: the mean is the rank's own value


def test_each_fragment_has_its_own_momentum():
    """Two fragments, outer SGD with momentum: after rounds of fragment 0 only, fragment 1's θ_g
    has not moved and fragment 0 followed torch's SGD exactly as if it were alone."""
    initial = torch.arange(6, dtype=torch.float32)
    flat = initial.clone()
    outer = FragmentedOuter(flat, 6, fragments=2, sync_every=4, optimizer="torch.optim.SGD",
                            kwargs={"lr": 0.5, "momentum": 0.9}, pin=False)
    alone = initial[:3].clone().requires_grad_(True)
    reference = torch.optim.SGD([alone], lr=0.5, momentum=0.9)
    for k in range(3):
        local = initial + k + 1.0                 # the replica moved by k + 1 everywhere
        flat.copy_(local)
        outer.launch(0, _identity_average, due=4 * k, background=False)
        merged = outer.pop(0)
        assert merged.committed and merged.due == 4 * k
        alone.grad = alone.detach() - local[:3]
        reference.step()
        assert torch.equal(flat[:3], alone.detach())   # what the caller merges into the model
    assert torch.equal(outer.params[:3], alone.detach())
    assert torch.equal(outer.params[3:], initial[3:])
    assert outer.outers[1].optimizer.state_dict()["state"] == {}


def test_a_round_in_the_background_is_merged_at_its_due_step_and_survives_a_state_dict():
    flat = torch.zeros(3)
    outer = FragmentedOuter(flat, 2, fragments=2, sync_every=2, optimizer="torch.optim.SGD",
                            kwargs={"lr": 1.0}, pin=False)
    assert outer.starting(1) == [1] and outer.starting(2) == [0]
    flat.fill_(2.0)
    outer.launch(1, _identity_average, due=2, background=True)
    assert outer.pop_due(1) == []
    outer.wait()                     # e.g. a checkpoint: exchange done, merge still scheduled
    state = outer.state_dict()
    assert [(r["fragment"], r["due"], r["committed"]) for r in state["pending"]] == [(1, 2, True)]
    # fragment 1 = [one parameter | one extra]: lr 1 makes θ_g the mean θ_local; the extra is averaged
    assert torch.equal(state["pending"][0]["merge"], torch.full((2,), 2.0))

    restored = FragmentedOuter(torch.zeros(3), 2, fragments=2, sync_every=2, optimizer="torch.optim.SGD",
                               kwargs={"lr": 1.0}, pin=False)
    restored.load_state_dict(state)
    for fragments in (outer, restored):
        (merged,) = fragments.pop_due(2)
        assert merged.fragment == 1 and torch.equal(fragments.flat[1:], torch.full((2,), 2.0))
        assert not fragments.pending
    outer.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fragments": 0}, r"fragments=0, overlap_steps=0, sync_every=10: .*1 <= fragments <= sync_every"),
    ({"fragments": 11}, r"fragments=11, overlap_steps=0, sync_every=10: .*1 <= fragments <= sync_every"),
    ({"fragments": 3, "overlap_steps": 3}, r"fragments=3, overlap_steps=3, .*0 <= overlap_steps < sync_every // "),
    ({"overlap_steps": -1}, r"overlap_steps=-1, .*0 <= overlap_steps < sync_every // fragments"),
    ({"overlap_steps": 1, "mix_alpha": 1.0}, r"mix_alpha must be in \[0, 1\) .*got 1.0"),
    ({"overlap_steps": 1, "mix_alpha": -0.1}, r"mix_alpha must be in \[0, 1\) .*got -0.1"),
])
def test_bad_streaming_configuration_names_the_values(kwargs, message):
    from syncplane.strategies.diloco import DiLoCo

    with pytest.raises(ValueError, match=message):
        DiLoCo(sync_every=10, **kwargs)


def test_mix_alpha_defaults_to_the_papers_half_with_overlap_and_to_overwrite_without():
    from syncplane.strategies.diloco import DiLoCo

    assert DiLoCo(sync_every=10, fragments=2, overlap_steps=1).mix_alpha == 0.5
    assert DiLoCo(sync_every=10, fragments=2).mix_alpha == 0.0
    assert DiLoCo(sync_every=10, mix_alpha=0.5).mix_alpha == 0.5   # blocking rounds mix too (test_diloco_fake)
