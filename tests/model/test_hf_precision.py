"""Packed attention under autocast: bf16-mixed / fp16-mixed training of transformers models (CPU; CUDA marked)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lit_seqpack.data.batching.collate import PackedCollator  # noqa: E402
from lit_seqpack.model.attention import override_backend, varlen_attention
from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func
from lit_seqpack.model.hf import hf_model_inputs, prepare_hf_model  # noqa: E402
from lit_seqpack.model.isolation import documents_batch  # noqa: E402
from lit_seqpack.model.lm import HFCausalLM  # noqa: E402
from tests.model._hf_tiny import TINY_HF  # noqa: E402

TINY = TINY_HF
ARCHITECTURES = ["llama", "qwen2"]
LENGTHS = (9, 17, 4, 12)


def documents(lengths: tuple[int, ...] = LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen) for n in lengths]


def stock_and_prepared(model_type: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY)).eval()
    return stock, prepare_hf_model(copy.deepcopy(stock))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_varlen_attention_casts_mixed_inputs_to_the_autocast_dtype(backend: str, dtype: torch.dtype) -> None:
    """RoPE under autocast gives float32 q/k and half v; every backend computes in the autocast dtype."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(12, 4, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    v = torch.randn(12, 2, 8, generator=gen).to(dtype)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    expected = varlen_attention(q.to(dtype), k.to(dtype), v, cu, 7, backend="sdpa")
    with override_backend("flash_attn", reference_flash_attn_varlen_func), torch.autocast("cpu", dtype=dtype):
        out = varlen_attention(q, k, v, cu, 7, backend=backend)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="share dtype"):  # outside autocast a mix is a bug: it raises
        varlen_attention(q, k, v, cu, 7, backend=backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_packed_logits_under_autocast_equal_the_stock_model_per_document(model_type: str, dtype: torch.dtype) -> None:
    stock, model = stock_and_prepared(model_type)
    docs = documents()
    batch = documents_batch(docs)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        packed = model(**hf_model_inputs(batch, backend="sdpa")).logits[0].float()
        alone = torch.cat([stock(input_ids=d[None]).logits[0].float() for d in docs])
        with torch.autocast("cpu", enabled=False):
            exact = torch.cat([stock(input_ids=d[None]).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=2e-2, rtol=2e-2)
    # and half precision is a rounding of the fp32 function, not another function
    assert (packed - exact).abs().max() < 5e-2 * (1 + exact.abs().max())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_mixed_precision_packed_training_of_hf_causal_lm(model_type: str, precision: str) -> None:
    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 64, (n,), generator=gen).tolist()} for n in (5, 9, 13, 7)]
    batches = [PackedCollator()(samples)] * 3
    module = HFCausalLM(config={"model_type": model_type, **TINY}, lr=1e-2, lr_schedule="constant")
    before = [p.detach().clone() for p in module.parameters()]
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert all(p.dtype == torch.float32 for p in module.parameters())  # mixed: fp32 weights, half compute
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_packed_logits_under_cuda_autocast_equal_the_stock_model(model_type: str, dtype: torch.dtype) -> None:
    """On CUDA "auto" picks flash_attn or torch_varlen when present (fp32 weights, autocast compute)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    stock, model = (m.cuda() for m in stock_and_prepared(model_type))
    docs = [d.cuda() for d in documents((40, 120, 7, 64))]
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        packed = model(**hf_model_inputs(documents_batch(docs))).logits[0].float()
        alone = torch.cat([stock(input_ids=d[None]).logits[0].float() for d in docs])
    torch.testing.assert_close(packed, alone, atol=3e-2, rtol=3e-2)
    module = HFCausalLM(config={"model_type": model_type, **TINY}).cuda()
    with torch.autocast("cuda", dtype=dtype):
        loss = module.training_step(documents_batch(docs), 0)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in module.parameters())
