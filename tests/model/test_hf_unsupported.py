"""transformers models that cannot be packed here train in dynamic and padded mode, and packing is refused by name.

Two kinds: models whose dispatch may or may not go through transformers' ``AttentionInterface`` depending on the
release (Falcon kept its own attention classes up to transformers 5.24 and uses the interface from 5.25), and models
whose layers keep packed documents apart only through a kernel package that is not installed (Qwen3-Next and Qwen3.5
without flash-linear-attention, where transformers refuses the packed row). Each is compared with the stock model run
per document with eager attention (logits, and the gradient of HF's token-mean loss). The Falcon tests assert the
library's promise, not one release's dispatch: switched and exact when packed, or kept and refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_seqpack.data.sources import SyntheticInstructionDataset  # noqa: E402
from lit_seqpack.model.isolation import documents_batch  # noqa: E402

LENGTHS = (9, 13, 6)
FALCON = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
FALCON_VARIANTS = {
    "rotary-multi-query": {},
    "alibi": {"alibi": True},
    "new-decoder-gqa": {"new_decoder_architecture": True, "num_kv_heads": 2},
}
LINEAR_ATTENTION = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
KERNEL_MODELS = {
    "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
    "qwen3_5_text": {},
}  # fmt: skip


def _hf(config: dict[str, Any], **kwargs: Any) -> Any:
    from lit_seqpack.model.lm import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM(config=config, attn_backend="sdpa", **kwargs)


def _documents(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen) for n in LENGTHS]


def _stock_eager(module: Any) -> Any:
    config = copy.deepcopy(module.model.config)  # from_config sets the implementation on the config it is given
    stock = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    stock.load_state_dict(module.model.state_dict())
    return stock


def _assert_exact_per_document(module: Any, *, packed: bool = False) -> None:
    """Logits and the training gradient of padded rows (or one packed row) equal the stock eager model per document."""
    docs = _documents()
    stock = _stock_eager(module)
    batch = documents_batch(docs, packed=packed)
    with torch.no_grad():
        logits = module.eval().seqpack_forward(batch)
        start = 0
        for row, doc in enumerate(docs):
            alone = stock.eval()(input_ids=doc[None]).logits[0]
            got = logits[0, start : start + len(doc)] if packed else logits[row, : len(doc)]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
            start += len(doc)
    module.train().zero_grad()
    module.training_step(batch, 0).backward()
    stock.train().zero_grad()
    total = sum(len(d) - 1 for d in docs)
    sum(stock(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in docs).div(total).backward()
    expected = dict(stock.named_parameters())
    for name, param in module.model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, atol=1e-6, rtol=1e-5, msg=name)


def _assert_exact_in_padded_rows(module: Any) -> None:
    _assert_exact_per_document(module, packed=False)


def _switched(module: Any) -> bool:
    """Whether ``HFCausalLM`` routed the model's attention through lit_seqpack's varlen function."""
    from lit_seqpack.model._hf_packed import ATTENTION_NAME

    return module.model.config._attn_implementation == ATTENTION_NAME


def _fit(module: Any, mode: str, tmp_path: Any) -> Any:
    from lightning.pytorch import Trainer

    from lit_seqpack.data.datamodule import SeqPackDataModule

    synthetic = {"num_samples": 24, "median_length": 12, "max_length": 30, "vocab_size": 64, "seed": 3}
    trainer = Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    budget = {"batch_size": 2} if mode == "padded" else {"max_tokens": 64}
    trainer.fit(
        module, datamodule=SeqPackDataModule(source=SyntheticInstructionDataset(**synthetic), **budget, mode=mode)
    )
    return trainer


@pytest.mark.parametrize(
    ("variant", "implementation"),
    [("rotary-multi-query", "sdpa"), ("rotary-multi-query", "eager"), ("alibi", "eager"), ("new-decoder-gqa", "sdpa")],
)  # Falcon's alibi differs between its own sdpa and eager paths (~8e-3 per document alone): eager only there
def test_falcon_is_switched_and_exact_packed_or_kept_and_refused_by_name(variant: str, implementation: str) -> None:
    """Whichever dispatch the installed transformers has, the promise holds: exact when packed, or a named refusal."""
    from lit_seqpack.model.hf import UnsupportedAttentionError, prepare_hf_model

    config = {"model_type": "falcon", **FALCON, **FALCON_VARIANTS[variant]}
    module = _hf(config, model_kwargs={"attn_implementation": implementation})
    _assert_exact_in_padded_rows(module)
    if _switched(module):  # transformers >= 5.25: Falcon dispatches through the AttentionInterface
        _assert_exact_per_document(module, packed=True)
        return
    assert module.model.config._attn_implementation == implementation  # kept: no AttentionInterface
    with pytest.raises(UnsupportedAttentionError, match=r"FalconForCausalLM .*AttentionInterface.*mode: dynamic"):
        prepare_hf_model(module.model)
    assert module.model.config._attn_implementation == implementation


@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_falcon_trains_through_hf_causal_lm_in_every_mode_it_supports_and_is_refused_packed_otherwise(
    mode: str, tmp_path: Any
) -> None:
    module = _hf({"model_type": "falcon", **FALCON})
    before = {k: v.clone() for k, v in module.state_dict().items()}
    if mode == "packing" and not _switched(module):
        with pytest.raises(ValueError, match=r"FalconForCausalLM cannot be trained with mode: packing.*mode: dynamic"):
            _fit(module, mode, tmp_path)
        assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())  # not one step trained
    else:
        assert _fit(module, mode, tmp_path).global_step == 2
        assert any(not torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def test_a_falcon_trained_by_hf_causal_lm_exports_as_the_stock_model(tmp_path: Any) -> None:
    module = _hf({"model_type": "falcon", **FALCON})
    out = module.export_hf(tmp_path / "falcon")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    doc = _documents()[0][None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=doc).logits, module.eval().model(input_ids=doc).logits)


@pytest.mark.parametrize("model_type", list(KERNEL_MODELS))
def test_a_missing_kernel_package_gets_our_refusal_naming_the_exact_mode(model_type: str) -> None:
    """transformers refuses their packed rows without flash-linear-attention; padded rows are exact without it."""
    if transformers.utils.import_utils.is_flash_linear_attention_available():
        pytest.skip("flash-linear-attention is installed: these models pack, and the isolation probe checks them")
    module = _hf({"model_type": model_type, **LINEAR_ATTENTION, **KERNEL_MODELS[model_type]})
    name = type(module.model).__name__
    with pytest.raises(ValueError, match=rf"{name} cannot be trained with mode: packing here: .*flash-linear-atten"
                       r"tion.*mode: dynamic \(or padded\).*exact") as refused:  # fmt: skip
        module.train().training_step(documents_batch(_documents()), 0)
    assert "can't keep packed sequences apart" in str(refused.value.__cause__)  # transformers' own, chained
    _assert_exact_in_padded_rows(module)
