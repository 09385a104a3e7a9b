"""A weighted token loss (per-token weights in a declared field, or a fractional ``loss_mask``) keeps the exact step
normalisation: one optimizer step over packed or dynamic microbatches with accumulation (and simulated ranks) has
the gradient of one big padded batch with ``sum(w * ce) / sum(w)`` over every target of the step (float64)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.batching.context_parallel import ContextParallelCollator
from lit_seqpack.data.batching.loss_weights import StepWeightedBatchSampler, sample_loss_weight
from lit_seqpack.data.sources import TokenizedSource
from lit_seqpack.parallel.context import gather_packed_batches, shard_packed_batch
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests._samplers import planned_sampler
from tests.model.test_exact_loss import (
    PACKED_GROUPS,
    VOCAB,
    GradientCapture,
    assert_gradients_match,
    dynamic_groups,
    fit_one_step,
    make_module,
    make_samples,
    one_step_trainer,
    plain_logits,
    spawned_step_trainer,
)
from tests.model.test_exact_loss_ddp import GROUPS, PerRankBatches


def weighted_samples(field: str, count: int = 12, seed: int = 0) -> list[dict[str, Any]]:
    """The exact-loss samples with a weight per token in ``[0, 1]`` (some exactly 0), in ``field``."""
    gen = torch.Generator().manual_seed(seed + 100)
    out = []
    for sample in make_samples(count, seed):
        n = len(sample["input_ids"])
        weights = torch.rand(n, generator=gen, dtype=torch.float64)
        weights[torch.rand(n, generator=gen) < 0.2] = 0.0
        weights = weights.float().double().tolist()  # values float32 represents exactly: the reference's too
        if field == "loss_mask":  # a weighted loss_mask replaces labels: the prompt gets weight 0
            labels = sample["labels"]
            out.append(
                {
                    "input_ids": sample["input_ids"],
                    "loss_mask": [w * (lab != -100) for w, lab in zip(weights, labels, strict=True)],
                }
            )
        else:
            out.append(sample | {field: weights})
    return out


def reference_weighted_gradients(module: Any, samples: list[dict[str, Any]], field: str) -> dict[str, torch.Tensor]:
    """Gradient of ``sum(w * ce) / sum(w)`` over every target of one right-padded batch of ``samples`` (float64)."""
    model = copy.deepcopy(module).double()
    width = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    weights = torch.zeros(len(samples), width, dtype=torch.float64)
    attention_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.tensor(sample["input_ids"])
        weights[row, :n] = torch.tensor(sample[field], dtype=torch.float64)
        if "labels" in sample:
            labels[row, :n] = torch.tensor(sample["labels"])
        else:
            labels[row, :n] = torch.where(weights[row, :n] != 0, input_ids[row, :n], -100)
        attention_mask[row, :n] = 1
    logits = plain_logits(model, input_ids, attention_mask)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="none")
    w = torch.where(labels[:, 1:] != -100, weights[:, 1:], 0.0).reshape(-1)
    (torch.sum(w * ce) / w.sum()).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def weighted_step_batches(
    samples: list[dict[str, Any]], groups: list[list[list[int]]], mode: str, field: str, *, planned: bool = True
) -> list[list[dict[str, Any]]]:
    """Collated microbatches per rank; the meta carries the step's weight sum (``planned``) as the plan would."""
    world_size, accumulate = len(groups), len(groups[0])
    step_weight = math.fsum(sample_loss_weight(samples[i], field) for rank in groups for mb in rank for i in mb)
    step_tokens = sum(
        sum(x != 0 for x in samples[i][field][1:])
        if "labels" not in samples[i]
        else sum(lab != -100 for lab in samples[i]["labels"][1:])
        for rank in groups
        for mb in rank
        for i in mb
    )
    fields = {"loss_weight_field": field} | ({} if field == "loss_mask" else {"token_fields": {field: 0.0}})
    if mode == "packed-cp":  # documents padded to 2 x cp for a 2-rank context-parallel shard
        collate = PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=8, **fields)
    else:
        collate = PackedCollator(pad_to_multiple_of=8, **fields) if mode == "packed" else PaddedCollator(**fields)
    out = []
    for rank in groups:
        out.append([])
        for micro in rank:
            meta = MicrobatchMeta(
                step=0,
                step_loss_tokens=step_tokens,
                world_size=world_size,
                accumulate_grad_batches=accumulate,
                is_empty=not micro,
                step_loss_weight=step_weight if planned else None,
            )
            out[-1].append(collate(Microbatch([samples[i] for i in micro], meta=meta)))
    return out


