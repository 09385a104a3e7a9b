"""Exact loss: one optimizer step over packed or dynamic microbatches, with gradient accumulation (and ranks),
has the gradient of one big padded batch of the same samples with a token-mean loss.

The ground truth is independent of lit_seqpack's batching: every sample of the step right-padded into one
``[N, L]`` batch, through the plain model (padded attention path, no packing, no mixin), with
``F.cross_entropy(..., ignore_index=-100)`` averaged over every target of the step. Runs in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler
from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
from lit_seqpack.model.loss import LossOutput
from lit_seqpack.planning.config import PlanConfig
from tests._limits import COLLECTIVE_TIMEOUT
from tests._samplers import planned_sampler

VOCAB = 64
TINY = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64}
LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def make_module(kind: str, seed: int = 0) -> LightningModule:
    torch.manual_seed(seed)
    if kind == "reference":
        return ReferenceLM(vocab_size=VOCAB, **TINY, lr_schedule="constant", attn_backend="sdpa")
    config = {"model_type": "llama", "vocab_size": VOCAB, **LLAMA, "num_key_value_heads": 2}
    return HFCausalLM(config=config, lr_schedule="constant", attn_backend="sdpa")


def make_samples(count: int = 12, seed: int = 0) -> list[dict[str, list[int]]]:
    """Documents of 2..24 tokens; some have a masked prompt (labels -100), so loss tokens != length - 1."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = int(torch.randint(2, 25, (1,), generator=gen))
        ids = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
        prompt = length // 3 if i % 3 == 0 else 0
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return samples


def loss_tokens(sample: dict[str, list[int]]) -> int:
    return sum(label != -100 for label in sample["labels"][1:])


def step_batches(
    samples: list[dict[str, list[int]]], groups: list[list[list[int]]], mode: str
) -> list[list[dict[str, Any]]]:
    """Collated microbatches per rank: ``groups[rank][micro]`` lists sample indices (``[]`` is a dummy filler)."""
    world_size, accumulate = len(groups), len(groups[0])
    total = sum(loss_tokens(samples[i]) for rank in groups for micro in rank for i in micro)
    collate = PackedCollator(pad_to_multiple_of=8) if mode == "packed" else PaddedCollator(pad_to_multiple_of=4)
    out = []
    for rank in groups:
        out.append([])
        for micro in rank:
            meta = MicrobatchMeta(
                step=0,
                step_loss_tokens=total,
                world_size=world_size,
                accumulate_grad_batches=accumulate,
                max_tokens=None,
                is_empty=not micro,
            )
            out[-1].append(collate(Microbatch([samples[i] for i in micro], meta=meta)))
    return out


