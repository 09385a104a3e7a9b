from __future__ import annotations

import inspect
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lit_seqpack.model.attention as attention
from lit_seqpack.model.attention import (
    BackendUnavailableError,
    available_backends,
    override_backend,
    use_backend,
    varlen_attention,
)
from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func, reference_varlen_attention

LENGTHS = [3, 5, 2, 2]  # DESIGN.md's example: docs of 3, 5, 2 tokens and a padding tail of 2


def _cu(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _qkv(lengths, heads=4, kv_heads=4, head_dim=8, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    shapes = [(total, heads, head_dim), (total, kv_heads, head_dim), (total, kv_heads, head_dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_() for s in shapes]


def _assert_matches_reference(
    fn, lengths, *, heads, kv_heads, causal, scale, atol, rtol=0.0, head_dim=8, dtype=torch.float64, device="cpu"
):
    q, k, v = _qkv(lengths, heads, kv_heads, head_dim, dtype=dtype, device=device)
    cu, max_len = _cu(lengths, device), max(lengths)
    out = fn(q, k, v, cu, max_len, causal=causal, softmax_scale=scale)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad_out.to(device, dtype))
    ref_inputs = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref = reference_varlen_attention(*ref_inputs, _cu(lengths), max_len, causal=causal, softmax_scale=scale)
    ref.backward(grad_out)
    assert out.shape == (sum(lengths), heads, head_dim)
    torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=rtol)
    for x, r in zip((q, k, v), ref_inputs, strict=True):
        torch.testing.assert_close(x.grad.double().cpu(), r.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_matches_reference_forward_and_backward(causal, heads, kv_heads, scale):
    fn = lambda *a, **kw: varlen_attention(*a, **kw, backend="sdpa")  # noqa: E731
    _assert_matches_reference(fn, LENGTHS, heads=heads, kv_heads=kv_heads, causal=causal, scale=scale, atol=1e-12)


def test_sdpa_fp32_is_close_to_float64_reference():
    fn = lambda *a, **kw: varlen_attention(*a, **kw, backend="sdpa")  # noqa: E731
    _assert_matches_reference(
        fn, [7, 1, 16], heads=4, kv_heads=2, causal=True, scale=None, atol=1e-5, dtype=torch.float32
    )


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda xs: sum(xs) > 0), causal=st.booleans())
def test_sdpa_matches_reference_on_random_layouts(lengths, causal):
    q, k, v = _qkv(lengths, 4, 2)
    cu, max_len = _cu(lengths), max(lengths)
    out = varlen_attention(q, k, v, cu, max_len, causal=causal, backend="sdpa")
    torch.testing.assert_close(out, reference_varlen_attention(q, k, v, cu, max_len, causal=causal), atol=1e-12, rtol=0)


def test_documents_are_isolated_in_backward():
    q, k, v = _qkv(LENGTHS, 4, 2)
    out = varlen_attention(q, k, v, _cu(LENGTHS), 5, backend="sdpa")
    out[3:8].sum().backward()  # the second document only
    for x in (q, k, v):
        assert torch.count_nonzero(x.grad[:3]) == 0 and torch.count_nonzero(x.grad[8:]) == 0
        assert torch.count_nonzero(x.grad[3:8]) > 0


def test_reference_equals_per_document_attention():
    q, k, v = _qkv(LENGTHS, 2, 2)
    packed = reference_varlen_attention(q, k, v, _cu(LENGTHS), 5)
    start = 0
    for length in LENGTHS:
        sl = slice(start, start + length)
        alone = reference_varlen_attention(q[sl], k[sl], v[sl], _cu([length]), length)
        torch.testing.assert_close(packed[sl], alone, atol=1e-14, rtol=0)
        start += length


def test_auto_picks_sdpa_on_cpu_and_kernels_need_cuda():
    assert available_backends("cpu") == ["sdpa", "flex"]  # flex: forward only on CPU, never picked by auto
    q, k, v = _qkv(LENGTHS)
    torch.testing.assert_close(
        varlen_attention(q, k, v, _cu(LENGTHS), 5), varlen_attention(q, k, v, _cu(LENGTHS), 5, backend="sdpa")
    )
    for name in ("flash_attn", "torch_varlen"):
        with pytest.raises(BackendUnavailableError, match=f"{name}.*CUDA tensors only"):
            varlen_attention(q, k, v, _cu(LENGTHS), 5, backend=name)


def test_kernels_need_half_precision_on_cuda():
    reason = attention._unavailable_reason("torch_varlen", torch.device("cuda"), torch.float32)
    assert "float16 or bfloat16" in reason
    assert "torch_varlen" in available_backends("cuda", torch.bfloat16)  # torch 2.13 ships varlen_attn


@pytest.mark.skipif(bool(attention.FLASH_ATTN_AVAILABLE), reason="flash-attn is installed")
def test_missing_flash_attn_says_how_to_install():
    reason = attention._unavailable_reason("flash_attn", torch.device("cuda"), torch.bfloat16)
    assert "pip install 'lit-seqpack[flash-attn]'" in reason and "ABI" in reason
    q, k, v = _qkv(LENGTHS)
    with pytest.raises(BackendUnavailableError, match=r"CUDA tensors only.*pip install 'lit-seqpack\[flash-attn\]'"):
        varlen_attention(q, k, v, _cu(LENGTHS), 5, backend="flash_attn")