@pytest.mark.parametrize("field", ["weights", "loss_mask"])
@pytest.mark.parametrize(("kind", "mode"), [("reference", "packed"), ("reference", "dynamic"), ("hf", "packed")])
def test_weighted_accumulated_step_equals_the_big_padded_batch(kind: str, mode: str, field: str) -> None:
    samples = weighted_samples(field)
    groups = PACKED_GROUPS if mode == "packed" else dynamic_groups(samples)
    module = make_module(kind)
    expected = reference_weighted_gradients(module, samples, field)
    batches = weighted_step_batches(samples, groups, mode, field)[0]
    assert len({b["num_loss_weight"] for b in batches}) == len(batches)  # unequal: a local mean would be wrong
    assert all(0 < b["num_loss_weight"] < b["num_loss_tokens"] for b in batches)  # fractional weights
    assert_gradients_match(fit_one_step(module, batches, accumulate=len(batches)), expected, rtol=1e-6)


def test_the_unweighted_normaliser_is_measurably_not_the_weighted_loss() -> None:
    """Negative control: normalising ``sum(w * ce)`` by the token count instead of the weight sum is detected."""
    samples = weighted_samples("weights")
    module = make_module("reference")
    expected = reference_weighted_gradients(module, samples, "weights")
    batches = weighted_step_batches(samples, PACKED_GROUPS, "packed", "weights")[0]
    wrong = [b | {"step_loss_weight": float(b["step_loss_tokens"])} for b in batches]
    with pytest.raises(AssertionError, match="max error"):
        assert_gradients_match(fit_one_step(module, wrong, accumulate=3), expected, rtol=1e-3)


def test_fractional_weights_without_a_planned_step_sum_are_refused() -> None:
    samples = weighted_samples("weights")
    with pytest.raises(ValueError, match="plan carries no step_loss_weight"):
        weighted_step_batches(samples, PACKED_GROUPS, "packed", "weights", planned=False)
    ones = [s | {"weights": [1.0] * len(s["input_ids"])} for s in samples]  # weight 1 everywhere: the token count
    batches = weighted_step_batches(ones, PACKED_GROUPS, "packed", "weights", planned=False)[0]
    assert {b["step_loss_weight"] for b in batches} == {float(batches[0]["step_loss_tokens"])}


def test_weighted_step_on_two_simulated_ranks_with_a_dummy_filler() -> None:
    samples = weighted_samples("weights", count=14, seed=3)
    groups = [[[0, 1, 2], [3, 4, 5, 6]], [[7, 8, 9, 10, 11, 12, 13], []]]
    module = make_module("reference").double()
    expected = reference_weighted_gradients(module, samples, "weights")
    per_rank = []
    for rank_batches in weighted_step_batches(samples, groups, "packed", "weights"):
        replica = copy.deepcopy(module)
        for batch in rank_batches:
            (replica.training_step(batch, 0) / len(rank_batches)).backward()
        per_rank.append({name: p.grad for name, p in replica.named_parameters()})
    averaged = {name: sum(g[name] for g in per_rank) / len(per_rank) for name in expected}
    assert_gradients_match(averaged, expected, rtol=1e-6)


def test_context_parallel_shards_carry_the_local_weights_and_sum_back() -> None:
    samples = weighted_samples("weights")
    inner = PackedCollator(
        pad_document_to_multiple_of=4, pad_to_multiple_of=4, token_fields={"weights": 0.0}, loss_weight_field="weights"
    )
    whole = inner(samples)
    shards = [
        ContextParallelCollator(collator=inner, context_parallel_size=2, context_parallel_rank=r)(samples)
        for r in range(2)
    ]
    assert all("shift_loss_weights" in s and "shift_weights" in s for s in shards)
    assert math.isclose(sum(s["num_loss_weight"] for s in shards), whole["num_loss_weight"], rel_tol=1e-12)
    gathered = gather_packed_batches(shards)
    torch.testing.assert_close(gathered["loss_weights"], whole["loss_weights"])
    assert math.isclose(gathered["num_loss_weight"], whole["num_loss_weight"], rel_tol=1e-12)


