"""Context-parallel attention: 2 gloo processes, each with its shard, against the unsharded computation."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_seqpack.data.batching.collate import PackedCollator
from lit_seqpack.model.attention import route_varlen_attention, varlen_attention
from lit_seqpack.model.attention_reference import reference_varlen_attention
from lit_seqpack.model.cp_attention import (
    all_gather_tokens,
    context_parallel,
    context_parallel_attention,
    context_parallel_scope,
)
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder
from lit_seqpack.parallel.context import shard_packed_batch, shard_tokens, unshard_tokens
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S

CP = 2
# documents of 12, 20, 4, 8 tokens and a padding tail of 4: every segment a multiple of 2 x CP
CU = [0, 12, 32, 36, 44, 48]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _attention_errors(rank: int, group: object, causal: bool) -> dict[str, float]:
    """Forward and backward of the sharded attention vs the unsharded reference (float32)."""
    gen = torch.Generator().manual_seed(11)
    cu = torch.tensor(CU, dtype=torch.int32)
    q = torch.randn(CU[-1], 4, 8, generator=gen)
    k, v = torch.randn(2, CU[-1], 2, 8, generator=gen)  # GQA: 4 query heads, 2 kv heads
    weight = torch.randn(CU[-1], 4, 8, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_varlen_attention(*full, cu, 20, causal=causal)
    (expected * weight).sum().backward()
    local = [shard_tokens(t, cu, CP, rank, dim=0).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cu, 20, group=group, causal=causal)
    (out * shard_tokens(weight, cu, CP, rank, dim=0)).sum().backward()
    errors = {"forward": _rel(out, shard_tokens(expected, cu, CP, rank, dim=0))}
    for name, mine, ref in zip("qkv", local, full, strict=True):
        errors[f"grad_{name}"] = _rel(mine.grad, shard_tokens(ref.grad, cu, CP, rank, dim=0))
    gathered = all_gather_tokens(out, cu, group)  # every rank sees the whole row
    errors["all_gather_tokens"] = _rel(gathered, expected)
    with context_parallel(group):  # the route: plain varlen_attention calls become context parallel
        routed = varlen_attention(*local, cu, 20, causal=causal, backend="sdpa")
    errors["routed"] = _rel(routed, out)
    return errors


def _model_errors(rank: int) -> dict[str, float]:
    """The reference decoder's logits and gradients on its shard vs the unsharded packed row."""
    torch.manual_seed(0)
    model = ReferenceDecoder(ReferenceConfig.preset("tiny"))
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 15, 3, 6)]
    batch = PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=4)([{"input_ids": d} for d in docs])
    full = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"])
    full.square().mean().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shard = shard_packed_batch(batch, CP, rank)
    with context_parallel_scope(shard) as group:
        logits = model(
            shard["input_ids"],
            position_ids=shard["position_ids"],
            cu_seqlens=shard["cu_seqlens"],
            max_seqlen=shard["max_seqlen"],
        )
    logits.square().sum().div(full.numel()).backward()  # this rank's share of the global mean
    for p in model.parameters():  # the gradient of a CP group is the SUM of its ranks' gradients
        dist.all_reduce(p.grad, group=group)
    errors = {"logits": _rel(all_gather_tokens(logits[0], shard["cu_seqlens"], group)[None], full)}
    errors["grads"] = max(_rel(p.grad, expected_grads[n]) for n, p in model.named_parameters())
    # negative control, checked separately: averaging over the CP group instead of summing is off by half
    errors["averaged_grads (must fail)"] = max(
        _rel(p.grad / CP, expected_grads[n]) for n, p in model.named_parameters()
    )
    return errors


def _hf_errors(rank: int) -> dict[str, float]:
    """A transformers Llama through lit_seqpack's attention function is context parallel as it is."""
    from tests.model.test_exact_loss import make_module

    module = make_module("hf")
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (9, 15, 3, 6)]
    batch = PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=4)([{"input_ids": d} for d in docs])
    full = module.seqpack_forward(batch)
    shard = shard_packed_batch(batch, CP, rank)
    with context_parallel_scope(shard) as group:
        local = module.seqpack_forward(shard)
    return {"hf_logits": _rel(all_gather_tokens(local[0], shard["cu_seqlens"], group)[None], full)}


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CP, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        group = dist.new_group([0, 1])
        outcome = {f"causal={c}": _attention_errors(rank, group, c) for c in (True, False)}
        outcome["model"] = _model_errors(rank) | _hf_errors(rank)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sharded_attention_and_model_equal_the_unsharded_computation(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=CP, join=True)
    for rank in range(CP):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["model"].pop("averaged_grads (must fail)") > 0.4
        for case, errors in outcome.items():
            for name, error in errors.items():
                assert error <= 1e-5, f"rank {rank} {case} {name}: relative error {error:.3g}"  # measured <= 5e-7


def test_the_route_reaches_a_handler_that_may_call_varlen_attention_itself():
    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    calls = []

    def handler(q, k, v, cu_seqlens, max_seqlen, *, causal, softmax_scale, backend):
        calls.append((causal, softmax_scale, backend))
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, backend="sdpa") * 2

    with route_varlen_attention(handler):
        routed = varlen_attention(q, q, q, cu, 4, softmax_scale=0.5)
    assert calls == [(True, 0.5, "auto")]
    assert torch.allclose(routed, 2 * varlen_attention(q, q, q, cu, 4))
    assert torch.equal(varlen_attention(q, q, q, cu, 4), varlen_attention(q, q, q, cu, 4))  # route gone after


def test_scope_is_a_no_op_for_unsharded_batches_and_needs_torch_distributed_otherwise():
    batch = PackedCollator(pad_document_to_multiple_of=4)([{"input_ids": [1, 2, 3]}])
    with context_parallel_scope(batch) as group:
        assert group is None
    with (
        pytest.raises(RuntimeError, match="needs torch.distributed"),
        context_parallel_scope(shard_packed_batch(batch, 2, 0)),
    ):
        pass


def test_unshard_is_the_inverse_used_to_read_per_sequence_outputs():
    cu = torch.tensor([0, 16, 24, 48], dtype=torch.int32)
    logits = torch.randn(1, 48, 7)
    parts = [shard_tokens(logits, cu, 4, r) for r in range(4)]
    assert torch.equal(unshard_tokens(parts, cu), logits)