def plain_logits(module: LightningModule, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The model's ordinary padded forward, bypassing lit_seqpack's routing and attention function."""
    if isinstance(module, ReferenceLM):
        return module.model(input_ids, attention_mask=attention_mask)
    module.model.set_attn_implementation("sdpa")
    return module.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def reference_gradients(module: LightningModule, samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Gradient of the token-mean loss of one big right-padded batch of ``samples``, in float64."""
    model = copy.deepcopy(module).double()
    width = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    attention_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.tensor(sample["input_ids"])
        labels[row, :n] = torch.tensor(sample["labels"])
        attention_mask[row, :n] = 1
    logits = plain_logits(model, input_ids, attention_mask)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_gradients_match(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        error = (actual[name].double() - grad).abs().max().item()
        assert error <= rtol * scale, f"{name}: max error {error:.3g} > {rtol} x {scale:.3g}"


class GradientCapture(Callback):
    """Keeps the accumulated (and, under DDP, averaged) gradients just before the first optimizer step (whole, on
    every rank: sharded ones are gathered)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.grads is None:
            grads = {name: p.grad.detach() for name, p in pl_module.named_parameters()}
            # FSDP2 / TP: each rank holds a shard; every rank gathers the whole gradient (one collective each)
            self.grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in grads.items()}
            if self.path is not None and trainer.global_rank == 0:
                torch.save(self.grads, self.path)


def one_step_trainer(accumulate: int, capture: GradientCapture, precision: str = "64-true") -> Trainer:
    """A one-process CPU Trainer for one optimizer step over ``accumulate`` microbatches, gradients to ``capture``."""
    return Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=1,
        accumulate_grad_batches=accumulate,
        use_distributed_sampler=False,
        callbacks=[capture],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def spawned_step_trainer(devices: int, path: str, start_method: str = "spawn") -> Trainer:
    """A ``ddp_spawn`` CPU Trainer for one fp64 optimizer step (accumulation 2) that saves rank 0's gradients;
    ``start_method="popen"`` in a process that already is one of the ranks (``tests._ranks.join_ranks``)."""
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=DDPStrategy(start_method=start_method, timeout=COLLECTIVE_TIMEOUT),
        precision="64-true",
        max_steps=1,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        callbacks=[GradientCapture(path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit_one_step(
    module: LightningModule, batches: list[dict[str, Any]], accumulate: int, precision: str = "64-true"
) -> dict[str, torch.Tensor]:
    """One optimizer step of a real single-process Trainer over ``batches``; the gradients it applies."""
    capture = GradientCapture()
    trainer = one_step_trainer(accumulate, capture, precision=precision)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert capture.grads is not None
    return capture.grads


PACKED_GROUPS = [[[0, 1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]]  # 1 rank x 3 microbatches of unequal sizes


def dynamic_groups(samples: list[dict[str, list[int]]]) -> list[list[list[int]]]:
    """Sorted by length, then cut into 1 rank x 2 microbatches: what token-budget batching produces."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    return [[order[:8], order[8:]]]


@pytest.mark.parametrize("kind", ["reference", "hf"])
@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_accumulated_step_equals_the_big_padded_batch(kind: str, mode: str) -> None:
    samples = make_samples()
    groups = PACKED_GROUPS if mode == "packed" else dynamic_groups(samples)
    module = make_module(kind)
    expected = reference_gradients(module, samples)
    batches = step_batches(samples, groups, mode)[0]
    assert len({b["num_loss_tokens"] for b in batches}) == len(batches)  # unequal: a local mean would be wrong
    assert_gradients_match(fit_one_step(module, batches, accumulate=len(batches)), expected, rtol=1e-5)


@pytest.mark.parametrize(("kind", "mode"), [("reference", "packed"), ("hf", "dynamic")])
def test_a_float32_step_is_exact_to_1e_5_as_well(kind: str, mode: str) -> None:
    samples = make_samples(seed=5)
    groups = PACKED_GROUPS if mode == "packed" else dynamic_groups(samples)
    module = make_module(kind, seed=5)
    expected = reference_gradients(module, samples)  # still float64
    actual = fit_one_step(module, step_batches(samples, groups, mode)[0], accumulate=len(groups[0]), precision="32")
    assert_gradients_match(actual, expected, rtol=1e-5)  # measured ~5e-7


def test_a_local_mean_is_measurably_not_exact() -> None:
    """Negative control: the comparison above does detect a loss normalised per microbatch."""

    class LocalMeanLM(ReferenceLM):
        def seqpack_loss(self, logits: torch.Tensor, batch: dict[str, Any]) -> LossOutput:
            out = super().seqpack_loss(logits, batch)
            return LossOutput(loss_sum=out.loss_sum, num_units=out.num_units, step_units=None)

    samples = make_samples()
    torch.manual_seed(0)
    module = LocalMeanLM(vocab_size=VOCAB, **TINY, lr_schedule="constant", attn_backend="sdpa")
    expected = reference_gradients(module, samples)
    actual = fit_one_step(module, step_batches(samples, PACKED_GROUPS, "packed")[0], accumulate=3)
    with pytest.raises(AssertionError, match="max error"):
        assert_gradients_match(actual, expected, rtol=1e-3)


@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_manual_loop_over_two_simulated_ranks_equals_the_big_padded_batch(mode: str) -> None:
    """Lightning's division by k and DDP's average over W, replicated by hand (one model copy per rank)."""
    samples = make_samples(count=14, seed=3)
    groups = [[[0, 1, 2], [3, 4, 5, 6]], [[7, 8, 9, 10, 11, 12, 13], []]]  # rank 1 ends on a dummy filler
    module = make_module("reference").double()
    expected = reference_gradients(module, samples)
    per_rank = []
    for rank_batches in step_batches(samples, groups, mode):
        replica = copy.deepcopy(module)
        for batch in rank_batches:
            (replica.training_step(batch, 0) / len(rank_batches)).backward()
        per_rank.append({name: p.grad for name, p in replica.named_parameters()})
    averaged = {name: sum(g[name] for g in per_rank) / len(per_rank) for name in expected}
    assert_gradients_match(averaged, expected, rtol=1e-5)


def _planned_loader(sampler: Any, samples: list[dict[str, list[int]]], collate: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(PlannedDataset(samples), batch_sampler=sampler, collate_fn=collate)


def test_real_sampler_collator_and_trainer_end_to_end() -> None:
    """PlannedBatchSampler -> PlannedDataset -> PackedCollator -> Trainer(accumulate_grad_batches=3) -> mixin."""
    samples = make_samples(count=24, seed=7)
    lengths = [len(s["input_ids"]) for s in samples]
    sampler_kwargs = {"max_tokens": 32, "num_replicas": 1, "rank": 0, "accumulate_grad_batches": 3, "seed": 1}
    tokens = [loss_tokens(s) for s in samples]
    peek = planned_sampler("packing", lengths, loss_tokens=tokens, **sampler_kwargs)  # the same plan, read ahead
    first_step = [mb for mb, _ in zip(peek, range(3), strict=False)]
    assert all(mb.meta.step == 0 for mb in first_step)
    step_samples = [samples[i] for mb in first_step for i in mb]
    module = make_module("reference")
    expected = reference_gradients(module, step_samples)
    capture = GradientCapture()
    trainer = one_step_trainer(3, capture)
    sampler = planned_sampler("packing", lengths, loss_tokens=tokens, **sampler_kwargs)
    trainer.fit(module, _planned_loader(sampler, samples, PackedCollator(pad_to_multiple_of=8)))
    assert capture.grads is not None
    assert_gradients_match(capture.grads, expected, rtol=1e-5)


@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_real_samplers_on_two_simulated_ranks(mode: str) -> None:
    """Each rank's sampler gives its step-0 microbatches; Lightning's /k and DDP's mean over W done by hand."""
    samples = make_samples(count=30, seed=11)
    lengths, tokens = [len(s["input_ids"]) for s in samples], [loss_tokens(s) for s in samples]
    sampler_mode, collate = ("packing", PackedCollator()) if mode == "packed" else ("dynamic", PaddedCollator())
    module = make_module("reference").double()
    per_rank, step_samples, step_totals = [], [], set()
    for rank in range(2):
        config = PlanConfig(mode=sampler_mode, max_tokens=48, world_size=2, accumulate_grad_batches=2, seed=2)
        sampler = PlannedBatchSampler(lengths, config, rank=rank, loss_tokens=tokens)
        step = [mb for mb, _ in zip(sampler, range(2), strict=False)]
        step_samples += [samples[i] for mb in step for i in mb]
        replica = copy.deepcopy(module)
        for micro in step:
            batch = collate(Microbatch([samples[i] for i in micro], meta=micro.meta))
            step_totals.add(batch["step_loss_tokens"])
            (replica.training_step(batch, 0) / 2).backward()
        per_rank.append({name: p.grad for name, p in replica.named_parameters()})
    assert step_totals == {sum(loss_tokens(s) for s in step_samples)}  # the plan's normaliser, known to every rank
    expected = reference_gradients(module, step_samples)
    averaged = {name: (per_rank[0][name] + per_rank[1][name]) / 2 for name in expected}
    assert_gradients_match(averaged, expected, rtol=1e-5)
