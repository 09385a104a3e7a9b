"""The per-document budget, the over-long policy applied at it, and the loss tokens of its views."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lit_seqpack.data.settings import apply_document_budget, document_budget, planned_lengths, view_loss_tokens


@pytest.mark.parametrize(
    ("max_tokens", "mode", "multiple", "expected"),
    [(100, "packing", 16, 96), (96, "packing", 16, 96), (100, "packing", 1, 100), (100, "dynamic", 16, 100)],
)
def test_document_budget_rounds_down_in_packing_only(max_tokens, mode, multiple, expected):
    got = document_budget(max_tokens, mode=mode, pad_to_multiple_of=multiple, document_multiple=multiple)
    assert got == expected


def test_document_budget_too_small_names_the_settings_and_context_parallelism():
    with pytest.raises(
        ValueError, match=r"max_tokens=8 cannot hold a single document: pad_to_multiple_of=4 .* 16 tokens"
    ):
        document_budget(8, mode="packing", pad_to_multiple_of=4, document_multiple=16)
    with pytest.raises(ValueError, match="with context parallelism"):
        document_budget(8, mode="packing", pad_to_multiple_of=4, document_multiple=16)
    with pytest.raises(ValueError) as err:
        document_budget(8, mode="packing", pad_to_multiple_of=16, document_multiple=16)
    assert "context parallelism" not in str(err.value)


def test_planned_lengths_pads_each_document_up():
    lengths = np.array([1, 8, 9, 16])
    assert planned_lengths(lengths, 1) is lengths
    assert planned_lengths(lengths, 8).tolist() == [8, 8, 16, 16]


def _data(lengths):
    # labels mask the first half of each sample, so a cut sample has fewer loss tokens than its length says
    return [{"input_ids": list(range(n)), "labels": [-100] * (n // 2) + list(range(n // 2, n))} for n in lengths]


def test_view_loss_tokens_drops_and_recounts():
    lengths = np.array([4, 12, 6])
    data = _data(lengths)
    loss = np.array([2, 6, 3])
    assert view_loss_tokens(data, lengths, loss) is loss
    kw = {"max_tokens": 10, "mode": "packing", "pad_to_multiple_of": 1, "document_multiple": 1}
    view, view_lengths, view_loss, report = apply_document_budget(data, lengths, loss, overlong="drop", **kw)
    assert (view_lengths.tolist(), view_loss.tolist(), report.num_dropped) == ([4, 6], [2, 3], 1)
    view, view_lengths, view_loss, report = apply_document_budget(data, lengths, loss, overlong="truncate", **kw)
    # sample 1 keeps input_ids[:10]; its labels[1:10] hold 6..9 unmasked -> 4 loss tokens
    assert (view_lengths.tolist(), view_loss.tolist(), report.num_truncated) == ([4, 10, 6], [2, 4, 3], 1)


def test_apply_document_budget_explains_a_rounded_down_budget(caplog):
    lengths = np.array([4, 10])
    data, loss = _data(lengths), np.array([2, 5])
    kw = {"max_tokens": 10, "mode": "packing", "pad_to_multiple_of": 4, "document_multiple": 4}
    with pytest.raises(ValueError, match=r"\(max_tokens=10 holds documents of at most 8 tokens because pad_to_mult"):
        apply_document_budget(data, lengths, loss, overlong="error", **kw)
    with caplog.at_level(logging.INFO):
        _, view_lengths, _, report = apply_document_budget(data, lengths, loss, overlong="truncate", **kw)
    assert view_lengths.tolist() == [4, 8] and report.max_tokens == 8
    assert any("at most 8 tokens" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
