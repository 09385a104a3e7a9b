"""The ``"flex"`` backend: FlexAttention with a document block mask, exact against ``"sdpa"`` (CPU: forward only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import lit_seqpack.model.flex_attention as flex
from lit_seqpack.model.attention import BackendUnavailableError, varlen_attention
from lit_seqpack.model.attention_reference import reference_varlen_attention
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder

LENGTHS = [5, 1, 140, 7, 3, 90]  # 246 tokens: documents straddle FlexAttention's 128-token blocks
CASES: dict[str, dict[str, Any]] = {
    "causal": {},
    "bidirectional": {"causal": False},
    "gqa": {"kv_heads": 1},
    "window": {"window": (4, 0)},
    "window both sides": {"causal": False, "window": (3, 2)},
    "softcap": {"softcap": 0.5},
    "sinks": {"sinks": True},
    "all at once": {"window": (6, 0), "softcap": 0.7, "sinks": True, "kv_heads": 2},
}


def cu(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _inputs(heads: int = 4, kv_heads: int = 4, device: str = "cpu", dtype: torch.dtype = torch.float32) -> list:
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, heads, 16, generator=gen) * 2
    k, v = (torch.randn(total, kv_heads, 16, generator=gen) * 2 for _ in range(2))
    return [x.to(device, dtype) for x in (q, k, v, torch.randn(heads, generator=gen))]


@pytest.mark.parametrize("case", list(CASES))
def test_flex_equals_sdpa_under_no_grad(case: str) -> None:
    extras = dict(CASES[case])
    q, k, v, sinks = _inputs(kv_heads=extras.pop("kv_heads", 4))
    if extras.pop("sinks", False):
        extras["sinks"] = sinks
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu(LENGTHS), max(LENGTHS), backend="flex", **extras)
        expected = varlen_attention(q, k, v, cu(LENGTHS), max(LENGTHS), backend="sdpa", **extras)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    wide = {key: val.double() if isinstance(val, torch.Tensor) else val for key, val in extras.items()}
    truth = reference_varlen_attention(q.double(), k.double(), v.double(), cu(LENGTHS), max(LENGTHS), **wide)
    torch.testing.assert_close(out.double(), truth, atol=1e-5, rtol=0)


def test_training_with_flex_on_cpu_is_refused_by_name() -> None:
    q, k, v, sinks = _inputs()
    with pytest.raises(BackendUnavailableError, match=r"'flex' cannot train on CPU.*backend='sdpa'"):
        varlen_attention(q.requires_grad_(), k, v, cu(LENGTHS), max(LENGTHS), backend="flex")
    with pytest.raises(BackendUnavailableError, match="cannot train on CPU"):  # a sink that learns counts too
        varlen_attention(q.detach(), k, v, cu(LENGTHS), max(LENGTHS), sinks=sinks.requires_grad_(), backend="flex")
    with torch.no_grad():  # the same tensors in inference: fine
        varlen_attention(q, k, v, cu(LENGTHS), max(LENGTHS), sinks=sinks, backend="flex")


def test_one_block_mask_per_batch_shared_by_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[tuple[Any, ...]] = []
    build = flex._build

    def counted(cu_seqlens: torch.Tensor, total: int, causal: bool, window: Any) -> Any:
        builds.append((tuple(cu_seqlens.tolist()), causal, window))
        return build(cu_seqlens, total, causal, window)

    monkeypatch.setattr(flex, "_build", counted)
    flex.clear_block_mask_cache()
    config = ReferenceConfig(vocab_size=32, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
    model = ReferenceDecoder(config).eval()
    ids = torch.randint(0, 32, (1, sum(LENGTHS)))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        for _ in range(2):  # the same batch again: the cache answers
            model(ids, position_ids=positions, cu_seqlens=cu(LENGTHS), max_seqlen=max(LENGTHS), attn_backend="flex")
        assert len(builds) == 1  # 3 layers x 2 forwards, one mask
        model(ids, position_ids=positions, cu_seqlens=cu([100, 146]), max_seqlen=146, attn_backend="flex")
    assert len(builds) == 2  # a new layout: a new mask
    mask = flex.document_block_mask(cu(LENGTHS), sum(LENGTHS))
    assert flex.document_block_mask(cu(LENGTHS), sum(LENGTHS), window=(4, 0)) is not mask  # one per window


def test_the_block_mask_is_the_document_mask() -> None:
    lengths = [3, 2, 4]
    dense = flex.document_block_mask(cu(lengths), 9)
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(dense.mask_mod, None, None, 9, 9, device="cpu")[0, 0].int().tolist()
    expected = [[int(d == e and j <= i) for j, e in enumerate([0, 0, 0, 1, 1, 2, 2, 2, 2])]
                for i, d in enumerate([0, 0, 0, 1, 1, 2, 2, 2, 2])]  # fmt: skip
    assert mask == expected


def test_compiled_flex_is_one_graph_for_every_document_count() -> None:
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda q, k, v, c, m: varlen_attention(q, k, v, c, m, backend="flex", window=(8, 0)),
                       backend="eager", fullgraph=True)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    graphs = []
    try:
        with torch.no_grad():
            for step in range(6):
                # 3..8 documents, rows over one 128-token block (a row within one block is a graph of its own)
                lengths = torch.randint(45, 60, (3 + step,), generator=gen).tolist()
                q, k, v = (torch.randn(sum(lengths), 4, 8, generator=gen) for _ in range(3))
                out = fn(q, k, v, cu(lengths), max(lengths))
                ref = reference_varlen_attention(q, k, v, cu(lengths), max(lengths), window=(8, 0))
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
                graphs.append(int(counters["stats"]["unique_graphs"]))
    finally:
        torch._dynamo.reset()
    assert graphs[2:] == [graphs[1]] * 4, graphs  # the first layout, one dynamic-shape recompilation, then none


def test_hf_model_routes_to_flex() -> None:
    pytest.importorskip("transformers")
    from lit_seqpack.model.hf import hf_model_inputs, prepare_hf_model
    from lit_seqpack.model.isolation import documents_batch
    from tests.model.test_hf import random_documents, tiny_llama, with_padding_tail

    model = prepare_hf_model(tiny_llama())
    batch = with_padding_tail(documents_batch(random_documents()), 3)
    with torch.no_grad():
        expected = model(**hf_model_inputs(batch, backend="sdpa")).logits
        routed = model(**hf_model_inputs(batch, backend="flex")).logits
    torch.testing.assert_close(routed, expected, atol=1e-5, rtol=0)
    with pytest.raises(BackendUnavailableError, match="'flex' cannot train on CPU"):
        model(**hf_model_inputs(batch, backend="flex"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gqa", "all at once"])  # each new mask or score_mod is a compilation: two cases
def test_flex_trains_on_cuda_like_sdpa(case: str) -> None:
    """On CUDA the compiled kernel runs forward and backward: outputs and gradients match ``"sdpa"``'s."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    extras = dict(CASES[case])
    inputs = _inputs(kv_heads=extras.pop("kv_heads", 4), device="cuda", dtype=torch.bfloat16)
    with_sinks = extras.pop("sinks", False)
    results = []
    for backend in ("flex", "sdpa"):
        q, k, v, sinks = (x.detach().clone().requires_grad_() for x in inputs)
        kwargs = dict(extras, sinks=sinks) if with_sinks else extras
        out = varlen_attention(q, k, v, cu(LENGTHS, "cuda"), max(LENGTHS), backend=backend, **kwargs)
        out.float().square().sum().backward()
        results.append([out, q.grad, k.grad, v.grad])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("model_type", ["gemma2-tight-cap", "gpt_oss"])
def test_hf_windows_softcaps_and_sinks_through_flex_equal_the_stock_model_per_document(model_type: str) -> None:
    """Gemma2 (alternating windows, a cap that bites) and GPT-OSS (sinks, windows) packed through flex."""
    pytest.importorskip("transformers")
    import copy

    from lit_seqpack.model.hf import hf_model_inputs, prepare_hf_model
    from lit_seqpack.model.isolation import documents_batch
    from tests.model.test_hf_windows import documents, per_document, stock_eager

    stock = stock_eager(model_type)
    model = prepare_hf_model(copy.deepcopy(stock))
    docs = documents()
    with torch.no_grad():
        packed = model(**hf_model_inputs(documents_batch(docs), backend="flex")).logits[0]
    torch.testing.assert_close(packed, per_document(stock, docs), atol=1e-5, rtol=0)
