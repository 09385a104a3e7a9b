"""A training step with context parallelism (CP) has the gradient of the same step without it.

Normalisation (see ``lit_seqpack.model.loss.exact_loss``): each CP rank's loss covers only its local tokens, so
the gradient of a microbatch is the SUM of its CP ranks' gradients. DDP averages over every rank (``dp x cp``
of them), and the exact loss multiplies by ``world_size (dp) x context_parallel_size x accumulate_grad_batches /
step_loss_tokens``, which turns that average into the sum over CP ranks and the mean over the step's tokens.

The ground truth is ``tests/model/test_exact_loss.reference_gradients``: every sample of the step right-padded
into one batch, through the plain model (no packing, no CP), token-mean cross-entropy, float64.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.batching.collate import PackedCollator
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.parallel.context import shard_packed_batch
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests.model.test_exact_loss import (
    assert_gradients_match,
    loss_tokens,
    make_module,
    make_samples,
    reference_gradients,
    spawned_step_trainer,
)

CP = 2
# 2 data-parallel ranks x 2 microbatches (accumulation); data-parallel rank 1 ends on a lock-step dummy
GROUPS = [[[0, 1, 2], [3, 4, 5, 6]], [[7, 8, 9, 10, 11, 12, 13], []]]


def _packed_step(samples: list[dict[str, list[int]]]) -> list[list[dict[str, Any]]]:
    """The collated (unsharded) microbatches of every data-parallel rank, documents padded to 2 x CP."""
    total = sum(loss_tokens(samples[i]) for rank in GROUPS for micro in rank for i in micro)
    collate = PackedCollator(pad_document_to_multiple_of=2 * CP, pad_to_multiple_of=8)
    meta = {"step": 0, "step_loss_tokens": total, "world_size": len(GROUPS), "accumulate_grad_batches": 2}
    return [
        [
            collate(Microbatch([samples[i] for i in micro], meta=MicrobatchMeta(**meta, is_empty=not micro)))
            for micro in rank
        ]  # fmt: skip
        for rank in GROUPS
    ]


KNOBS = {"mode": "packing", "max_tokens": 64, "context_parallel_size": CP, "seed": 1}
"""The DataModule's settings in the Lightning step."""


def _worker(cp_rank: int, port: int, out_dir: str) -> None:
    """Both CP steps on one pair of processes: by hand (``manual.pt``), then through Lightning (``lightning.pt``)."""
    join_ranks(cp_rank, CP, port)
    dist.init_process_group("gloo", rank=cp_rank, world_size=CP, timeout=COLLECTIVE_TIMEOUT)
    try:
        _manual_step(cp_rank, Path(out_dir, "manual.pt"))
        data = SeqPackDataModule(source=make_samples(count=20, seed=4), **KNOBS)
        trainer = spawned_step_trainer(CP, str(Path(out_dir, "lightning.pt")), start_method="popen")
        trainer.fit(make_module("reference"), datamodule=data)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of :func:`_worker`'s gradients (one spawned pair of processes for both tests)."""
    out = tmp_path_factory.mktemp("cp_training")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=CP, join=True)
    return out


def _manual_step(cp_rank: int, out_path: Path) -> None:
    """One CP rank; the 2 data-parallel ranks are simulated one after the other, each on its own model copy."""
    module = make_module("reference")  # float32, identical on both processes (seeded)
    batches = _packed_step(make_samples(count=14, seed=3))
    summed = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    for dp_batches in batches:
        model = copy.deepcopy(module)
        for batch in dp_batches:
            loss = model.training_step(shard_packed_batch(batch, CP, cp_rank), 0)
            (loss / len(dp_batches)).backward()  # Lightning divides by accumulate_grad_batches
        for name, p in model.named_parameters():
            summed[name] += p.grad
    for grad in summed.values():  # DDP: the mean over all dp x cp ranks
        dist.all_reduce(grad)
        grad /= len(batches) * CP
    if cp_rank == 0:
        torch.save(summed, out_path)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_process_cp_step_equals_the_unsharded_step(cp_steps: Path) -> None:
    samples = make_samples(count=14, seed=3)
    expected = reference_gradients(make_module("reference"), samples)
    grads = torch.load(cp_steps / "manual.pt")
    assert_gradients_match(grads, expected, rtol=1e-5)  # float32 CP vs float64 ground truth


def test_the_same_loop_without_cp_matches_too() -> None:
    """The simulation above, in one process and unsharded: it is the right stand-in for DDP + accumulation."""
    samples = make_samples(count=14, seed=3)
    module = make_module("reference")
    expected = reference_gradients(module, samples)
    summed = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    for dp_batches in _packed_step(samples):
        model = copy.deepcopy(module)
        for batch in dp_batches:
            (model.training_step(batch, 0) / len(dp_batches)).backward()
        for name, p in model.named_parameters():
            summed[name] += p.grad / len(GROUPS)
    assert_gradients_match(summed, expected, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_lightning_ddp_with_the_datamodule_cp_knob_equals_the_unsharded_step(cp_steps: Path) -> None:
    """End to end: SeqPackDataModule(context_parallel_size=2) + ReferenceLM under a 2-process DDP Trainer."""
    samples = make_samples(count=20, seed=4)
    planner = SeqPackDataModule(source=samples, **KNOBS)  # the same plan, read in this process
    planner.trainer = SimpleNamespace(
        world_size=CP,
        global_rank=0,
        accumulate_grad_batches=2,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
        fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0))),
    )
    planner.setup("fit")
    step = planner.train_dataloader().batch_sampler.plan.step_microbatches(0)[0]
    view = planner.pipeline.splits["train"][0]
    module = make_module("reference")
    expected = reference_gradients(module, [view[i] for micro in step for i in micro])
    assert_gradients_match(torch.load(cp_steps / "lightning.pt"), expected, rtol=1e-5)
