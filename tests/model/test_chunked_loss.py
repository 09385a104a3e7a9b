"""The chunked loss from hidden states equals the full-logits loss (value 1e-5 relative, gradients 1e-4), for the
reference decoder and tiny transformers models of several heads (plain, tied, soft-capped, scaled), with the weighted
loss and a context-parallel shard's ``shift_labels``; and the ``[tokens, vocab]`` logits never exist at once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_seqpack.model.chunked_loss import OutputHead, chunked_cross_entropy, chunked_token_logprobs
from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
from lit_seqpack.model.loss import token_cross_entropy
from lit_seqpack.rl.loss import token_logprobs
from tests.model._hf_tiny import TINY_HF

LENGTHS = (7, 12, 9, 6)  # a packed row of 34 tokens, the last segment a padding tail
VOCAB = 64


def packed_batch(vocab: int = VOCAB, *, seed: int = 0, weighted: bool = False, cp_shift: bool = False) -> dict:
    """One packed row of the batch contract (step totals of one rank, no accumulation)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.clone()
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels[0, cu[:-1].long()] = -100
    labels[0, cu[-2] :] = -100  # the padding tail
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": cu,
        "max_seqlen": max(LENGTHS),
        "num_loss_tokens": int((labels != -100).sum()),
        "step_loss_tokens": 3 * int((labels != -100).sum()),  # other microbatches of the step hold the rest
    }
    if weighted:
        weights = torch.rand(1, total, generator=gen)
        weights[labels == -100] = 0.0
        batch |= {"loss_weights": weights, "num_loss_weight": float(weights.sum()), "step_loss_weight": 40.0}
    if cp_shift:  # a CP shard's targets, computed on the whole row: here the row's own, pre-shifted
        batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        if weighted:
            batch["shift_loss_weights"] = torch.nn.functional.pad(batch["loss_weights"][:, 1:], (0, 1))
    return batch


def loss_and_grads(module: Any, batch: dict, *, chunked: bool, stage: str = "train") -> tuple[float, dict]:
    module.hparams.chunked_loss = chunked
    module.zero_grad(set_to_none=True)
    loss = module.seqpack_step(batch, stage)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def assert_same(module: Any, batch: dict, *, stage: str = "train") -> None:
    plain_loss, plain_grads = loss_and_grads(module, batch, chunked=False, stage=stage)
    chunk_loss, chunk_grads = loss_and_grads(module, batch, chunked=True, stage=stage)
    assert module.seqpack_output_head() is not None, "the chunked path fell back"
    assert chunk_loss == pytest.approx(plain_loss, rel=1e-5)
    assert chunk_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert float((chunk_grads[name] - grad).abs().max() / scale) <= 1e-4, name


def reference_lm(vocab_size: int = VOCAB, **kwargs: Any) -> ReferenceLM:
    torch.manual_seed(0)
    sizes = {"vocab_size": vocab_size, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64}
    return ReferenceLM(**sizes, loss_chunk_size=5, **kwargs)


def hf_lm(model_type: str, **config: Any) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(config={"model_type": model_type, **TINY_HF, **config}, loss_chunk_size=5)


# --------------------------------------------------------------------------------------------- the function itself
@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize(
    "transforms", [{}, {"bias": True}, {"scale": 0.25}, {"softcap": 0.5}, {"scale": 3.0, "softcap": 2.0}]
)
def test_chunked_cross_entropy_equals_the_full_logits_loss(chunk: int, transforms: dict) -> None:
    gen = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 9, 8, generator=gen, requires_grad=True)
    weight = torch.randn(13, 8, generator=gen, requires_grad=True)
    bias = torch.randn(13, generator=gen, requires_grad=True) if transforms.get("bias") else None
    head = OutputHead(
        weight=weight, bias=bias, scale=transforms.get("scale", 1.0), softcap=transforms.get("softcap"),
        chunk_size=chunk,
    )  # fmt: skip
    labels = torch.randint(0, 13, (2, 9), generator=gen)
    labels[:, 0] = labels[1, 4] = -100
    weights = torch.rand(2, 9, generator=gen)
    params = [t for t in (hidden, weight, bias) if t is not None]
    for kwargs in ({}, {"weights": weights}, {"shifted": True}, {"shifted": True, "weights": weights}):
        plain = token_cross_entropy(head.logits(hidden), labels, **kwargs)
        chunked = chunked_cross_entropy(hidden, head, labels, **kwargs)
        assert chunked.num_units == pytest.approx(plain.num_units, rel=1e-9)
        assert float(chunked.loss_sum.detach()) == pytest.approx(float(plain.loss_sum.detach()), rel=1e-5)
        expected = torch.autograd.grad(plain.loss_sum, params)
        got = torch.autograd.grad(chunked.loss_sum, params)
        for e, g in zip(expected, got, strict=True):
            assert torch.allclose(g, e, rtol=1e-4, atol=1e-4 * float(e.abs().max()))


