"""Tests for lit_seqpack.model.isolation: the structural leak guard sees leaks of any size and names the cause."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from lit_seqpack.model.attention import varlen_attention
from lit_seqpack.model.isolation import (
    PackingLeakError,
    check_packing_equivalence,
    documents_batch,
    probe_packing_isolation,
)
from lit_seqpack.model.mixin import PackedSequenceMixin

VOCAB = 16


class MixLM(PackedSequenceMixin, LightningModule):
    """Packed varlen attention, plus an optional tiny leak: ``scale * x[t - shift]`` added to token ``t``."""

    def __init__(self, *, scale: float = 0.0, shift: int = 1, train_only: bool = False, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(8, VOCAB)
        self.scale, self.shift, self.train_only = scale, shift, train_only

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        x = self.drop(self.embed(input_ids))
        if self.scale and (self.training or not self.train_only):
            x = x + self.scale * F.pad(x, (0, 0, self.shift, 0))[:, : x.shape[1]]  # reaches `shift` tokens back
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).unbind(2)
        attn = varlen_attention(q[0], k[0], v[0], cu_seqlens, kwargs["max_seqlen"], backend="sdpa")[None]
        return self.head(x + attn.reshape(x.shape))


def _batch() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return documents_batch([torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 7)])


def test_an_isolated_model_passes_in_both_modes_with_dropout_on() -> None:
    model = MixLM(dropout=0.5).train()
    rng = torch.get_rng_state()
    report = probe_packing_isolation(model, _batch())
    assert report.passed and report.method == "gradient" and report.training and len(report.lengths) == 3
    assert torch.equal(torch.get_rng_state(), rng)  # training's randomness is untouched
    assert all(p.grad is None for p in model.parameters())
    assert probe_packing_isolation(model.eval(), _batch()).passed


@pytest.mark.parametrize("shift", [1, 12])
def test_a_leak_far_below_any_logit_tolerance_is_refused(shift: int) -> None:
    model = MixLM(scale=1e-7, shift=shift)
    assert check_packing_equivalence(model, _batch(), atol=1e-5).passed  # numerically invisible...
    with pytest.raises(PackingLeakError, match=r"MixLM does not keep the documents .* mode: dynamic"):
        probe_packing_isolation(model, _batch())  # ...structurally not


def test_a_train_mode_only_leak_is_probed_again_in_train_mode() -> None:
    """Lightning's sanity check validates (eval) first: the first training batch must still be probed."""
    model = MixLM(scale=1e-3, train_only=True)
    model.eval()
    model.validation_step(_batch(), 0)
    model.train()
    with pytest.raises(PackingLeakError, match=r"train mode"):
        model.training_step(_batch(), 0)


def test_the_probe_runs_under_the_active_precision() -> None:
    model = MixLM()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = probe_packing_isolation(model, _batch())
    assert report.passed and report.dtype == torch.bfloat16


def test_the_probe_sees_through_a_ddp_wrapper(tmp_path: Any) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        leaky = torch.nn.parallel.DistributedDataParallel(MixLM(scale=1e-6))
        with pytest.raises(PackingLeakError, match="MixLM"):
            probe_packing_isolation(leaky, _batch())
        assert probe_packing_isolation(torch.nn.parallel.DistributedDataParallel(MixLM()), _batch()).passed
    finally:
        dist.destroy_process_group()


def test_probe_documents_are_longer_than_the_windows_and_kernels_a_config_declares() -> None:
    from lit_seqpack.model.isolation import MAX_PROBE_LENGTH, probe_lengths

    class Configured(MixLM):
        def __init__(self, **sizes: int) -> None:
            super().__init__()
            self.config = type("Config", (), {"to_dict": lambda _: sizes})()

    assert min(probe_lengths(Configured(sliding_window=100, conv_L_cache=3))) > 100
    assert max(probe_lengths(Configured(sliding_window=4096))) <= MAX_PROBE_LENGTH  # cheap, whatever the window
    assert max(probe_lengths(Configured(sliding_window=100, max_position_embeddings=32))) <= 32
    lengths = probe_lengths(MixLM())
    assert len(set(lengths)) == 3 and all(sum(lengths) % d for d in range(2, sum(lengths)))  # a prime total


def test_a_model_without_embedding_modules_is_checked_by_perturbation() -> None:
    class OneHot(MixLM):
        def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            x = F.one_hot(input_ids, VOCAB).float() @ self.embed.weight  # no nn.Embedding call
            x = x + self.scale * F.pad(x, (0, 0, 1, 0))[:, : x.shape[1]]
            return self.head(x)

    assert probe_packing_isolation(OneHot(), _batch()).method == "perturbation"
    with pytest.raises(PackingLeakError, match="logits that changed"):
        probe_packing_isolation(OneHot(scale=1e-3), _batch())
