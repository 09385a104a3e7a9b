"""Tests for lit_seqpack.model.loss: token cross-entropy with the HF shift and the exact normalisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_seqpack.model.loss import (
    IGNORE_INDEX,
    LossOutput,
    exact_loss,
    sequence_cross_entropy,
    shift_labels,
    token_cross_entropy,
)


def _reference_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Loop over rows and positions: the textbook definition, no vectorised trick."""
    total = logits.new_zeros(())
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target != IGNORE_INDEX:
                total = total - torch.log_softmax(logits[b, t], dim=-1)[target]
    return total


@pytest.fixture
def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[:, 0] = IGNORE_INDEX
    labels[1, 4:] = IGNORE_INDEX  # right padding
    labels[2, 2] = IGNORE_INDEX  # a masked prompt token
    return logits, labels


def test_shift_labels_moves_targets_left_and_ignores_the_last_position() -> None:
    labels = torch.tensor([[-100, 1, 2, 3], [-100, 4, -100, -100]])
    assert shift_labels(labels).tolist() == [[1, 2, 3, -100], [4, -100, -100, -100]]


def test_token_cross_entropy_matches_the_definition(padded_batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, labels = padded_batch
    out = token_cross_entropy(logits, labels)
    torch.testing.assert_close(out.loss_sum, _reference_sum(logits, labels), rtol=1e-12, atol=1e-12)
    assert out.num_units == int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert out.step_units is None
    assert out.loss_sum.dtype == torch.float64  # float64 logits are not downcast


def test_token_cross_entropy_equals_hf_style_sliced_mean(padded_batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, labels = padded_batch
    out = token_cross_entropy(logits, labels)
    sliced = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.loss_sum / out.num_units, sliced)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 100])
def test_chunked_loss_and_gradient_equal_unchunked(
    padded_batch: tuple[torch.Tensor, torch.Tensor], chunk_size: int
) -> None:
    logits, labels = padded_batch
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    full = token_cross_entropy(a, labels)
    chunked = token_cross_entropy(b, labels, chunk_size=chunk_size)
    full.loss_sum.backward()
    chunked.loss_sum.backward()
    torch.testing.assert_close(chunked.loss_sum, full.loss_sum)
    torch.testing.assert_close(b.grad, a.grad)


def test_half_precision_logits_are_upcast() -> None:
    logits = torch.randn(1, 5, 9).to(torch.bfloat16)
    labels = torch.tensor([[-100, 1, 2, 3, 4]])
    out = token_cross_entropy(logits, labels, chunk_size=2)
    assert out.loss_sum.dtype == torch.float32
    torch.testing.assert_close(out.loss_sum, _reference_sum(logits.float(), labels))


def test_given_counts_are_passed_through() -> None:
    out = token_cross_entropy(torch.zeros(1, 3, 4), torch.tensor([[-100, 1, 2]]), num_loss_tokens=2, step_loss_tokens=9)
    assert (out.num_units, out.step_units) == (2, 9)


