"""varlen_attention with windows, softcaps and sinks: every backend against the dense float64 reference."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from lit_seqpack.model.attention import BackendUnavailableError, override_backend, varlen_attention
from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func, reference_varlen_attention

LENGTHS = [9, 1, 14, 5, 3]
EXTRAS: list[dict[str, Any]] = [
    {"window": (3, 0)},
    {"window": (0, 0)},  # each query sees itself only
    {"window": (2, 1), "causal": False},
    {"window": (-1, 2), "causal": False},
    {"softcap": 0.7},
    {"sinks": True},
    {"window": (4, 0), "softcap": 0.5, "sinks": True},
]


def qkv(lengths: list[int] = LENGTHS, heads: int = 4, kv_heads: int = 2, dtype: torch.dtype = torch.float64) -> Any:
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, 8, generator=gen, dtype=torch.float64) * 2
    k, v = (torch.randn(total, kv_heads, 8, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, sinks)], cu


def call(fn: Any, tensors: list[torch.Tensor], cu: torch.Tensor, extras: dict[str, Any], **kw: Any) -> torch.Tensor:
    q, k, v, sinks = tensors
    extras = dict(extras)
    if extras.pop("sinks", False):
        extras["sinks"] = sinks
    return fn(q, k, v, cu, max(LENGTHS), **extras, **kw)


@pytest.mark.parametrize("extras", EXTRAS)
def test_sdpa_matches_the_reference_forward_and_backward(extras: dict[str, Any]) -> None:
    tensors, cu = qkv()
    out = call(varlen_attention, tensors, cu, extras, backend="sdpa")
    grads = torch.autograd.grad(out.square().sum(), tensors, allow_unused=True)
    ref_tensors = [t.detach().clone().requires_grad_() for t in tensors]
    ref = call(reference_varlen_attention, ref_tensors, cu, extras)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_tensors, allow_unused=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_the_reference_window_is_the_hand_written_band() -> None:
    """Query i of a segment sees keys i - left .. i (causal): checked on one-hot values."""
    length, left = 7, 2
    q = k = torch.zeros(length, 1, length, dtype=torch.float64)  # equal scores: the visible values are averaged
    v = torch.eye(length, dtype=torch.float64)[:, None, :]  # value j is one-hot at j
    out = reference_varlen_attention(q, k, v, torch.tensor([0, length], dtype=torch.int32), length, window=(left, 0))
    visible = (out[:, 0] > 0).int()
    expected = [[1 if i - left <= j <= i else 0 for j in range(length)] for i in range(length)]
    assert visible.tolist() == expected


def test_a_window_at_least_as_long_as_the_document_is_a_no_op() -> None:
    (q, k, v, _), cu = qkv(dtype=torch.float32)
    plain = varlen_attention(q, k, v, cu, max(LENGTHS), backend="sdpa")
    for window in [(max(LENGTHS) - 1, 0), (10**6, 0), (-1, 0), (-1, -1)]:
        assert torch.equal(varlen_attention(q, k, v, cu, max(LENGTHS), window=window, backend="sdpa"), plain)
    assert not torch.equal(varlen_attention(q, k, v, cu, max(LENGTHS), window=(12, 0), backend="sdpa"), plain)


@pytest.mark.parametrize("extras", [e for e in EXTRAS if "sinks" not in e])
def test_the_flash_attn_route_passes_window_size_and_softcap(extras: dict[str, Any]) -> None:
    tensors, cu = qkv(dtype=torch.float32)
    expected = call(varlen_attention, tensors, cu, extras, backend="sdpa")
    seen: list[dict[str, Any]] = []

    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return reference_flash_attn_varlen_func(*args, **kwargs)

    kernel.__signature__ = inspect.signature(reference_flash_attn_varlen_func)  # type: ignore[attr-defined]
    with override_backend("flash_attn", kernel):
        routed = call(varlen_attention, tensors, cu, extras, backend="flash_attn")
    torch.testing.assert_close(routed, expected, atol=1e-5, rtol=0)
    assert ("window_size" in seen[0]) == ("window" in extras) and ("softcap" in seen[0]) == ("softcap" in extras)


def fake_torch_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                           enable_gqa=False):  # fmt: skip
    """A CPU stand-in with torch.nn.attention.varlen.varlen_attn's signature ((-1, 0): causal)."""
    causal = window_size[1] == 0
    return reference_varlen_attention(query, key, value, cu_seq_q, max_q, causal=causal, softmax_scale=scale,
                                      window=tuple(window_size))  # fmt: skip


