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
from tests.model._hf_tiny import TINY_HF  # noqa: E402

LLAMA = {**TINY_HF, "max_position_embeddings": 128}


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


def stock_copy(model: Any) -> Any:
    """A stock model (its original attention) with ``model``'s weights."""
    stock = restore_hf_attention(copy.deepcopy(model))
    assert stock.config._attn_implementation != ATTENTION_NAME
    return stock.eval()


def left_padded(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 4, 7)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


# windows shorter than the prompts; None: the model's own default implementation
WINDOWED = {
    "mistral": {"sliding_window": 4},
    "gemma2": {"sliding_window": 4, "head_dim": 8, "query_pre_attn_scalar": 8, "attn_logit_softcapping": 0.05},
    "gpt_oss": {"sliding_window": 4, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
}
ARCHITECTURES = [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager"), ("mistral", "eager"), ("mistral", "sdpa"),
                 ("gemma2", None), ("gpt_oss", None)]  # fmt: skip


@pytest.mark.parametrize(("model_type", "attn_implementation"), ARCHITECTURES)
def test_cached_and_left_padded_generation_equal_the_stock_model(model_type: str, attn_implementation: str) -> None:
    extra = WINDOWED.get(model_type, {})
    model = prepare_hf_model(tiny(model_type, attn_implementation=attn_implementation, **extra))
    stock = tiny(model_type, attn_implementation=attn_implementation, **extra)
    assert model.config._attn_implementation == ATTENTION_NAME
    prompt = torch.randint(1, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    assert_same_generation(model, stock, prompt)  # cached decoding: q_len 1 against kv_len n
    ids, mask = left_padded()
    assert_same_generation(model, stock, ids, attention_mask=mask)
    with torch.no_grad():  # a plain forward with a 2-D mask and with a prepared 4-D mask
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, stock(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)  # fmt: skip
        four_d = (torch.ones(10, 10).tril().bool() & mask.bool()[:, None, :])[:, None]
        torch.testing.assert_close(model(ids, attention_mask=four_d).logits,
                                   stock(ids, attention_mask=four_d).logits, atol=1e-5, rtol=0)  # fmt: skip


def test_generation_after_training_and_after_load_from_checkpoint(tmp_path: Any) -> None:
    from lightning.pytorch import Trainer

    from lit_seqpack.data.batching.collate import PackedCollator
    from lit_seqpack.model.lm import HFCausalLM

    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(1, 64, (n,), generator=gen).tolist()} for n in (5, 9, 13, 7)]
    module = HFCausalLM(config={"model_type": "llama", **LLAMA}, lr=1e-2, lr_schedule="constant")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([PackedCollator()(samples)] * 3, batch_size=None))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    ids, mask = left_padded()
    for wrapped in (module, HFCausalLM.load_from_checkpoint(path)):
        model = wrapped.model.eval()
        assert model.config._attn_implementation == ATTENTION_NAME
        stock = stock_copy(model)
        assert_same_generation(model, stock, ids[:1, 3:])
        assert_same_generation(model, stock, ids, attention_mask=mask)


def test_packed_rows_get_no_mask_and_a_model_own_mask_is_refused() -> None:
    """On a packed row the mask function builds nothing (no [T, T] mask); a mask that still arrives is the model's."""
    from lit_seqpack.model import hf as _hf_dispatch
    from lit_seqpack.model.hf import hf_model_inputs
    from lit_seqpack.model.isolation import documents_batch

    model = prepare_hf_model(tiny(attn_implementation="eager"))
    seen: list[Any] = []
    original = _hf_dispatch.original_mask

    def spy(**kwargs: Any) -> Any:
        seen.append(original(**kwargs))
        return seen[-1]

    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(ATTENTION_NAME, spy)
    try:
        with torch.no_grad():
            model(**hf_model_inputs(documents_batch([torch.arange(1, 6), torch.arange(1, 4)])))
            assert seen == [None]
            model(torch.arange(1, 6)[None], use_cache=False)
            assert seen[-1] is not None and seen[-1].dtype == torch.float32  # eager's float mask, as stock
    finally:
        AttentionMaskInterface.register(ATTENTION_NAME, original)