def test_chunked_token_logprobs_equal_token_logprobs_with_a_temperature() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 11, 8, generator=gen, requires_grad=True)
    weight = torch.randn(17, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 17, (1, 11), generator=gen)
    labels[0, :3] = -100
    head = OutputHead(weight=weight, softcap=3.0, temperature=0.7, chunk_size=4)
    plain, chunked = token_logprobs(head.logits(hidden), labels), chunked_token_logprobs(hidden, head, labels)
    assert torch.allclose(chunked, plain, rtol=1e-5, atol=1e-6)
    probe = torch.randn(1, 11, generator=gen)
    for e, g in zip(
        torch.autograd.grad((plain * probe).sum(), (hidden, weight)),
        torch.autograd.grad((chunked * probe).sum(), (hidden, weight)),
        strict=True,
    ):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-5)


def test_chunked_loss_under_bf16_autocast_matches_the_plain_path_under_autocast() -> None:
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 10, 16, generator=gen, requires_grad=True)
    weight = torch.randn(33, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 33, (1, 10), generator=gen)
    head = OutputHead(weight=weight, chunk_size=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = token_cross_entropy(head.logits(hidden), labels).loss_sum
        chunked = chunked_cross_entropy(hidden, head, labels).loss_sum
    assert float(chunked.detach()) == pytest.approx(float(plain.detach()), rel=1e-5)
    for e, g in zip(torch.autograd.grad(plain, (hidden, weight)), torch.autograd.grad(chunked, (hidden, weight)),
                    strict=True):  # fmt: skip
        assert g.dtype == e.dtype and torch.allclose(g, e, rtol=1e-2, atol=1e-2 * float(e.abs().max()))


# --------------------------------------------------------------------------------------------- the modules' steps
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("variant", ["plain", "weighted", "cp_shift", "weighted_cp_shift"])
def test_reference_lm_chunked_step_equals_the_full_logits_step(tie: bool, variant: str) -> None:
    module = reference_lm(tie_embeddings=tie)
    batch = packed_batch(weighted="weighted" in variant, cp_shift="cp_shift" in variant)
    assert_same(module, batch)


def test_reference_lm_validation_and_padded_batches_are_chunked_too() -> None:
    module = reference_lm()
    batch = packed_batch()
    for key in ("cu_seqlens", "max_seqlen"):
        batch.pop(key)
    batch["input_ids"], batch["labels"] = batch["input_ids"].view(2, 17), batch["labels"].view(2, 17)
    batch["position_ids"] = torch.arange(17).expand(2, 17)
    batch["attention_mask"] = torch.ones(2, 17, dtype=torch.long)
    assert_same(module, batch)
    with torch.no_grad():
        module.hparams.chunked_loss = False
        plain = module.seqpack_step(packed_batch(), "validate")
        module.hparams.chunked_loss = True
        chunked = module.seqpack_step(packed_batch(), "validate")
    assert float(chunked) == pytest.approx(float(plain), rel=1e-5)


ARCHITECTURES = {
    "llama": ("llama", {}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "biased": ("llama", {"mlp_bias": True}),
    "gemma2_softcap": ("gemma2", {"head_dim": 8, "final_logit_softcapping": 0.5, "attn_logit_softcapping": None}),
    "granite": ("granite", {"logits_scaling": 4.0}),
    "cohere": ("cohere", {"logit_scale": 0.25}),
}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_hf_chunked_step_equals_the_full_logits_step(name: str) -> None:
    model_type, config = ARCHITECTURES[name]
    module = hf_lm(model_type, **config)
    assert_same(module, packed_batch())
    assert_same(module, packed_batch(seed=1, weighted=True, cp_shift=True))


def test_hf_biased_head_is_reproduced() -> None:
    module = hf_lm("llama")
    head = module.model.lm_head
    head.bias = torch.nn.Parameter(torch.randn(head.out_features))
    module.model.config.tie_word_embeddings = False
    assert module.seqpack_output_head().bias is head.bias
    assert_same(module, packed_batch())


def test_forward_still_returns_the_full_logits() -> None:
    module = hf_lm("gemma2", head_dim=8, final_logit_softcapping=0.5)
    batch = packed_batch()
    logits = module.seqpack_forward(batch)
    assert logits.shape == (1, sum(LENGTHS), VOCAB)
    hidden = module.seqpack_hidden_states(batch)
    assert torch.allclose(module.seqpack_output_head().logits(hidden), logits, atol=1e-6)
    assert reference_lm()(batch["input_ids"]).shape == (1, sum(LENGTHS), VOCAB)


# --------------------------------------------------------------------------------------------- never whole logits
class LargestLogits(TorchDispatchMode):
    """Records the most rows of any op output shaped ``[..., vocab]`` (logits, their softmax, their gradient)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.weight_size, self.rows = vocab, vocab * hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.numel() == self.weight_size:
                continue
            if value.shape[-1] == self.vocab:
                self.rows = max(self.rows, value.numel() // self.vocab)
        return out


@pytest.mark.parametrize("factory", [lambda: reference_lm(vocab_size=96), lambda: hf_lm("llama", vocab_size=96)])
def test_the_whole_logits_never_exist(factory: Any) -> None:
    module = factory()
    batch = packed_batch(96)
    module.seqpack_step(batch, "train").backward()  # the first step's one-off probes (isolation, head) see logits
    mode = LargestLogits(96, hidden=32)  # the weight's gradient [96, 32] and its transposes are not logits
    with mode:
        module.seqpack_step(batch, "train").backward()
    assert mode.rows == 5  # loss_chunk_size=5: one chunk's logits at a time, forward and backward
    module.hparams.chunked_loss = False
    with mode:
        module.seqpack_step(batch, "train").backward()
    assert mode.rows == batch["input_ids"].numel()  # the recorder sees whole logits when they exist


# --------------------------------------------------------------------------------------------- fall back, once
def test_an_unknown_head_falls_back_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    module = hf_lm("llama")
    module.model.lm_head = torch.nn.Sequential(module.model.lm_head)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            assert module.seqpack_output_head() is None
        module.seqpack_step(packed_batch(), "train").backward()
    lines = [r.getMessage() for r in caplog.records if "not chunked" in r.getMessage()]
    assert len(lines) == 1 and "Sequential" in lines[0]


def test_a_logit_transform_the_head_does_not_know_is_caught_by_the_probe(caplog: pytest.LogCaptureFixture) -> None:
    module = hf_lm("llama")
    model = module.model
    original = type(model).forward

    def doubled(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = doubled.__get__(model)
    with caplog.at_level(logging.INFO):
        assert module.seqpack_output_head() is None
        assert module.seqpack_output_head() is None
    lines = [r.getMessage() for r in caplog.records if "not chunked" in r.getMessage()]
    assert len(lines) == 1 and "does not reproduce" in lines[0]


def test_an_overridden_loss_keeps_the_full_logits(caplog: pytest.LogCaptureFixture) -> None:
    class Custom(ReferenceLM):
        def seqpack_loss(self, logits: torch.Tensor, batch: Any) -> Any:
            return token_cross_entropy(logits * 0.5, batch["labels"])

    torch.manual_seed(0)
    module = Custom(vocab_size=VOCAB, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, intermediate_size=32)
    with caplog.at_level(logging.INFO):
        assert module.seqpack_output_head() is None
    assert any("seqpack_loss is overridden" in r.getMessage() for r in caplog.records)


def test_chunk_size_and_head_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="loss_chunk_size"):
        ReferenceLM(loss_chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        OutputHead(weight=torch.zeros(3, 2), chunk_size=0)
    with pytest.raises(ValueError, match="hidden size"):
        chunked_cross_entropy(torch.zeros(1, 2, 4), OutputHead(weight=torch.zeros(3, 2)), torch.zeros(1, 2).long())
