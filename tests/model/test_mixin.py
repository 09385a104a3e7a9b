"""Tests for lit_seqpack.model.mixin: routing, exact normalisation, the layout check, hooks, dummies, logging."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer

from lit_seqpack.model.attention import varlen_attention
from lit_seqpack.model.isolation import PackingLeakError, documents_batch
from lit_seqpack.model.loss import LossOutput, sequence_cross_entropy, token_cross_entropy
from lit_seqpack.model.mixin import PackedSequenceMixin, is_packed_batch

VOCAB = 16


class TinyLM(PackedSequenceMixin, LightningModule):
    """One causal attention layer: varlen on packed rows, SDPA on padded rows (right padding needs no mask)."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.pos = torch.nn.Embedding(64, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(8, VOCAB)
        self.leak = leak
        self.calls: list[set[str]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        given = {"position_ids": position_ids, "cu_seqlens": cu_seqlens, "attention_mask": attention_mask}
        self.calls.append({k for k, v in given.items() if v is not None})
        x = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).unbind(2)  # [B, T, heads=2, 4]
        if cu_seqlens is not None and not self.leak:
            attn = varlen_attention(q[0], k[0], v[0], cu_seqlens, max_seqlen, backend="sdpa")[None]
        else:  # plain causal attention over the whole row: crosses document boundaries when packed
            attn = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            attn = attn.transpose(1, 2)
        return self.head(x + attn.reshape(x.shape))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _docs(lengths: tuple[int, ...] = (4, 6, 3), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def _with_meta(batch: dict[str, Any], *, step_loss_tokens: int, world_size: int = 1, accumulate: int = 1) -> dict:
    return {
        **batch,
        "step_loss_tokens": step_loss_tokens,
        "world_size": world_size,
        "accumulate_grad_batches": accumulate,
    }


def _dummy(length: int = 5) -> dict[str, Any]:
    batch = documents_batch([torch.zeros(length, dtype=torch.long)])
    batch.update(labels=torch.full((1, length), -100), num_documents=0, num_real_tokens=0)
    batch.update(num_padding_tokens=length, num_loss_tokens=0, is_empty=True)
    return batch


class _Loader(torch.utils.data.DataLoader):
    def __init__(self, batches: list[dict[str, Any]]) -> None:
        super().__init__(batches, batch_size=None, shuffle=False)


def _trainer(**kwargs: Any) -> Trainer:
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False}
    return Trainer(**defaults, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_packed_rows_get_cu_seqlens_and_padded_rows_get_an_attention_mask() -> None:
    model = TinyLM()
    packed, padded = documents_batch(_docs()), documents_batch(_docs(), packed=False)
    assert is_packed_batch(packed) and not is_packed_batch(padded)
    model.seqpack_forward(packed)
    model.seqpack_forward(padded)
    assert model.calls == [{"position_ids", "cu_seqlens"}, {"position_ids", "attention_mask"}]
    assert model.seqpack_model_inputs(packed)["max_seqlen"] == 6


def test_training_step_returns_the_exactly_scaled_loss_sum() -> None:
    model = TinyLM()
    batch = _with_meta(documents_batch(_docs()), step_loss_tokens=40, world_size=2, accumulate=4)
    loss = model.training_step(batch, 0)
    expected = token_cross_entropy(model.seqpack_forward(batch), batch["labels"]).loss_sum * 2 * 4 / 40
    torch.testing.assert_close(loss, expected)


def test_without_plan_metadata_the_loss_is_the_microbatch_token_mean() -> None:
    model = TinyLM()
    batch = documents_batch(_docs())  # step_loss_tokens == num_loss_tokens, world_size = accumulation = 1
    logits = model.seqpack_forward(batch)
    expected = F.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100)
    torch.testing.assert_close(model.training_step(batch, 0), expected)


@pytest.mark.parametrize(("world_size", "accumulate"), [(1, 3), (2, 2)])
def test_a_batch_planned_for_another_layout_fails_naming_both_values(world_size: int, accumulate: int) -> None:
    model = TinyLM()
    batch = _with_meta(documents_batch(_docs()), step_loss_tokens=40, world_size=world_size, accumulate=accumulate)
    with pytest.raises(
        ValueError,
        match=rf"world_size={world_size}, accumulate_grad_batches={accumulate}.*"
        r"trainer runs world_size=1, accumulate_grad_batches=2",
    ):
        _trainer(max_steps=1, accumulate_grad_batches=2).fit(model, _Loader([batch, batch]))


