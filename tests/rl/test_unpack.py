"""Per-token values back to per-sample tensors, per-document sums and per-document values on tokens."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.rl.unpack import document_index, document_sums, per_document_to_tokens, unpack

SAMPLES = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 2, 3, 4]}]


@pytest.mark.parametrize("collator", [PackedCollator(pad_to_multiple_of=16), PaddedCollator(pad_to_multiple_of=8)])
def test_unpack_returns_each_document_in_order(collator) -> None:
    batch = collator(SAMPLES)
    values = batch["input_ids"].double() * 10
    assert [v.tolist() for v in unpack(values, batch)] == [[50, 60, 70], [80, 90], [10, 20, 30, 40]]
    assert document_sums(values, batch).tolist() == [180.0, 170.0, 100.0]
    expanded = per_document_to_tokens(torch.tensor([1.0, 2.0, 3.0]), batch, fill=-1.0)
    assert [v.tolist() for v in unpack(expanded, batch)] == [[1.0] * 3, [2.0] * 2, [3.0] * 4]
    assert (expanded[document_index(batch) < 0] == -1.0).all()


def test_unpack_keeps_trailing_dimensions_and_gradients() -> None:
    batch = PackedCollator()(SAMPLES)
    values = torch.randn(1, 9, 4, requires_grad=True)
    parts = unpack(values, batch)
    assert [tuple(p.shape) for p in parts] == [(3, 4), (2, 4), (4, 4)]
    document_sums(values[..., 0], batch).sum().backward()
    assert values.grad[0, :, 0].eq(1).all() and values.grad[0, :, 1:].eq(0).all()


def test_a_filler_batch_has_no_document() -> None:
    batch = PackedCollator(pad_to_multiple_of=4)([])
    assert unpack(torch.zeros(1, 4), batch) == [] and document_sums(torch.zeros(1, 4), batch).numel() == 0


def test_unpack_refuses_values_of_another_shape() -> None:
    batch = PaddedCollator()(SAMPLES)
    with pytest.raises(ValueError, match=r"values must start with the batch's shape \(3, 4\)"):
        unpack(torch.zeros(3, 5), batch)