def test_broken_flash_attn_import_mentions_abi(monkeypatch):
    attention._load_flash_attn.cache_clear()
    monkeypatch.setattr(attention, "FLASH_ATTN_AVAILABLE", True)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # lacks the function
    try:
        reason = attention._unavailable_reason("flash_attn", torch.device("cuda"), torch.float16)
    finally:
        attention._load_flash_attn.cache_clear()
    assert "installed but does not import" in reason and "ABI mismatch" in reason


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flash_attn_routing_with_reference_kernel(causal, kv_heads):
    spy = _Spy(reference_flash_attn_varlen_func)
    with override_backend("flash_attn", spy):
        assert available_backends("cpu") == ["flash_attn", "sdpa", "flex"]
        _assert_matches_reference(
            varlen_attention, LENGTHS, heads=4, kv_heads=kv_heads, causal=causal, scale=0.2, atol=1e-12
        )
    assert spy.calls == [{"dropout_p": 0.0, "softmax_scale": 0.2, "causal": causal}]
    assert available_backends("cpu") == ["sdpa", "flex"]


def _new_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    assert window_size in ((-1, -1), (-1, 0)) and (enable_gqa or query.shape[1] == key.shape[1])
    return reference_varlen_attention(
        query, key, value, cu_seq_q, max_q, causal=window_size == (-1, 0), softmax_scale=scale
    )


def _old_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert query.shape[1] == key.shape[1], "no GQA in this version"
    return reference_varlen_attention(query, key, value, cu_seq_q, max_q, causal=is_causal)


@pytest.mark.parametrize("kernel", [_new_torch_varlen, _old_torch_varlen])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_torch_varlen_routing_adapts_to_both_signatures(kernel, causal, scale):
    with override_backend("torch_varlen", kernel), use_backend("torch_varlen"):
        _assert_matches_reference(
            varlen_attention, LENGTHS, heads=4, kv_heads=2, causal=causal, scale=scale, atol=1e-12
        )


def test_installed_torch_varlen_uses_window_size():
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    assert {"window_size", "scale", "enable_gqa"} <= set(params) and "is_causal" not in params


def test_use_backend_forces_auto_and_restores():
    q, k, v = _qkv(LENGTHS)
    with use_backend("flash_attn"), pytest.raises(BackendUnavailableError, match="flash_attn"):
        varlen_attention(q, k, v, _cu(LENGTHS), 5)
    with use_backend("sdpa"):
        varlen_attention(q, k, v, _cu(LENGTHS), 5)
    assert attention._FORCED == [] and attention._OVERRIDES == {}
    with pytest.raises(ValueError, match="backend must be one of"):
        use_backend("triton").__enter__()
    with pytest.raises(ValueError, match="can be overridden"):
        override_backend("sdpa", reference_flash_attn_varlen_func).__enter__()


def _bad(**changes):
    q, k, v = _qkv(LENGTHS, 4, 2)
    args = {"q": q, "k": k, "v": v, "cu_seqlens": _cu(LENGTHS), "max_seqlen": 5, **changes}
    kwargs = {key: args.pop(key) for key in ("causal", "softmax_scale", "backend") if key in args}
    return args, kwargs


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.zeros(12, 32)}, "q must be a"),
        ({"k": torch.zeros(12, 2, 4, dtype=torch.float64)}, "k and v must be"),
        ({"v": torch.zeros(11, 2, 8, dtype=torch.float64)}, "k and v must be"),
        (
            {"k": torch.zeros(12, 3, 8, dtype=torch.float64), "v": torch.zeros(12, 3, 8, dtype=torch.float64)},
            "multiple",
        ),
        ({"v": torch.zeros(12, 2, 8)}, "share dtype"),
        ({"cu_seqlens": torch.tensor([0, 3, 8, 10, 12])}, "int32"),
        ({"cu_seqlens": torch.tensor([[0, 12]], dtype=torch.int32)}, "1-D"),
        ({"cu_seqlens": torch.tensor([1, 3, 8, 10, 12], dtype=torch.int32)}, "start at 0"),
        ({"cu_seqlens": torch.tensor([0, 3, 8, 10, 11], dtype=torch.int32)}, "end at total_tokens=12"),
        ({"cu_seqlens": torch.tensor([0, 8, 3, 10, 12], dtype=torch.int32)}, "non-decreasing"),
        ({"max_seqlen": 4}, "shorter than the longest segment"),
        ({"max_seqlen": torch.tensor(5)}, "Python int"),
        ({"max_seqlen": 0}, "positive"),
        ({"softmax_scale": -1.0}, "softmax_scale"),
        ({"backend": "xformers"}, "backend must be 'auto' or one of"),
    ],
)
def test_bad_inputs_raise_clear_errors(changes, message):
    args, kwargs = _bad(**changes)
    with pytest.raises(ValueError, match=message):
        varlen_attention(*args.values(), **kwargs)


def test_import_and_cpu_call_touch_neither_cuda_nor_flash_attn():
    code = (
        "import sys, torch; from lit_seqpack.model.attention import varlen_attention, available_backends;"
        "q = torch.randn(6, 2, 4); cu = torch.tensor([0, 2, 6], dtype=torch.int32);"
        "varlen_attention(q, q, q, cu, 4); available_backends('cpu');"
        "assert not torch.cuda.is_initialized() and 'flash_attn' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cuda_backends_match_reference(backend, causal, kv_heads):
    if backend not in available_backends("cuda", torch.bfloat16):
        pytest.skip(f"{backend} is not available on this machine")
    fn = lambda *a, **kw: varlen_attention(*a, **kw, backend=backend)  # noqa: E731
    lengths = [37, 128, 1, 90, 256]
    for dtype, tol in ((torch.bfloat16, 5e-2), (torch.float16, 1e-2)):
        _assert_matches_reference(
            fn, lengths, heads=4, kv_heads=kv_heads, causal=causal, scale=None, atol=tol, rtol=tol, head_dim=64,
            dtype=dtype, device="cuda",
        )  # fmt: skip