def test_matching_layout_trains_and_logs_the_unscaled_token_mean() -> None:
    model = TinyLM()
    batch = _with_meta(documents_batch(_docs()), step_loss_tokens=100, accumulate=2)
    trainer = _trainer(max_steps=1, accumulate_grad_batches=2)
    trainer.fit(model, _Loader([batch, batch]))
    with torch.no_grad():
        out = token_cross_entropy(model.seqpack_forward(batch), batch["labels"])
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(out.loss_sum.item() / out.num_units)


class SequenceMeanLM(TinyLM):
    def seqpack_loss(self, logits: torch.Tensor, batch: dict[str, Any]) -> LossOutput:
        return sequence_cross_entropy(
            logits, batch["labels"], cu_seqlens=batch.get("cu_seqlens"), num_documents=batch.get("num_documents")
        )


def test_the_loss_hook_replaces_the_loss_and_its_normalisation() -> None:
    model = SequenceMeanLM()
    docs = _docs()
    batch = _with_meta(documents_batch(docs), step_loss_tokens=40, world_size=2, accumulate=4)
    loss = model.training_step(batch, 0)
    per_doc = []
    for doc in docs:  # each document alone, its own token mean
        logits = model.seqpack_forward(documents_batch([doc]))
        per_doc.append(F.cross_entropy(logits[0, :-1], doc[1:]))
    torch.testing.assert_close(loss, torch.stack(per_doc).mean())  # step_units=None: the local mean
    # a local-mean loss does not depend on the plan layout, so a mismatched batch is accepted
    _trainer(max_steps=1, accumulate_grad_batches=2).fit(SequenceMeanLM(), _Loader([batch, batch]))


def test_a_dummy_batch_gives_a_connected_zero_and_is_not_logged() -> None:
    model = TinyLM()
    loss = model.training_step(_dummy(), 0)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    trainer = _trainer(max_steps=1)
    trainer.fit(TinyLM(), _Loader([_dummy()]))
    assert "train/loss" not in trainer.callback_metrics


def test_validation_loss_is_token_weighted_over_batches_and_dummies_weigh_nothing() -> None:
    model = TinyLM()
    batches = [documents_batch(_docs((3, 2))), _dummy(), documents_batch(_docs((9, 7, 8), seed=1))]
    trainer = _trainer()
    trainer.validate(model, _Loader(batches), verbose=False)
    sums, tokens = 0.0, 0
    with torch.no_grad():
        for batch in (batches[0], batches[2]):
            out = token_cross_entropy(model.seqpack_forward(batch), batch["labels"])
            sums, tokens = sums + out.loss_sum.item(), tokens + out.num_units
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(sums / tokens, rel=1e-6)
    trainer.test(model, _Loader(batches), verbose=False)
    assert trainer.callback_metrics["test/loss"].item() == pytest.approx(sums / tokens, rel=1e-6)


def test_an_eval_batch_without_loss_tokens_is_still_logged_with_zero_weight(monkeypatch) -> None:
    """Eval logs are reduced across ranks: a rank that skipped one would desynchronise the collectives."""
    model, logged = TinyLM(), []
    monkeypatch.setattr(model, "_seqpack_log", lambda stage, value, weight: logged.append((stage, weight)))
    batch = documents_batch(_docs((3, 2)))
    batch.update(labels=torch.full_like(batch["labels"], -100), num_loss_tokens=0)
    model.seqpack_step(batch, "validate")
    model.seqpack_step(batch, "train")
    assert logged == [("validate", 0)]


def test_a_model_attending_across_documents_is_refused_at_the_first_packed_step() -> None:
    with pytest.raises(PackingLeakError, match="TinyLM does not keep the documents of a packed row apart"):
        TinyLM(leak=True).training_step(documents_batch(_docs()), 0)
    # padded batches cannot leak: causal attention never reads the right padding
    TinyLM(leak=True).training_step(documents_batch(_docs(), packed=False), 0)


def test_the_probe_runs_once_per_module() -> None:
    model = TinyLM()
    model.training_step(documents_batch(_docs()), 0)
    probe_calls = len(model.calls) - 1
    assert probe_calls == 1  # one packed row of three documents, then gradients
    model.calls.clear()
    model.training_step(documents_batch(_docs()), 1)
    assert len(model.calls) == 1


def test_an_unknown_stage_is_rejected() -> None:
    with pytest.raises(ValueError, match="stage"):
        TinyLM().seqpack_step(documents_batch(_docs()), "predict")