def test_real_sampler_with_planned_step_weights_end_to_end() -> None:
    """PlannedBatchSampler in StepWeightedBatchSampler -> PlannedDataset -> collator -> Trainer (accumulate 3)."""

    samples = weighted_samples("weights", count=24, seed=7)
    lengths = [len(s["input_ids"]) for s in samples]
    tokens = [sum(lab != -100 for lab in s["labels"][1:]) for s in samples]
    sums = [sample_loss_weight(s, "weights") for s in samples]
    kwargs = {"max_tokens": 32, "num_replicas": 1, "rank": 0, "accumulate_grad_batches": 3, "seed": 1}
    peek = StepWeightedBatchSampler(planned_sampler("packing", lengths, loss_tokens=tokens, **kwargs), sums)
    first_step = [mb for mb, _ in zip(peek, range(3), strict=False)]
    assert {mb.meta.step for mb in first_step} == {0}
    step_samples = [samples[i] for mb in first_step for i in mb]
    assert first_step[0].meta.step_loss_weight == math.fsum(sample_loss_weight(s, "weights") for s in step_samples)
    module = make_module("reference")
    expected = reference_weighted_gradients(module, step_samples, "weights")
    capture = GradientCapture()
    trainer = one_step_trainer(3, capture)
    sampler = StepWeightedBatchSampler(planned_sampler("packing", lengths, loss_tokens=tokens, **kwargs), sums)
    collate = PackedCollator(token_fields={"weights": 0.0}, loss_weight_field="weights")
    loader = torch.utils.data.DataLoader(PlannedDataset(samples), batch_sampler=sampler, collate_fn=collate)
    trainer.fit(module, loader)
    assert capture.grads is not None
    assert_gradients_match(capture.grads, expected, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_weighted_ddp_step_on_two_gloo_ranks_equals_the_big_padded_batch(two_ranks: Path) -> None:
    """Real DDP (2 spawned gloo processes, accumulation 2): the averaged gradient is the weighted big-batch one."""
    samples = weighted_samples("weights", count=14, seed=3)
    expected = reference_weighted_gradients(make_module("reference"), samples, "weights")
    assert_gradients_match(torch.load(two_ranks / "ddp.pt"), expected, rtol=1e-6)


def test_datamodule_weighted_step_equals_the_big_padded_batch() -> None:
    """SeqPackDataModule(loss_weight_field=...) plans the step's weight sum; one Trainer step (accumulate 2)."""

    from lit_seqpack.data.datamodule import SeqPackDataModule

    samples = weighted_samples("weights", count=24, seed=9)
    dm = SeqPackDataModule(
        source=samples,
        mode="packing",
        max_tokens=32,
        token_fields={"weights": 0.0},
        loss_weight_field="weights",
    )
    module = make_module("reference")
    initial = copy.deepcopy(module)
    capture = GradientCapture()
    trainer = one_step_trainer(2, capture)
    trainer.fit(module, datamodule=dm)
    plan = dm.pipeline.train_sampler.lazy_plan
    step = [i for position in range(2) for i in plan.microbatch(0, position).indices]
    expected = reference_weighted_gradients(initial, [samples[i] for i in step], "weights")
    assert capture.grads is not None
    assert_gradients_match(capture.grads, expected, rtol=1e-6)


def test_datamodule_refuses_file_loss_mask_weights_and_undeclared_weight_fields() -> None:
    from lit_seqpack.data.datamodule import SeqPackDataModule

    # a file reader turns loss_mask into labels at load: its weights would be lost (a dataset source keeps them)
    with pytest.raises(ValueError, match="loss_weight_field='loss_mask' is not supported with TokenizedSource"):
        SeqPackDataModule(source=TokenizedSource("data.jsonl", format="jsonl"), loss_weight_field="loss_mask")
    with pytest.raises(ValueError, match="loss_weight_field='w' must be 'loss_mask' or one of the declared"):
        SeqPackDataModule(loss_weight_field="w")


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Both 2-process steps on one pair of processes: the CP step by hand (``cp.pt``), then the Lightning DDP step
    (``ddp.pt``)."""
    join_ranks(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    try:
        _cp_weighted_step(rank, Path(out_dir, "cp.pt"))
        batches = weighted_step_batches(weighted_samples("weights", count=14, seed=3), GROUPS, "packed", "weights")
        trainer = spawned_step_trainer(2, str(Path(out_dir, "ddp.pt")), start_method="popen")
        trainer.fit(make_module("reference"), datamodule=PerRankBatches(batches))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of :func:`_worker`'s gradients (one spawned pair of processes for both tests)."""
    out = tmp_path_factory.mktemp("exact_weighted_loss")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return out


def _cp_weighted_step(cp_rank: int, out_path: Path) -> None:
    """One of 2 CP ranks (gloo); the 2 data-parallel ranks of GROUPS are simulated one after the other."""
    module = make_module("reference")
    samples = weighted_samples("weights", count=14, seed=3)
    batches = weighted_step_batches(samples, GROUPS, "packed-cp", "weights")
    summed = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    for dp_batches in batches:
        model = copy.deepcopy(module)
        for batch in dp_batches:
            shard = shard_packed_batch(batch, 2, cp_rank, token_fields={"weights": 0.0})
            (model.training_step(shard, 0) / len(dp_batches)).backward()  # Lightning's division
        for name, p in model.named_parameters():
            summed[name] += p.grad
    for grad in summed.values():  # DDP: the mean over all dp x cp ranks
        dist.all_reduce(grad)
        grad /= len(batches) * 2
    if cp_rank == 0:
        torch.save(summed, out_path)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_process_context_parallel_weighted_step_equals_the_big_padded_batch(two_ranks: Path) -> None:
    """The loss weights score targets: under CP each rank uses shift_loss_weights, as it uses shift_labels."""
    samples = weighted_samples("weights", count=14, seed=3)
    expected = reference_weighted_gradients(make_module("reference"), samples, "weights")
    grads = torch.load(two_ranks / "cp.pt")
    assert_gradients_match(grads, expected, rtol=1e-5)  # float32 CP vs float64 ground truth
