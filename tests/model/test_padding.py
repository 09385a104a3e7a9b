"""Right-padded batches run causal attention without a mask; any other padding keeps its dense mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_seqpack.batch import is_right_padded
from lit_seqpack.data.batching.collate import PaddedCollator
from lit_seqpack.model import reference
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder

LENGTHS = [3, 9, 1, 6, 5]


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        ([[1, 1, 1, 0], [1, 0, 0, 0]], True),
        ([[1, 1, 1, 1], [1, 1, 1, 1]], True),
        ([[1, 1, 0, 0], [0, 0, 0, 0]], True),  # a fully padded row (a lock-step filler)
        ([[1], [0]], True),
        ([[0, 1, 1, 1], [1, 1, 1, 1]], False),  # left padding
        ([[1, 1, 0, 1], [1, 1, 1, 1]], False),  # a hole
        ([[1, 1, 1, 1], [1, 0, 0, 1]], False),  # a real token at the end of a padded row
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32])
def test_is_right_padded(mask, expected, dtype):
    assert is_right_padded(torch.tensor(mask).to(dtype)) is expected


def test_is_right_padded_needs_a_two_dimensional_mask():
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, length\]"):
        is_right_padded(torch.ones(2, 1, 4))


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return ReferenceDecoder(ReferenceConfig.preset("tiny")).to(dtype)


def _padded_batch(lengths=LENGTHS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(1, 128, (n,), generator=gen)} for n in lengths]
    return PaddedCollator(pad_to_multiple_of=4)(docs)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_right_padding_gives_the_masked_loss_and_gradients(monkeypatch):
    model, batch = _model(), _padded_batch()
    assert is_right_padded(batch["attention_mask"])
    loss, grads = _loss_and_grads(model, batch)
    monkeypatch.setattr(reference, "is_right_padded", lambda mask: False)  # force the dense mask
    masked_loss, masked_grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, masked_loss, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, masked_grads[name], rtol=1e-10, atol=1e-14, msg=name)
    assert all(torch.count_nonzero(g) for g in grads.values())


class _Spy:
    """Records every dense mask built and every SDPA call of the reference decoder."""

    def __init__(self, monkeypatch):
        self.dense, self.sdpa = 0, []
        dense, sdpa = ReferenceDecoder._dense_mask, F.scaled_dot_product_attention

        def counting_dense(*args, **kwargs):
            self.dense += 1
            return dense(*args, **kwargs)

        def recording_sdpa(*args, **kwargs):
            self.sdpa.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(ReferenceDecoder, "_dense_mask", staticmethod(counting_dense))
        monkeypatch.setattr(reference.F, "scaled_dot_product_attention", recording_sdpa)


def test_right_padding_builds_no_dense_mask(monkeypatch):
    model, batch = _model(torch.float32), _padded_batch()
    spy = _Spy(monkeypatch)
    model(batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
    assert spy.dense == 0
    assert len(spy.sdpa) == model.config.n_layer
    assert all(mask is None and causal for mask, causal in spy.sdpa)


def test_left_padding_keeps_the_mask_and_the_per_document_logits(monkeypatch):
    model, batch = _model(), _padded_batch()
    right = batch["attention_mask"]
    shift = right.shape[1] - right.sum(dim=1)  # move each row's real tokens to its end
    index = (torch.arange(right.shape[1]) - shift[:, None]) % right.shape[1]
    ids, positions, mask = (batch[key].gather(1, index) for key in ("input_ids", "position_ids", "attention_mask"))
    assert not is_right_padded(mask)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        left = model(ids, position_ids=positions, attention_mask=mask)
        alone = [model(batch["input_ids"][i : i + 1, :n]) for i, n in enumerate(LENGTHS)]
    assert spy.dense == 1 and all(m is not None and not causal for m, causal in spy.sdpa[: model.config.n_layer])
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(left[i, -n:], alone[i][0], rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_right_padding_on_cuda_in_bf16_runs_without_a_mask_and_matches_the_masked_loss(monkeypatch):
    """On CUDA the maskless path is SDPA's flash kernel; the masked path is the reference (bf16 tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model(torch.bfloat16).cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _padded_batch().items()}
    spy = _Spy(monkeypatch)
    loss, grads = _loss_and_grads(model, batch)
    assert spy.dense == 0
    monkeypatch.setattr(reference, "is_right_padded", lambda mask: False)
    masked_loss, masked_grads = _loss_and_grads(model, batch)
    assert spy.dense == 1
    torch.testing.assert_close(loss.float(), masked_loss.float(), rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), masked_grads[name].float(), rtol=5e-2, atol=5e-3, msg=name)