def test_all_ignored_labels_give_a_zero_that_is_connected_to_the_logits() -> None:
    logits = torch.randn(1, 4, 5, requires_grad=True)
    out = token_cross_entropy(logits, torch.full((1, 4), IGNORE_INDEX))
    assert out.num_units == 0 and out.loss_sum.item() == 0.0
    out.loss_sum.backward()
    assert logits.grad is not None and torch.count_nonzero(logits.grad) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logits": torch.zeros(2, 3), "labels": torch.zeros(2, 3, dtype=torch.long)}, "logits must be"),
        ({"logits": torch.zeros(1, 3, 4), "labels": torch.zeros(1, 2, dtype=torch.long)}, "labels"),
        ({"logits": torch.zeros(1, 3, 4), "labels": torch.zeros(1, 3, dtype=torch.long), "chunk_size": 0}, "chunk"),
    ],
)
def test_token_cross_entropy_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        token_cross_entropy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_sum": torch.zeros(2), "num_units": 1}, "scalar"),
        ({"loss_sum": torch.zeros(()), "num_units": -1}, "num_units"),
        ({"loss_sum": torch.zeros(()), "num_units": 5, "step_units": 4}, "step_units"),
    ],
)
def test_loss_output_validates(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossOutput(**kwargs)


def test_exact_loss_cancels_accumulation_and_rank_averaging() -> None:
    """k microbatches on W ranks, each divided by k (Lightning) and averaged over W (DDP): token mean of the step."""
    sums, counts = [3.0, 5.0, 1.5, 0.5, 2.0, 4.0], [3, 4, 1, 2, 2, 6]  # W=2 ranks x k=3 microbatches
    step_units, world_size, k = sum(counts), 2, 3
    batch = {"world_size": world_size, "accumulate_grad_batches": k}
    returned = [
        exact_loss(LossOutput(loss_sum=torch.tensor(s), num_units=n, step_units=step_units), batch)
        for s, n in zip(sums, counts, strict=True)
    ]
    per_rank = [sum(r / k for r in returned[i * k : (i + 1) * k]) for i in range(world_size)]
    assert sum(per_rank) / world_size == pytest.approx(sum(sums) / step_units)


def test_exact_loss_without_step_units_is_the_local_mean() -> None:
    out = LossOutput(loss_sum=torch.tensor(6.0), num_units=4)
    assert exact_loss(out, {"world_size": 8, "accumulate_grad_batches": 2}).item() == pytest.approx(1.5)


def test_exact_loss_of_a_step_without_targets_is_a_connected_zero() -> None:
    logits = torch.randn(1, 3, 4, requires_grad=True)
    out = token_cross_entropy(logits, torch.full((1, 3), IGNORE_INDEX), step_loss_tokens=0)
    loss = exact_loss(out, {"world_size": 2, "accumulate_grad_batches": 2})
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None


def test_sequence_cross_entropy_weighs_documents_equally_in_a_packed_row() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 10, 6, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 6, (1, 10), generator=gen)
    cu_seqlens = torch.tensor([0, 3, 8, 10], dtype=torch.int32)  # two documents and a padding tail [8, 10)
    labels[0, [0, 3, 8, 9]] = IGNORE_INDEX
    out = sequence_cross_entropy(logits, labels, cu_seqlens=cu_seqlens, num_documents=2, step_documents=6)
    doc_means = [
        _reference_sum(logits[:, s:e], labels[:, s:e]) / int((labels[0, s + 1 : e] != IGNORE_INDEX).sum())
        for s, e in [(0, 3), (3, 8)]
    ]
    torch.testing.assert_close(out.loss_sum, sum(doc_means))
    assert (out.num_units, out.step_units) == (2, 6)


def test_sequence_cross_entropy_takes_padded_rows_as_documents(padded_batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, labels = padded_batch
    out = sequence_cross_entropy(logits, labels)
    row_means = [
        _reference_sum(logits[b : b + 1], labels[b : b + 1]) / int((labels[b, 1:] != IGNORE_INDEX).sum())
        for b in range(3)
    ]
    torch.testing.assert_close(out.loss_sum, sum(row_means))
    assert out.num_units == 3 and out.step_units is None


def test_sequence_cross_entropy_rejects_a_packed_batch_with_several_rows() -> None:
    with pytest.raises(ValueError, match="batch size 1"):
        sequence_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3).long(), cu_seqlens=torch.tensor([0, 3]))


def test_weighted_token_loss_is_the_weighted_sum_chunked_or_not():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    labels[0, 2] = -100
    weights = torch.rand(2, 5, dtype=torch.float64)
    out = token_cross_entropy(logits, labels, weights=weights)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none")
    w = torch.where(labels[:, 1:] != -100, weights[:, 1:], 0.0).reshape(-1)
    torch.testing.assert_close(out.loss_sum, (w * ce).sum())
    assert out.num_units == pytest.approx(float(w.sum()))
    chunked = token_cross_entropy(logits, labels, weights=weights, chunk_size=3)
    torch.testing.assert_close(chunked.loss_sum, out.loss_sum)
    with pytest.raises(ValueError, match="weights must have the shape of labels"):
        token_cross_entropy(logits, labels, weights=weights[:, :4])
