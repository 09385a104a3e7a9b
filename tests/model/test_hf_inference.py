"""A prepared transformers model computes the stock model's function outside packed rows (CPU, fp32)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lit_seqpack.model.hf import ATTENTION_NAME, prepare_hf_model, restore_hf_attention  # noqa: E402

LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def tiny(model_type: str = "llama", seed: int = 0, attn_implementation: str | None = None, **kwargs: Any) -> Any:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**LLAMA, **kwargs})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def greedy(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> Any:
    return model.generate(
        input_ids,
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
        **kwargs,
    )


def assert_same_generation(model: Any, stock: Any, input_ids: torch.Tensor, **kwargs: Any) -> None:
    with torch.no_grad():
        got, want = greedy(model, input_ids, **kwargs), greedy(stock, input_ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_restore_gives_back_the_stock_model(attn_implementation: str) -> None:
    stock = tiny(attn_implementation=attn_implementation)
    model = prepare_hf_model(tiny(attn_implementation=attn_implementation))
    assert model.config._attn_implementation == ATTENTION_NAME
    assert restore_hf_attention(model) is model
    assert model.config._attn_implementation == attn_implementation
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=0, rtol=0)
    assert_same_generation(model, stock, ids)
    with pytest.raises(ValueError, match="not prepared"):
        restore_hf_attention(model)


def test_prepare_twice_keeps_the_first_record() -> None:
    model = prepare_hf_model(prepare_hf_model(tiny(attn_implementation="eager")))
    assert restore_hf_attention(model).config._attn_implementation == "eager"


@pytest.mark.parametrize("clone", ["pickle", "deepcopy"])
def test_the_record_survives_pickling_and_copies(clone: str) -> None:
    model = prepare_hf_model(tiny(attn_implementation="eager"))
    copied = pickle.loads(pickle.dumps(model)) if clone == "pickle" else copy.deepcopy(model)
    assert copied.config is not model.config
    assert restore_hf_attention(copied).config._attn_implementation == "eager"
    assert model.config._attn_implementation == ATTENTION_NAME


def test_restore_puts_back_each_sub_config() -> None:
    """A composite model keeps one implementation per sub-config (here eager text, sdpa vision)."""
    from transformers import AutoModelForImageTextToText

    text = {**LLAMA, "model_type": "llama", "num_hidden_layers": 1}
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32}  # fmt: skip
    config = AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_index=5)
    implementations = {"": "sdpa", "text_config": "eager", "vision_config": "sdpa"}
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=implementations)
    configs = (model.config, model.config.text_config, model.config.vision_config)
    assert [c._attn_implementation for c in configs] == ["sdpa", "eager", "sdpa"]
    prepare_hf_model(model)
    assert [c._attn_implementation for c in configs] == [ATTENTION_NAME] * 3
    restore_hf_attention(model)
    assert [c._attn_implementation for c in configs] == ["sdpa", "eager", "sdpa"]
