"""Dynamic / padded batches through a prepared transformers model: the stock function with the standard mask."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from lit_seqpack.model import hf as _hf_dispatch  # noqa: E402
from lit_seqpack.model.hf import ATTENTION_NAME, hf_model_inputs, prepare_hf_model  # noqa: E402
from lit_seqpack.model.isolation import documents_batch  # noqa: E402
from tests.model._hf_tiny import TINY_HF  # noqa: E402

TINY = TINY_HF
LENGTHS = (5, 11, 3, 7)


def stock_and_prepared(model_type: str, attn_implementation: str = "sdpa", **kwargs: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **kwargs)
    stock = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    return stock, prepare_hf_model(copy.deepcopy(stock))


def padded_batch(seed: int = 1) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return documents_batch([torch.randint(1, 64, (n,), generator=gen) for n in LENGTHS], packed=False)


class MaskSpy:
    """Records what lit_seqpack's mask function returns."""

    def __init__(self) -> None:
        self.masks: list[Any] = []

    def __call__(self, **kwargs: Any) -> Any:
        self.masks.append(_hf_dispatch.original_mask(**kwargs))
        return self.masks[-1]

    def __enter__(self) -> MaskSpy:
        AttentionMaskInterface.register(ATTENTION_NAME, self)
        return self

    def __exit__(self, *exc: object) -> None:
        AttentionMaskInterface.register(ATTENTION_NAME, _hf_dispatch.original_mask)


def real_tokens(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]


# Doge reads attention_mask for its dynamic mask (keep_window_size < row length makes the top-k selection bite)
MODELS = [("llama", "sdpa", {}), ("llama", "eager", {}), ("doge", "sdpa", {"keep_window_size": 6})]


@pytest.mark.parametrize(("model_type", "attn_implementation", "kwargs"), MODELS)
def test_padded_batch_logits_of_real_tokens_equal_the_stock_model(
    model_type: str, attn_implementation: str, kwargs: dict[str, Any]
) -> None:
    stock, model = stock_and_prepared(model_type, attn_implementation, **kwargs)
    batch = padded_batch()
    inputs = hf_model_inputs(batch)
    assert inputs["attention_mask"] is batch["attention_mask"] and inputs["lit_seqpack_right_padded"]
    with torch.no_grad():
        got = model(**inputs).logits
        want = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False).logits  # fmt: skip
    mask = batch["attention_mask"]
    torch.testing.assert_close(real_tokens(got, mask), real_tokens(want, mask), atol=1e-5, rtol=0)


def test_right_padding_runs_plain_causal_sdpa_and_left_padding_keeps_the_mask() -> None:
    _, model = stock_and_prepared("llama")
    batch = padded_batch()
    with torch.no_grad(), MaskSpy() as spy:
        model(**hf_model_inputs(batch))
        assert spy.masks == [None]  # sdpa's causal fast path, no [B, 1, L, L] mask
        left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
        model(**hf_model_inputs(left))
        assert spy.masks[-1] is not None and spy.masks[-1].shape == (4, 1, 11, 11)
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])  # not a training call
        assert spy.masks[-1] is not None  # the stock mask, padding included


def test_a_model_that_reads_attention_mask_gets_it() -> None:
    """Doge builds its dynamic mask from the causal + padding mask; it must see the padding (eager: no skip)."""
    _, model = stock_and_prepared("doge", keep_window_size=6)
    batch = padded_batch()
    seen: list[Any] = []
    handle = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")),
                                                   with_kwargs=True)  # fmt: skip
    try:
        with torch.no_grad(), MaskSpy() as spy:
            model(**hf_model_inputs(batch))
    finally:
        handle.remove()
    assert seen[0] is batch["attention_mask"]
    assert spy.masks[0] is not None  # Doge asks for a materialised mask (allow_is_causal_skip=False): it gets one


def test_a_model_own_mask_on_a_packed_row_is_refused() -> None:
    """Doge adds a learned bias to the attention mask: varlen attention cannot honour it on a packed row."""
    _, model = stock_and_prepared("doge", keep_window_size=6)
    batch = documents_batch([torch.arange(1, 6), torch.arange(1, 4)])
    with pytest.raises(ValueError, match="own attention mask.*mode: dynamic"):
        model(**hf_model_inputs(batch))
