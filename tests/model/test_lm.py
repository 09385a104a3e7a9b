"""Tests for lit_seqpack.model.lm: ReferenceLM and HFCausalLM, their optimizer and schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.model.hf import ATTENTION_NAME
from lit_seqpack.model.isolation import check_packing_equivalence
from lit_seqpack.model.lm import HFCausalLM, ReferenceLM, warmup_cosine
from tests.model._hf_tiny import TINY_HF

TINY = {"vocab_size": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64}
LLAMA = TINY_HF


def _samples(count: int = 6, seed: int = 0) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (int(n),), generator=gen).tolist()} for n in range(3, 3 + count)]


def _trainer(**kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_warmup_then_cosine_to_the_floor() -> None:
    values = [warmup_cosine(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(25)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))
    assert values[20] == pytest.approx(0.1) and values[24] == pytest.approx(0.1)
    assert warmup_cosine(100, warmup_steps=0, total_steps=None, min_lr_ratio=0.0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"warmup_steps": -1}, "warmup_steps must be an int >= 0, got -1"),
        ({"warmup_steps": 2.5}, "warmup_steps must be an int >= 0, got 2.5"),  # was silently a fractional warmup
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"lr_schedule": "linear"}, r"lr_schedule='linear' must be one of \('constant', 'cosine'\)"),
    ],
)
def test_reference_lm_rejects_bad_optimizer_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReferenceLM(**TINY, **kwargs)


def test_reference_lm_saves_its_hyperparameters_and_builds_the_decoder() -> None:
    model = ReferenceLM(**TINY, lr=1e-3, attn_backend="sdpa")
    assert model.hparams.n_embd == 32 and model.hparams.lr == 1e-3 and model.hparams.attn_backend == "sdpa"
    assert model.model.config.n_layer == 2
    reloaded = ReferenceLM(**model.hparams)
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in model.parameters())


def test_optimizer_groups_and_schedule_follow_the_run_length() -> None:
    model = ReferenceLM(**TINY, lr=1e-2, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.0)
    batches = [PackedCollator()(_samples())] * 6
    trainer = _trainer(max_steps=6)
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    optimizer = trainer.optimizers[0]
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.ndim < 2 for p in plain["params"])
    assert trainer.lr_scheduler_configs[0].interval == "step"
    assert decayed["lr"] == pytest.approx(0.0, abs=1e-12)  # end of the cosine over estimated_stepping_batches=6


@pytest.mark.parametrize("collate", [PackedCollator(pad_to_multiple_of=8), PaddedCollator()])
def test_reference_lm_learns_a_repeated_batch(collate: Any) -> None:
    torch.manual_seed(0)
    model = ReferenceLM(**TINY, lr=1e-2, weight_decay=0.0, lr_schedule="constant", attn_backend="sdpa")
    batch = collate(_samples())
    with torch.no_grad():
        before = model.validation_step(batch, 0).item()
    _trainer(max_steps=30).fit(model, torch.utils.data.DataLoader([batch] * 30, batch_size=None))
    with torch.no_grad():
        after = model.validation_step(batch, 0).item()
    assert after < 0.7 * before


def test_hf_causal_lm_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        HFCausalLM()
    with pytest.raises(ValueError, match="exactly one"):
        HFCausalLM(model_name_or_path="x", config=LLAMA)


def test_hf_causal_lm_from_a_config_and_from_a_local_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = HFCausalLM(config=LLAMA, attn_backend="sdpa")
    assert type(module.model).__name__ == "LlamaForCausalLM"
    assert module.model.config._attn_implementation == ATTENTION_NAME
    batch = PackedCollator()(_samples())
    assert check_packing_equivalence(module, batch, atol=1e-5).passed
    module.model.save_pretrained(tmp_path)
    loaded = HFCausalLM(model_name_or_path=str(tmp_path))
    assert loaded.model.config._attn_implementation == ATTENTION_NAME
    with torch.no_grad():
        torch.testing.assert_close(loaded.seqpack_forward(batch), module.seqpack_forward(batch))


def test_an_unpickled_hf_module_registers_the_attention_function_again() -> None:
    """A spawned process (ddp_spawn) unpickles the module before anything registered the function there."""
    import pickle

    from transformers import AttentionInterface

    payload = pickle.dumps(HFCausalLM(config=LLAMA, attn_backend="sdpa"))
    del AttentionInterface._global_mapping[ATTENTION_NAME]  # what a fresh process looks like
    module = pickle.loads(payload)
    assert ATTENTION_NAME in AttentionInterface()
    batch = PackedCollator()(_samples())
    assert check_packing_equivalence(module, batch, atol=1e-5).passed


def test_decay_groups_use_the_shapes_recorded_before_sharding() -> None:
    """FSDP1 shows configure_optimizers flat 1-D shards under wrapper-prefixed names: the record from setup decides."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    module = ReferenceLM(**TINY, lr_schedule="constant")
    module.setup("fit")
    flat_weight, flat_norm = torch.zeros(5), torch.zeros(3)
    assert module._decays("model.layers.0._fsdp_wrapped_module.attn.q_proj.weight", flat_weight)
    assert not module._decays("model.layers.0._fsdp_wrapped_module.attn_norm.weight", flat_norm)
    unrecorded = ReferenceLM(**TINY, lr_schedule="constant")  # a setup override that forgot super().setup
    unrecorded.trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match=r"under FSDPStrategy sees parameter .* super\(\).setup\(stage\)"):
        unrecorded.configure_optimizers()


def test_gradient_checkpointing_is_switched_on_without_transformers_deprecation_warning() -> None:
    """transformers 5.24 renamed gradient checkpointing to activation checkpointing (the old names warn)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = HFCausalLM(config={"model_type": "llama", **TINY_HF}, gradient_checkpointing=True)
    assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    model = module.model
    on = getattr(model, "is_activation_checkpointing", None)
    assert on if on is not None else model.is_gradient_checkpointing
