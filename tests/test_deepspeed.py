"""DeepSpeed: what Lightning's DeepSpeed strategy reads from the loader, and what the exact loss accepts under it.

DeepSpeed does not run on CPU: the CPU tests call Lightning's own ``DeepSpeedStrategy._auto_select_batch_size`` on
the DataModule's loader (the line that raised ``AttributeError: 'PackedBatchSampler' object has no attribute
'batch_size'``) and the mixin's layout check; the one-step gradient test needs CUDA and ``deepspeed``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.model.mixin import _check_step_layout
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match, make_module, reference_gradients
from tests.test_strategies import KNOBS, odd_samples


def _auto_batch_size(loader: object) -> int:
    source = SimpleNamespace(is_defined=lambda: True, dataloader=lambda: loader)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=source))
    return DeepSpeedStrategy._auto_select_batch_size(SimpleNamespace(lightning_module=SimpleNamespace(trainer=trainer)))


@pytest.mark.parametrize(("knobs", "expected"), [
    ({"mode": "packing", "max_tokens": 64}, 1),
    ({"mode": "dynamic", "max_tokens": 64}, 1),
    ({"mode": "padded", "max_tokens": None, "batch_size": 3}, 3),
])  # fmt: skip
def test_deepspeed_reads_one_microbatch_per_rank_from_the_batch_sampler(knobs, expected):
    loader = SeqPackDataModule(source=odd_samples(), **knobs).train_dataloader()
    assert loader.batch_sampler.batch_size == expected
    assert _auto_batch_size(loader) == expected


def test_accumulation_under_a_strategy_that_accumulates_itself_is_refused():
    """DeepSpeed divides by gradient_accumulation_steps in its backward, on top of Lightning: not verified, refused."""
    batch = {"world_size": 1, "accumulate_grad_batches": 2}
    strategy = SimpleNamespace(handles_gradient_accumulation=True)
    trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=2, strategy=strategy)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2 under SimpleNamespace, which accumulates"):
        _check_step_layout(batch, trainer)
    _check_step_layout(
        {**batch, "accumulate_grad_batches": 1}, SimpleNamespace(**{**vars(trainer), "accumulate_grad_batches": 1})
    )


class _FullGradients(GradientCapture):
    """ZeRO keeps gradients in its own partitioned buffers: read them with ``safe_get_full_grad``."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from deepspeed.utils import safe_get_full_grad

        if self.grads is None:
            self.grads = {n: safe_get_full_grad(p).detach().double().cpu() for n, p in pl_module.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_step_equals_the_big_padded_batch(stage):
    """Not run on the CPU development machine (no CUDA): one ZeRO step, accumulation 1, fp32, against fp64."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch import Trainer

    torch.backends.cuda.matmul.allow_tf32 = False
    data = SeqPackDataModule(source=odd_samples(), **KNOBS)
    data.setup("fit")
    first = next(iter(data.train_dataloader().batch_sampler))
    view = data.splits["train"][0]
    module = make_module("reference")
    expected = reference_gradients(module, [view[i] for i in first])
    capture = _FullGradients()
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=DeepSpeedStrategy(stage=stage),
        precision="32-true",
        max_steps=1,
        use_distributed_sampler=False,
        callbacks=[capture],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=SeqPackDataModule(source=odd_samples(), **KNOBS))
    assert_gradients_match(capture.grads, expected, rtol=1e-5)
