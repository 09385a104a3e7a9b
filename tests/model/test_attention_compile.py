"""torch.compile over packed rows: no graph break and no recompilation per document count (CPU, backend="eager")."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from lit_seqpack.model.attention import varlen_attention
from lit_seqpack.model.attention_reference import reference_varlen_attention


def layouts(steps: int = 10, seed: int = 0) -> list[list[int]]:
    """Rows of 2 to 7 documents of 3 to 29 tokens: a new document count and row length almost every step."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 30, (2 + step % 6,), generator=gen).tolist() for step in range(steps)]


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.mark.parametrize("extras", [{}, {"window": (4, 0)}, {"softcap": 0.5}])
def test_compiled_varlen_attention_is_one_graph_for_every_layout(fresh_dynamo: Any, extras: dict[str, Any]) -> None:
    fn = torch.compile(lambda q, k, v, c, m: varlen_attention(q, k, v, c, m, backend="sdpa", **extras),
                       backend="eager", fullgraph=True)  # fmt: skip
    for lengths in layouts():
        gen = torch.Generator().manual_seed(len(lengths))
        q, k, v = (torch.randn(sum(lengths), 4, 8, generator=gen) for _ in range(3))
        out = fn(q, k, v, cu(lengths), max(lengths))
        ref = reference_varlen_attention(q, k, v, cu(lengths), max(lengths), **extras)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert fresh_dynamo["stats"]["unique_graphs"] <= 2  # the first layout, then one dynamic-shape graph


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_compiled_hf_model_on_packed_rows(fresh_dynamo: Any, model_type: str) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_seqpack.model.hf import hf_model_inputs, prepare_hf_model
    from lit_seqpack.model.isolation import documents_batch

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  sliding_window=8 if model_type == "mistral" else None)  # fmt: skip
    model = prepare_hf_model(AutoModelForCausalLM.from_config(config))
    compiled = torch.compile(copy.deepcopy(model), backend="eager")
    gen = torch.Generator().manual_seed(1)
    for lengths in layouts():
        batch = documents_batch([torch.randint(1, 64, (n,), generator=gen) for n in lengths])
        out = compiled(**hf_model_inputs(batch, backend="sdpa")).logits
        with torch.no_grad():
            expected = model(**hf_model_inputs(batch, backend="sdpa")).logits
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert fresh_dynamo["stats"]["unique_graphs"] <= 2


def _hf_causal_lm(chunked_loss: bool = True) -> Any:
    pytest.importorskip("transformers")
    from lit_seqpack.model.lm import HFCausalLM

    torch.manual_seed(0)
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    return HFCausalLM(config=config, attn_backend="sdpa", chunked_loss=chunked_loss).train()


def _packed_rows(steps: int) -> list[dict[str, Any]]:
    from lit_seqpack.model.isolation import documents_batch

    gen = torch.Generator().manual_seed(1)
    return [documents_batch([torch.randint(1, 64, (n,), generator=gen) for n in lengths]) for lengths in
            layouts(steps)]  # fmt: skip


@pytest.fixture
def probe_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The modules the isolation probe ran on, one entry per run (the mixin imports it at call time)."""
    import lit_seqpack.model.isolation as isolation

    runs: list[Any] = []
    probe = isolation.probe_packing_isolation

    def counted(model: Any, *args: Any, **kwargs: Any) -> Any:
        runs.append(model)
        return probe(model, *args, **kwargs)

    monkeypatch.setattr(isolation, "probe_packing_isolation", counted)
    return runs


@pytest.mark.parametrize("chunked_loss", [False, True], ids=["full-logits", "chunked"])
def test_the_isolation_probe_adds_no_graph_break_and_no_graph_to_a_compiled_model(
    fresh_dynamo: Any, probe_runs: list[Any], chunked_loss: bool
) -> None:
    """The probe's pass (hooks, gradient leaves, its own row length) runs eagerly: the compiled model never sees it."""
    module = _hf_causal_lm(chunked_loss)
    module.model.compile(backend="eager")
    for step, batch in enumerate(_packed_rows(3)):
        module.training_step(batch, step).backward()
    assert probe_runs == [module]
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])  # the probe's hooks broke 6 times
    assert fresh_dynamo["stats"]["unique_graphs"] <= 2  # as without the probe: the first layout, one dynamic graph


def test_the_isolation_probe_reached_from_compiled_code_runs_once_outside_the_graph(
    fresh_dynamo: Any, probe_runs: list[Any]
) -> None:
    """A compiled step (Fabric, ``torch.compile(module.training_step)``) meets the probe's call, never its body."""
    module = _hf_causal_lm()
    verify = torch.compile(module.seqpack_verify_packing, backend="eager")
    for row in _packed_rows(3):
        verify(row)
    assert probe_runs == [module]
    reasons = list(fresh_dynamo["graph_break"])
    assert reasons and all("torch.compiler.disable" in reason for reason in reasons), reasons


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_compiled_cuda_kernels_do_not_recompile_per_document_count(fresh_dynamo: Any, backend: str) -> None:
    from lit_seqpack.model.attention import available_backends

    if not torch.cuda.is_available() or backend not in available_backends("cuda", torch.bfloat16):
        pytest.skip(f"needs a CUDA device with {backend}")
    fn = torch.compile(lambda q, k, v, c, m: varlen_attention(q, k, v, c, m, backend=backend), fullgraph=True)
    for lengths in layouts(steps=12):
        q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = fn(q, k, v, cu(lengths).cuda(), max(lengths))
        ref = varlen_attention(q, k, v, cu(lengths).cuda(), max(lengths), backend="sdpa")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert not fresh_dynamo["graph_break"] and fresh_dynamo["stats"]["unique_graphs"] <= 3
