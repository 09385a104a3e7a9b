"""Tests for lit_seqpack.model.isolation on transformers models: conv/SSM hybrids and kwargs-dropping layers
are refused naming the layer, dynamic mode stays exact for them, isolated families raise no false alarm."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_seqpack.data.sources import SyntheticInstructionDataset  # noqa: E402
from lit_seqpack.model.isolation import (  # noqa: E402
    PackingLeakError,
    check_packing_equivalence,
    documents_batch,
    probe_packing_isolation,
)

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _hf(model_type: str, **overrides: Any) -> Any:
    from lit_seqpack.model.lm import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM(config={"model_type": model_type, **TINY, **HEADS, **overrides}, attn_backend="sdpa")


def _tokens_batch() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return documents_batch([torch.randint(0, 64, (n,), generator=gen) for n in (9, 13, 6)])


def test_lfm2_conv_layers_are_refused_in_packing_mode_naming_the_layer() -> None:
    module = _hf("lfm2", layer_types=["conv", "full_attention"])
    assert check_packing_equivalence(module, _tokens_batch()).max_error < 1e-2  # small: the old probe passed it
    with pytest.raises(PackingLeakError, match=r"model\.layers\.0\.conv \(Lfm2ShortConv\).*mode: dynamic"):
        module.train().training_step(_tokens_batch(), 0)


def test_the_first_leaking_layer_is_named_when_it_is_not_the_first_layer() -> None:
    module = _hf("lfm2", layer_types=["full_attention", "full_attention", "conv"], num_hidden_layers=3)
    with pytest.raises(PackingLeakError, match=r"model\.layers\.2\.conv \(Lfm2ShortConv\)"):
        probe_packing_isolation(module.train(), _tokens_batch())


def test_lfm2_is_exact_in_dynamic_mode_against_the_stock_eager_model() -> None:
    module = _hf("lfm2", layer_types=["conv", "full_attention"])
    stock = transformers.AutoModelForCausalLM.from_config(module.model.config, attn_implementation="eager")
    stock.load_state_dict(module.model.state_dict())
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 64, (n,), generator=gen) for n in (9, 13, 6)]
    padded = documents_batch(docs, packed=False)
    module.train().training_step(padded, 0)  # no probe, no error: padded rows hold one document each
    with torch.no_grad():
        logits = module.eval().seqpack_forward(padded)
        for row, doc in enumerate(docs):
            alone = stock.eval()(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(logits[row, : len(doc)], alone, atol=1e-5, rtol=0)


def test_a_decoder_layer_that_drops_the_boundaries_is_named() -> None:
    module = _hf("stablelm")
    with pytest.raises(PackingLeakError, match=r"StableLmDecoderLayer\) does not pass its keyword arguments"):
        probe_packing_isolation(module, _tokens_batch())


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("qwen2", {}),
        ("mistral", {"sliding_window": 8}),
        ("gemma2", {"sliding_window": 8}),
        ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}),
    ],
)
def test_no_false_alarm_on_isolated_families_with_windows_softcaps_and_sinks(model_type: str, overrides: dict) -> None:
    report = probe_packing_isolation(_hf(model_type, head_dim=8, **overrides).train(), _tokens_batch())
    assert report.passed and min(report.lengths) > overrides.get("sliding_window", 0)


def test_no_false_alarm_on_gpt2_with_its_position_embeddings() -> None:
    from lit_seqpack.model.lm import HFCausalLM

    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    module = HFCausalLM(config=gpt2, config_overrides={"attn_pdrop": 0.0}, attn_backend="sdpa").train()
    report = probe_packing_isolation(module, _tokens_batch())  # dropout on (resid/embd): masks are per token
    assert report.passed and report.training


def test_llama_packed_is_isolated_and_the_probe_stays_cheap() -> None:
    module = _hf("llama")
    report = probe_packing_isolation(module.train(), _tokens_batch())
    assert report.passed and sum(report.lengths) < 100


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_the_probe_on_cuda_kernels_under_bf16_autocast(backend: str) -> None:
    """The kernels' backward (flash-attn / torch varlen when present) leaves other documents' gradients at 0."""
    from lit_seqpack.model.lm import HFCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(config={"model_type": "llama", **TINY, **HEADS}, attn_backend=backend).cuda().train()
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _tokens_batch().items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        report = probe_packing_isolation(module, batch)
    assert report.passed and report.dtype == torch.bfloat16
    leaky = _hf("lfm2", layer_types=["conv", "full_attention"]).cuda().train()
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(PackingLeakError, match="Lfm2ShortConv"):
        probe_packing_isolation(leaky, batch)


def test_the_probe_runs_through_gradient_checkpointing() -> None:
    """A train-mode-only path (activation recomputation) is where the probe looks."""
    from lit_seqpack.model.lm import HFCausalLM

    torch.manual_seed(0)
    config = {"model_type": "llama", **TINY, **HEADS}
    module = HFCausalLM(config=config, gradient_checkpointing=True, attn_backend="sdpa").train()
    assert probe_packing_isolation(module, _tokens_batch()).passed
    leaky = HFCausalLM(config={**config, "model_type": "lfm2", "layer_types": ["conv", "full_attention"]},
                       gradient_checkpointing=True).train()  # fmt: skip
    with pytest.raises(PackingLeakError, match="Lfm2ShortConv"):
        probe_packing_isolation(leaky, _tokens_batch())


def _reentrant(module: Any) -> Any:
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return module.train()


def test_the_probe_runs_under_reentrant_gradient_checkpointing_and_touches_no_parameter() -> None:
    """``use_reentrant=True`` refuses ``torch.autograd.grad``: the probe takes its gradients by ``backward()``."""
    plain, checkpointed = _hf("llama").train(), _reentrant(_hf("llama"))
    report = probe_packing_isolation(checkpointed, _tokens_batch())
    assert report.passed and report.method == "gradient"
    params = list(checkpointed.parameters())
    assert all(p.requires_grad and p.grad is None for p in params)  # frozen for the probe only, no gradient left
    for module in (plain, checkpointed):  # the training step (probe first) gives the gradient of the plain model
        module.training_step(_tokens_batch(), 0).backward()
    for (name, p), q in zip(plain.named_parameters(), params, strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_leak_under_reentrant_gradient_checkpointing_is_refused_saying_why_no_layer_is_named() -> None:
    module = _reentrant(_hf("lfm2", layer_types=["full_attention", "conv"]))
    with pytest.raises(PackingLeakError, match=r"nonzero gradient entries.*use_reentrant=True.*mode: dynamic"):
        module.training_step(_tokens_batch(), 0)
    assert all(p.requires_grad and p.grad is None for p in module.parameters())


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_an_lfm2_run_is_refused_before_any_step_when_packed_and_trains_when_dynamic(mode: str, tmp_path: Any) -> None:
    from lightning.pytorch import Trainer

    from lit_seqpack.data.datamodule import SeqPackDataModule

    module = _hf("lfm2", layer_types=["conv", "full_attention"])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    synthetic = {"num_samples": 24, "median_length": 12, "max_length": 30, "vocab_size": 64, "seed": 3}
    data = SeqPackDataModule(source=SyntheticInstructionDataset(**synthetic), max_tokens=64, mode=mode)
    trainer = Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    if mode == "packing":
        with pytest.raises(PackingLeakError, match=r"Lfm2ShortConv.*mode: dynamic"):
            trainer.fit(module, datamodule=data)
        assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())  # not one step trained
    else:
        trainer.fit(module, datamodule=data)
        assert trainer.global_step == 2
