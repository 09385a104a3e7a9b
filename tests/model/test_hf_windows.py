"""Sliding windows, softcaps and sinks on packed rows, against the STOCK eager transformers model per document.

fp32, CPU. Each configuration has documents longer than its window, so a window that were ignored (or off by one)
would show; Gemma2 alternates sliding and full layers and caps its attention logits at 50; GPT-OSS has sinks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lit_seqpack.model.hf import hf_model_inputs, hf_varlen_attention, prepare_hf_model  # noqa: E402
from lit_seqpack.model.isolation import documents_batch  # noqa: E402
from tests.model._hf_tiny import TINY_HF  # noqa: E402

TINY = {**TINY_HF, "head_dim": 8}
WINDOW = 16
CONFIGS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 8},
    # at random init the scores are small: a cap of 0.05 is where tanh bites (50 alone would test little)
    "gemma2-tight-cap": {"sliding_window": WINDOW, "attn_logit_softcapping": 0.05, "query_pre_attn_scalar": 8},
    "gpt_oss": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "cohere2": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 8,
    },
}
LENGTHS = (40, 37, 9, 44)


def stock_eager(name: str, seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(name.split("-")[0], **{**TINY, **CONFIGS[name], **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    for module in model.modules():  # GPT-OSS initialises its sinks near 0: make them matter
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            module.sinks.data = torch.randn_like(module.sinks) * 2
    return model


def documents(lengths: tuple[int, ...] = LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen) for n in lengths]


def per_document(model: Any, docs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])


@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_packed_row_equals_the_stock_eager_model_per_document(model_type: str, backend: str) -> None:
    from lit_seqpack.model.attention import override_backend
    from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func

    stock = stock_eager(model_type)
    model = prepare_hf_model(copy.deepcopy(stock))
    docs = documents()
    expected = per_document(stock, docs)
    with torch.no_grad(), override_backend("flash_attn", reference_flash_attn_varlen_func):
        if backend == "flash_attn" and model_type == "gpt_oss":  # flash-attn 2 has no sinks: refused by name
            with pytest.raises(RuntimeError, match="cannot honour sinks"):
                model(**hf_model_inputs(documents_batch(docs), backend=backend))
            return
        packed = model(**hf_model_inputs(documents_batch(docs), backend=backend)).logits[0]
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("model_type", "overrides"), [("mistral", {"sliding_window": 10**4}),
                                                       ("gemma2-tight-cap", {"attn_logit_softcapping": None}),
                                                       ("gpt_oss", {})])  # fmt: skip
def test_the_windows_softcaps_and_sinks_change_the_result(model_type: str, overrides: dict[str, Any]) -> None:
    """The comparison above is not vacuous: without the feature the stock model computes something else."""
    docs = documents()
    plain = stock_eager(model_type, **overrides)
    if model_type == "gpt_oss":
        for module in plain.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.data.fill_(-1e4)  # no sink mass
    assert (per_document(stock_eager(model_type), docs) - per_document(plain, docs)).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gpt_oss"])
def test_cross_document_gradient_is_exactly_zero(model_type: str) -> None:
    model = prepare_hf_model(stock_eager(model_type))
    batch = documents_batch(documents((20, 30, 9)))
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    inputs = hf_model_inputs(batch)
    del inputs["input_ids"]
    logits = model(inputs_embeds=embeds, **inputs).logits[0]
    bounds = batch["cu_seqlens"].tolist()
    for doc in range(len(bounds) - 1):
        (grad,) = torch.autograd.grad(logits[bounds[doc] : bounds[doc + 1]].sum(), embeds, retain_graph=True)
        outside = torch.ones(grad.shape[1], dtype=torch.bool)
        outside[bounds[doc] : bounds[doc + 1]] = False
        assert torch.count_nonzero(grad[0, outside]) == 0
        assert torch.count_nonzero(grad[0, ~outside]) > 0


def test_sink_gradients_reach_the_parameters() -> None:
    model = prepare_hf_model(stock_eager("gpt_oss"))
    model(**hf_model_inputs(documents_batch(documents((12, 7))))).logits.sum().backward()
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    assert sinks and all(s.grad is not None and torch.count_nonzero(s.grad) > 0 for s in sinks)


class FakeLayer(torch.nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True


def test_a_sliding_layer_that_hides_its_window_is_refused() -> None:
    """The window must reach the attention function: a window only in the mask would be lost on a packed row."""
    config = AutoConfig.for_model("mistral", sliding_window=8)
    q = torch.zeros(1, 4, 6, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 6, "max_length_k": 6}
    with pytest.raises(ValueError, match="sliding-window layer.*sliding_window=None"):
        hf_varlen_attention(FakeLayer(config, 0), q, q, q, None, **packed)
    with pytest.raises(ValueError, match="sliding_window=7"):
        hf_varlen_attention(FakeLayer(config, 0), q, q, q, None, sliding_window=7, **packed)
    chunked = AutoConfig.for_model("llama", layer_types=["chunked_attention"], num_hidden_layers=1)
    with pytest.raises(ValueError, match="'chunked_attention' layer"):
        hf_varlen_attention(FakeLayer(chunked, 0), q, q, q, None, **packed)
    with pytest.raises(ValueError, match="position_bias"):
        hf_varlen_attention(FakeLayer(AutoConfig.for_model("llama"), 0), q, q, q, None, position_bias=q, **packed)


@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
def test_a_decoder_layer_that_drops_the_packing_keywords_is_named(model_type: str) -> None:
    """StableLM / Nemotron layers do not pass **kwargs on: the attention would see no boundaries."""
    from lit_seqpack.model.isolation import PackingLeakError

    config = AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items() if k != "head_dim"})
    model = prepare_hf_model(AutoModelForCausalLM.from_config(config)).eval()
    with pytest.raises(PackingLeakError, match="called without cu_seq_lens_q in a packed forward.*mode: dynamic"):
        model(**hf_model_inputs(documents_batch(documents((5, 3)))))
    with torch.no_grad():  # outside packed rows it is the stock model
        model(input_ids=torch.arange(1, 6)[None])


def test_packed_calls_that_would_compute_another_function_are_refused() -> None:
    from lit_seqpack.model import hf as _hf_dispatch

    model = prepare_hf_model(stock_eager("mistral"))
    inputs = hf_model_inputs(documents_batch(documents((5, 3))))
    with pytest.raises(ValueError, match="attention_mask with cu_seq_lens_q"):
        model(**inputs, attention_mask=torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="without position_ids"):
        model(**{k: v for k, v in inputs.items() if k != "position_ids"})
    with pytest.raises(ValueError, match="pixel_values on a packed row"):
        model(**inputs, pixel_values=torch.zeros(1, 3, 8, 8))
    _hf_dispatch._CALLS.append("packed")  # an image overlay on the causal mask (Gemma3, PaliGemma, ...)
    try:
        with pytest.raises(ValueError, match="overlays its own pattern"):
            _hf_dispatch.original_mask(config=model.config, use_vmap=True)
    finally:
        _hf_dispatch._CALLS.pop()
