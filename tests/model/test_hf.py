"""Tests for lit_seqpack.model.hf: a randomly initialised tiny LlamaForCausalLM trained packed (CPU, fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from lit_seqpack.model.attention import override_backend, use_backend
from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func
from lit_seqpack.model.hf import (  # noqa: E402
    ATTENTION_NAME,
    hf_model_inputs,
    hf_varlen_attention,
    prepare_hf_model,
)
from lit_seqpack.model.isolation import (  # noqa: E402
    PackingLeakError,
    check_packing_equivalence,
    documents_batch,
    probe_packing_isolation,
)
from lit_seqpack.model.mixin import PackedSequenceMixin  # noqa: E402

LENGTHS = (5, 11, 3, 7)


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **overrides,
    )
    return LlamaForCausalLM(config)


def random_documents(lengths: tuple[int, ...] = LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen) for n in lengths]


def with_padding_tail(batch: dict[str, Any], pad: int) -> dict[str, Any]:
    """The batch with ``pad`` padding tokens appended as their own last segment (the collator's layout)."""
    out = dict(batch)
    total = batch["input_ids"].shape[1]
    out["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], dim=1)
    out["labels"] = torch.cat([batch["labels"], torch.full((1, pad), -100)], dim=1)
    out["position_ids"] = torch.cat([batch["position_ids"], torch.arange(pad)[None]], dim=1)
    out["cu_seqlens"] = torch.cat([batch["cu_seqlens"], torch.tensor([total + pad], dtype=torch.int32)])
    out["max_seqlen"] = max(batch["max_seqlen"], pad)
    out["num_padding_tokens"] = pad
    return out


class PlainHFModule(PackedSequenceMixin, LightningModule):
    """HF's own path, without the adapter: ``position_ids`` only and the default ``use_cache``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def seqpack_model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)


class AdaptedHFModule(PlainHFModule):
    def seqpack_model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return hf_model_inputs(batch)


def test_prepare_registers_and_switches_the_attention_implementation() -> None:
    model = prepare_hf_model(tiny_llama())
    assert model.config._attn_implementation == ATTENTION_NAME
    from transformers import AttentionInterface

    assert AttentionInterface()[ATTENTION_NAME] is hf_varlen_attention


def test_hf_model_inputs_maps_the_contract() -> None:
    packed = hf_model_inputs(documents_batch(random_documents()), backend="sdpa")
    assert packed["cu_seq_lens_q"] is packed["cu_seq_lens_k"]
    assert packed["max_length_q"] == packed["max_length_k"] == max(LENGTHS)
    assert packed["use_cache"] is False and packed["lit_seqpack_backend"] == "sdpa"
    assert "attention_mask" not in packed  # never an all-ones mask with a packed row
    padded = hf_model_inputs(documents_batch(random_documents(), packed=False))
    assert "cu_seq_lens_q" not in padded and padded["attention_mask"].shape == (4, max(LENGTHS))
    assert padded["lit_seqpack_right_padded"] is True
    left = documents_batch(random_documents(), packed=False)
    left["attention_mask"] = left["attention_mask"].flip(1)
    assert "lit_seqpack_right_padded" not in hf_model_inputs(left)


@pytest.mark.parametrize("pad", [0, 4])
def test_packed_logits_equal_per_document_logits(pad: int) -> None:
    model = prepare_hf_model(tiny_llama())
    docs = random_documents()
    batch = with_padding_tail(documents_batch(docs), pad) if pad else documents_batch(docs)
    with torch.no_grad(), use_backend("sdpa"):
        packed = model(**hf_model_inputs(batch)).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=doc[None]).logits[0]  # the stock model, one document, nothing packed
            torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=1e-5, rtol=0)
            start += len(doc)


def test_the_flash_attn_route_gets_the_right_arguments() -> None:
    """HF's q/k/v views reach a flash_attn_varlen_func-shaped kernel correctly (a CPU stand-in for the kernel)."""
    model = prepare_hf_model(tiny_llama())
    batch = with_padding_tail(documents_batch(random_documents()), 3)
    with torch.no_grad():
        expected = model(**hf_model_inputs(batch, backend="sdpa")).logits
        with override_backend("flash_attn", reference_flash_attn_varlen_func):
            routed = model(**hf_model_inputs(batch, backend="flash_attn")).logits
    torch.testing.assert_close(routed, expected, atol=1e-5, rtol=0)


def test_padded_rows_equal_rows_alone_through_the_adapter() -> None:
    model = prepare_hf_model(tiny_llama())
    report = check_packing_equivalence(model, documents_batch(random_documents(), packed=False), atol=1e-5)
    assert report.passed and len(report.document_errors) == len(LENGTHS)


def test_gradient_of_one_document_wrt_another_documents_inputs_is_exactly_zero() -> None:
    model = prepare_hf_model(tiny_llama())
    batch = documents_batch(random_documents())
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    inputs = hf_model_inputs(batch)
    del inputs["input_ids"]
    logits = model(inputs_embeds=embeds, **inputs).logits[0]
    bounds = batch["cu_seqlens"].tolist()
    for doc in range(len(LENGTHS)):
        (grad,) = torch.autograd.grad(logits[bounds[doc] : bounds[doc + 1]].sum(), embeds, retain_graph=True)
        outside = torch.ones(grad.shape[1], dtype=torch.bool)
        outside[bounds[doc] : bounds[doc + 1]] = False
        assert torch.count_nonzero(grad[0, outside]) == 0
        assert torch.count_nonzero(grad[0, ~outside]) > 0


def test_check_packing_equivalence_reports_the_leak_of_a_stock_model() -> None:
    model = tiny_llama()  # not prepared: hf_model_inputs passes cu_seq_lens, which sdpa ignores...
    batch = documents_batch(random_documents())
    # ...yet use_cache=False lets transformers mask by position_ids, so it is exact, only slower
    assert check_packing_equivalence(model, batch).passed

    class CacheOnModule(PlainHFModule):  # the user forgot use_cache=False
        pass

    report = check_packing_equivalence(CacheOnModule(tiny_llama()), batch)
    assert not report.passed and report.max_error > 1e-2
    assert report.document_errors[0] < 1e-5  # the first document has nothing before it to leak from
    with pytest.raises(PackingLeakError, match="differ from per-document logits"):
        check_packing_equivalence(CacheOnModule(tiny_llama()), batch, strict=True)


def test_first_step_check_detects_the_plain_hf_path() -> None:
    """position_ids only, default use_cache: HF attends across documents; the mixin refuses to train."""
    module = PlainHFModule(tiny_llama())
    module.train()
    with pytest.raises(PackingLeakError, match=r"does not keep the documents .* \(LlamaAttention\)"):
        module.training_step(documents_batch(random_documents()), 0)
    assert module.training and all(m.training for m in module.modules())  # the probe restored train mode


def test_first_step_check_accepts_the_adapter_and_trains() -> None:
    module = AdaptedHFModule(prepare_hf_model(tiny_llama()))
    report = probe_packing_isolation(module, documents_batch(random_documents()))
    assert report.passed
    loss = module.training_step(documents_batch(random_documents()), 0)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())


def test_unsupported_attention_settings_raise() -> None:
    model = prepare_hf_model(tiny_llama(attention_dropout=0.1))
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(**hf_model_inputs(documents_batch(random_documents())))
    q = torch.zeros(1, 4, 6, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="own attention mask"):
        hf_varlen_attention(model.model.layers[0].self_attn, q, q, q, q, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        hf_varlen_attention(model.model.layers[0].self_attn, q, q, q, None, cu_seq_lens_q=cu, max_length_q=6)


def test_documents_batch_rejects_empty_documents() -> None:
    with pytest.raises(ValueError, match="documents"):
        documents_batch([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])


def test_check_packing_equivalence_rejects_a_negative_tolerance() -> None:
    with pytest.raises(ValueError, match="atol"):
        check_packing_equivalence(tiny_llama(), documents_batch(random_documents()), atol=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_packed_logits_equal_per_document_logits_on_cuda_in_bf16(backend: str) -> None:
    """The kernel backends (flash_attn / torch_varlen when present) receive HF's transposed q/k/v views."""
    model = prepare_hf_model(tiny_llama()).to("cuda", torch.bfloat16)
    docs = [d.cuda() for d in random_documents((40, 120, 7, 64))]
    batch = documents_batch(docs)
    with torch.no_grad():
        packed = model(**hf_model_inputs(batch, backend=backend)).logits[0].float()
        start = 0
        for doc in docs:
            alone = model(input_ids=doc[None]).logits[0].float()  # HF's own sdpa path
            torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=2e-2, rtol=2e-2)
            start += len(doc)
