"""The attention backend records: each record's facts agree with what the backend computes or refuses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from lit_seqpack.model import attention
from lit_seqpack.model.attention import (
    ATTENTION_BACKENDS,
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    backend_table,
    override_backend,
    varlen_attention,
)
from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func, reference_varlen_attention
from tests.model.test_attention_extras import fake_torch_varlen_attn

LENGTHS = [5, 1, 7, 3]
FEATURES: dict[str, dict[str, Any]] = {
    "causal": {"causal": False},  # non-causal: a backend that ignored ``causal`` would mask the future anyway
    "window": {"window": (2, 0)},
    "softcap": {"softcap": 0.5},
    "sinks": {"sinks": True},
}
CPU_KERNELS = {"flash_attn": reference_flash_attn_varlen_func, "torch_varlen": fake_torch_varlen_attn}


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, 2, 8, generator=gen) * 2 for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k, v, torch.randn(2, generator=gen)], cu


def _run(backend: str, feature: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``backend``'s output with ``feature`` asked (its kernel a CPU stand-in) and the float64 reference's."""
    (q, k, v, sinks), cu = _inputs()
    extras = dict(FEATURES[feature])
    if extras.pop("sinks", False):
        extras["sinks"] = sinks
    kernel = CPU_KERNELS.get(backend)
    with override_backend(backend, kernel) if kernel is not None else _nothing():
        out = varlen_attention(q, k, v, cu, max(LENGTHS), backend=backend, **extras)
    wide = {key: val.double() if isinstance(val, torch.Tensor) else val for key, val in extras.items()}
    expected = reference_varlen_attention(q.double(), k.double(), v.double(), cu, max(LENGTHS), **wide)
    return out, expected.float()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_honours_is_what_the_backend_computes(backend: str, feature: str) -> None:
    if feature in ATTENTION_BACKENDS[backend].honours:
        out, expected = _run(backend, feature)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    else:  # refused by name, and rightly: the backend claiming it would compute something else (or fail)
        with pytest.raises(BackendUnavailableError, match=f"cannot honour {feature}; .*backend='sdpa'.* computes it"):
            _run(backend, feature)
        record = ATTENTION_BACKENDS[backend]
        claimed = dataclasses.replace(record, honours=record.honours | {feature})
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "ATTENTION_BACKENDS", MappingProxyType({**ATTENTION_BACKENDS, backend: claimed}))
            try:
                out, expected = _run(backend, feature)
            except (BackendUnavailableError, TypeError, ValueError):
                return
        assert not torch.allclose(out, expected, atol=1e-3)


def test_requirements_decide_availability_and_errors() -> None:
    kernels = [name for name, record in ATTENTION_BACKENDS.items() if record.load is not None and record.devices]
    assert available_backends("cpu") == [name for name in BACKENDS if "cpu" in ATTENTION_BACKENDS[name].devices or
                                         not ATTENTION_BACKENDS[name].devices]  # fmt: skip
    (q, k, v, _), cu = _inputs()
    for name in kernels:
        record = ATTENTION_BACKENDS[name]
        with pytest.raises(BackendUnavailableError, match=rf"runs on CUDA tensors only .*backend='{record.fallback}'"):
            varlen_attention(q, k, v, cu, max(LENGTHS), backend=name)
    assert [name for name, record in ATTENTION_BACKENDS.items() if record.fallback is None] == ["sdpa"]


def test_the_docs_table_is_the_records() -> None:
    page = (Path(__file__).parents[2] / "docs" / "packing.md").read_text()
    assert backend_table() in page
    for name, record in ATTENTION_BACKENDS.items():
        assert f"| `{name}` |" in backend_table() and all(f"`{f}`" in backend_table() for f in record.honours)