def test_the_torch_varlen_route_passes_the_window_and_refuses_softcap_and_sinks() -> None:
    tensors, cu = qkv(dtype=torch.float32)
    with override_backend("torch_varlen", fake_torch_varlen_attn):
        for extras in [{"window": (3, 0)}, {"window": (2, 1), "causal": False}, {}]:
            routed = call(varlen_attention, tensors, cu, extras, backend="torch_varlen")
            expected = call(varlen_attention, tensors, cu, extras, backend="sdpa")
            torch.testing.assert_close(routed, expected, atol=1e-5, rtol=0)
        for extras, name in [({"softcap": 0.5}, "softcap"), ({"sinks": True}, "sinks")]:
            with pytest.raises(BackendUnavailableError, match=f"cannot honour {name}"):
                call(varlen_attention, tensors, cu, extras, backend="torch_varlen")
            # "auto" skips the kernels that cannot honour it and computes it exactly with sdpa
            auto = call(varlen_attention, tensors, cu, extras, backend="auto")
            torch.testing.assert_close(auto, call(varlen_attention, tensors, cu, extras, backend="sdpa"))


def test_flash_attn_refuses_sinks_by_name() -> None:
    tensors, cu = qkv(dtype=torch.float32)
    with (
        override_backend("flash_attn", reference_flash_attn_varlen_func),
        pytest.raises(BackendUnavailableError, match="cannot honour sinks"),
    ):
        call(varlen_attention, tensors, cu, {"sinks": True}, backend="flash_attn")


@pytest.mark.parametrize(
    ("extras", "match"),
    [
        ({"window": 4}, "window"),
        ({"window": (4, -2)}, "window"),
        ({"window": (True, 0)}, "window"),
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": float("inf")}, "softcap"),
        ({"sinks": torch.zeros(3)}, "sinks"),
    ],
)
def test_bad_extras_raise(extras: dict[str, Any], match: str) -> None:
    (q, k, v, _), cu = qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, k, v, cu, max(LENGTHS), backend="sdpa", **extras)


@pytest.mark.parametrize("extras", [{"window": (3, 0)}, {"softcap": 1.0}, {"sinks": True}])
def test_context_parallel_attention_refuses_windows_softcaps_and_sinks(extras: dict[str, Any]) -> None:
    from lit_seqpack.model.cp_attention import context_parallel

    tensors, cu = qkv(dtype=torch.float32)
    name = next(iter(extras))
    with context_parallel(group=None), pytest.raises(NotImplementedError, match=f"does not support {name}="):
        call(varlen_attention, tensors, cu, extras)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("extras", [e for e in EXTRAS if "sinks" not in e])
def test_cuda_kernels_match_sdpa_with_windows_and_softcaps(extras: dict[str, Any], dtype: torch.dtype) -> None:
    from lit_seqpack.model.attention import available_backends

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tensors, cu = qkv(dtype=dtype)
    tensors, cu = [t.detach().cuda() for t in tensors], cu.cuda()
    expected = call(varlen_attention, tensors, cu, extras, backend="sdpa").float()
    for backend in available_backends("cuda", dtype):
        if backend in ("sdpa", "flex") or ("softcap" in extras and backend == "torch_varlen"):
            continue  # flex: tests/model/test_flex_attention.py (each new mask is a compilation: kept to a few)
        out = call(varlen_attention, tensors, cu, extras, backend=backend).float()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2, msg=f"{backend} {extras}")
