"""Sampling and the generation loop (lit_seqpack.generate), on hand-made logits: no model needed."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.generate import generate_ids, next_token

LOGITS = torch.tensor([1.0, 3.0, 2.9, -2.0, 0.5])


def test_greedy_is_the_argmax_whatever_the_seed():
    picks = {next_token(LOGITS, generator=torch.Generator().manual_seed(seed)) for seed in range(5)}
    assert picks == {1}


def test_sampling_honours_the_seed_and_spreads_over_tokens():
    def draw(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [next_token(LOGITS, temperature=1.0, generator=generator) for _ in range(50)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    assert len(set(draw(3))) >= 3


def test_top_p_keeps_the_smallest_set_that_reaches_the_mass():
    probs = torch.softmax(LOGITS, dim=-1)  # 1 and 2 hold ~0.75 of the mass together
    mass = float(probs[1] + probs[2])
    generator = torch.Generator().manual_seed(0)
    picks = {next_token(LOGITS, temperature=1.0, top_p=mass - 1e-3, generator=generator) for _ in range(200)}
    assert picks == {1, 2}


@pytest.mark.parametrize(("setting", "value"), [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5)])
def test_bad_sampling_settings_are_named(setting, value):
    with pytest.raises(ValueError, match=setting):
        next_token(LOGITS, **{setting: value})


def _counting(ids: torch.Tensor) -> torch.Tensor:
    """Logits that always predict the next id (mod 5)."""
    return torch.eye(5)[(ids + 1) % 5]


def test_generation_stops_at_the_models_row_length_and_refuses_a_full_prompt():
    assert generate_ids(_counting, [0, 1], max_new_tokens=10, max_len=4) == [2, 3]
    with pytest.raises(ValueError, match="prompt has 4 tokens, but the model accepts rows of at most 4"):
        generate_ids(_counting, [0, 1, 2, 3], max_len=4)
    with pytest.raises(ValueError, match="no token"):
        generate_ids(_counting, [])
