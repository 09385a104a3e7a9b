from __future__ import annotations

import logging
import pickle
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_seqpack import PlannedBatchSampler
from lit_seqpack.batch import Microbatch
from lit_seqpack.data import PlannedDataset
from tests._limits import TEST_TIMEOUT_S
from tests._samplers import planned_sampler

MODES = ("packing", "dynamic", "padded")


def make(mode: str, lengths, *, rank: int = 0, num_replicas: int = 1, **kwargs):
    budget = {"batch_size": 3} if mode == "padded" else {"max_tokens": 64}
    return planned_sampler(mode, lengths, num_replicas=num_replicas, rank=rank, **{**budget, **kwargs})


def lists(batches) -> list[list[int]]:
    return [list(mb) for mb in batches]


# ---------------------------------------------------------------- properties over ranks


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=60),
    mode=st.sampled_from(list(MODES)),
    world=st.integers(1, 8),
    accumulate=st.integers(1, 4),
    epoch=st.integers(0, 2),
)
def test_ranks_cover_every_sample_once_in_lock_step(lengths, mode, world, accumulate, epoch):
    samplers = [
        make(mode, lengths, rank=r, num_replicas=world, accumulate_grad_batches=accumulate) for r in range(world)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert {len(s) for s in samplers} == {len(b) for b in per_rank}  # exact __len__, equal on every rank
    assert len({len(b) for b in per_rank}) == 1
    assert Counter(i for b in per_rank for mb in b for i in mb) == Counter(range(len(lengths)))
    loss = np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)
    for position in range(len(per_rank[0])):
        column = [b[position] for b in per_rank]
        step = position // accumulate
        true_total = sum(int(loss[mb].sum()) for b in per_rank for mb in b[step * accumulate : (step + 1) * accumulate])
        for mb in column:
            meta = mb.meta
            assert isinstance(mb, Microbatch)
            assert meta.step == step and meta.step_loss_tokens == true_total
            assert (meta.world_size, meta.accumulate_grad_batches) == (world, accumulate)
            assert meta.max_tokens == (None if mode == "padded" else 64)
            assert meta.is_empty == (len(mb) == 0)
            if mode == "packing" and len(mb):
                assert sum(lengths[i] for i in mb) <= 64
            if mode == "dynamic" and len(mb):
                assert len(mb) * max(lengths[i] for i in mb) <= 64


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60),
    mode=st.sampled_from(list(MODES)),
    world=st.integers(1, 4),
    accumulate=st.integers(1, 3),
    cut=st.floats(0.0, 1.0),
    epoch=st.integers(0, 2),
)
def test_resume_at_a_random_cut_yields_exactly_the_rest(lengths, mode, world, accumulate, cut, epoch):
    kwargs = {"num_replicas": world, "accumulate_grad_batches": accumulate}
    writer = make(mode, lengths, rank=0, **kwargs)  # rank 0 writes the checkpoint
    writer.set_epoch(epoch)
    total = len(writer)
    k = int(cut * total)
    iterator = iter(writer)
    for _ in range(k):
        next(iterator)
    state = writer.state_dict()
    if k == total:  # a finished epoch is saved as the start of the next one
        assert (state["epoch"], state["position"]) == (epoch + 1, 0)
    for rank in range(world):
        reference = make(mode, lengths, rank=rank, **kwargs)
        reference.set_epoch(epoch)
        assert reference.state_dict()["plan_key"] == state["plan_key"]
        full = lists(reference)
        resumed = make(mode, lengths, rank=rank, **kwargs)
        resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
        if k < total:
            resumed.set_epoch(epoch)  # Lightning calls set_epoch with the restored epoch: no reset
            assert lists(resumed) == full[k:]
            assert lists(resumed) == full  # the next pass of the same epoch starts from the beginning
        else:
            reference.set_epoch(epoch + 1)
            assert lists(resumed) == lists(reference)  # planned before any set_epoch: the next epoch


# ---------------------------------------------------------------- epochs


def test_order_differs_between_epochs_and_iteration_is_lazy():
    lengths = np.random.default_rng(0).integers(1, 64, 200)
    sampler = make("packing", lengths, num_replicas=2, rank=1)
    epoch0 = lists(sampler)
    iterator = iter(sampler)  # created before set_epoch, as Lightning does
    sampler.set_epoch(1)
    epoch1 = lists(iterator)
    assert epoch0 != epoch1
    assert epoch1 == lists(sampler)  # the lazy iterator planned epoch 1, like a fresh one
    sampler.set_epoch(0)
    assert lists(sampler) == epoch0


def test_lightning_set_epoch_reaches_the_batch_sampler():
    sampler = make("dynamic", np.random.default_rng(1).integers(1, 64, 100))
    loader = DataLoader(list(range(100)), batch_sampler=sampler, collate_fn=list)
    _set_sampler_epoch(loader, 3)  # the helper Lightning's loops call
    assert sampler.epoch == 3
    assert sampler.sampler.set_epoch is not None and sorted(sampler.sampler) == list(range(100))
    assert len(sampler.sampler) == 100


def test_without_shuffle_every_epoch_is_the_same():
    sampler = make("padded", list(range(1, 30)), shuffle=False)
    first = lists(sampler)
    sampler.set_epoch(4)
    assert lists(sampler) == first


def test_count_change_between_epochs_warns(caplog):
    lengths = np.random.default_rng(2).integers(1, 64, 400)
    sampler = make("packing", lengths, algorithm="first_fit_shuffle", window=37, num_replicas=2)
    counts = {len(sampler)}  # like Lightning: len() once, at setup
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.indexed.planned_sampler"):
        for epoch in range(6):
            sampler.set_epoch(epoch)
            counts.add(sum(1 for _ in sampler))  # list() would call len() again
    assert len(counts) > 1
    assert "number of microbatches changed" in caplog.text


# ---------------------------------------------------------------- state and validation


def test_state_dict_is_rank_independent():
    lengths = np.random.default_rng(3).integers(1, 64, 120)
    samplers = [make("packing", lengths, rank=r, num_replicas=3, accumulate_grad_batches=2) for r in range(3)]
    for s in samplers:
        s.set_epoch(2)
        it = iter(s)
        for _ in range(3):
            next(it)
    states = [s.state_dict() for s in samplers]
    assert states[0] == states[1] == states[2]
    assert (states[0]["epoch"], states[0]["position"]) == (2, 3)


def test_resume_rejects_a_different_plan_mid_epoch_but_allows_epoch_boundaries():
    lengths = np.random.default_rng(4).integers(1, 64, 100)
    sampler = make("packing", lengths, num_replicas=2)
    it = iter(sampler)
    next(it)
    mid = sampler.state_dict()
    with pytest.raises(ValueError, match="world_size"):
        make("packing", lengths, num_replicas=4).load_state_dict(mid)
    list(it)
    finished = sampler.state_dict()
    assert (finished["epoch"], finished["position"]) == (1, 0)
    other = make("packing", lengths, num_replicas=4)  # elastic resume at an epoch boundary
    other.load_state_dict(finished)
    assert other.epoch == 1
    assert len(list(other)) == len(other) > 0
    with pytest.raises(ValueError, match="lacks"):
        other.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="position"):
        other.load_state_dict({**finished, "position": -1})


@pytest.mark.parametrize("mode", list(MODES))
def test_planned_batch_sampler_takes_a_config_and_refuses_anything_else(mode):
    lengths = np.random.default_rng(6).integers(1, 64, 90)
    convenience = make(mode, lengths, rank=1, num_replicas=3, accumulate_grad_batches=2, seed=4)
    direct = PlannedBatchSampler(lengths, convenience.config, rank=1)
    assert isinstance(convenience, PlannedBatchSampler) and direct.config == convenience.config
    assert lists(direct) == lists(convenience) and direct.state_dict() == convenience.state_dict()
    with pytest.raises(TypeError, match="config must be a PlanConfig"):
        PlannedBatchSampler(lengths, {"mode": mode})
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, num_replicas=3\)"):
        PlannedBatchSampler(lengths, convenience.config, rank=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 2, "rank": 2}, "rank"),
        ({"num_replicas": 0, "rank": 0}, "num_replicas"),
        ({"max_tokens": 8}, r"sample 0 has length 10 > max_tokens=8"),
        ({"window": 0}, "window"),
        ({"loss_tokens": [1]}, "loss_tokens"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        planned_sampler("packing", [10, 5], **{"max_tokens": 64, **kwargs})


def test_set_epoch_rejects_negative():
    with pytest.raises(ValueError, match="epoch"):
        make("dynamic", [3, 4]).set_epoch(-1)


def test_defaults_without_torch_distributed():
    sampler = planned_sampler("packing", [3, 4, 5], max_tokens=8)
    assert (sampler.config.world_size, sampler.rank) == (1, 0)


# ---------------------------------------------------------------- DataLoader integration


def _collate(samples: Microbatch) -> tuple[list[int], int, bool]:
    return list(samples), samples.meta.step_loss_tokens, samples.meta.is_empty


def _loader(sampler, num_workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(
        PlannedDataset(list(range(500))),
        batch_sampler=sampler,
        collate_fn=_collate,
        num_workers=num_workers,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_exactly_with_workers(num_workers):
    lengths = np.random.default_rng(5).integers(1, 300, 500)
    kwargs = {"max_tokens": 512, "num_replicas": 2, "rank": 1, "accumulate_grad_batches": 2}
    expected = [list(mb) for mb in planned_sampler("packing", lengths, **kwargs)]
    sampler = planned_sampler("packing", lengths, **kwargs)
    loader = _loader(sampler, num_workers)
    k = len(expected) // 3
    seen = []
    for batch in loader:
        seen.append(batch[0])
        if len(seen) == k:
            state = loader.state_dict()
            break
    del loader
    assert seen == expected[:k]
    resumed_loader = _loader(planned_sampler("packing", lengths, **kwargs), num_workers)
    resumed_loader.load_state_dict(state)
    rest = [batch[0] for batch in resumed_loader]
    assert rest == expected[k:]


def test_sampler_pickles_with_its_plan():
    sampler = make("packing", np.random.default_rng(6).integers(1, 64, 80), num_replicas=2, rank=1)
    sampler.set_epoch(2)
    clone = pickle.loads(pickle.dumps(sampler))
    assert clone.epoch == 2 and clone.plan.fingerprint() == sampler.plan.fingerprint()
    assert lists(clone) == lists(sampler)
    clone.sampler.set_epoch(3)
    assert clone.epoch == 3 and sampler.epoch == 2


# ---------------------------------------------------------------- Lightning checkpoint resume


def _indices(samples: Microbatch) -> list[int]:
    return list(samples)


class _Recorder(L.LightningModule):
    def __init__(self, lengths: list[int]) -> None:
        super().__init__()
        self.lengths = lengths
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, list[int]]] = []

    def train_dataloader(self) -> StatefulDataLoader:
        sampler = planned_sampler("packing", self.lengths, max_tokens=128, accumulate_grad_batches=2, seed=1)
        # Lightning 2.6 creates the iterator (and workers prefetch) before its own set_epoch call, so a run
        # resumed from an end-of-epoch checkpoint would replay epoch 0 (Lightning issue #21938): set it here
        sampler.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
        dataset = PlannedDataset(list(range(len(self.lengths))))
        return StatefulDataLoader(dataset, batch_sampler=sampler, collate_fn=_indices, num_workers=2)

    def training_step(self, batch: list[int], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch))
        return (self.weight - len(batch)).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(root, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_lightning_resumes_exactly_from_mid_epoch_and_end_of_epoch_checkpoints(tmp_path):
    lengths = np.random.default_rng(8).integers(1, 100, 90).tolist()
    batches_per_epoch = len(planned_sampler("packing", lengths, max_tokens=128, accumulate_grad_batches=2, seed=1))
    steps_per_epoch = batches_per_epoch // 2
    mid_step = steps_per_epoch + steps_per_epoch // 2  # inside the second epoch
    callbacks = [
        ModelCheckpoint(dirpath=tmp_path / "epochs", save_top_k=-1, filename="{epoch}"),
        ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=mid_step, save_top_k=-1, filename="{step}"),
    ]
    reference = _Recorder(lengths)
    _trainer(tmp_path, callbacks=callbacks).fit(reference)
    assert len(reference.seen) == 3 * batches_per_epoch
    for epoch in range(3):  # every sample once per epoch, a new order each epoch
        assert sorted(i for e, b in reference.seen if e == epoch for i in b) == list(range(len(lengths)))
    assert [b for e, b in reference.seen if e == 0] != [b for e, b in reference.seen if e == 1]

    mid = f"step={mid_step}.ckpt"
    checkpoints = {"epoch=0.ckpt": batches_per_epoch, mid: 2 * mid_step}  # batches trained before the save
    for ckpt in (tmp_path / "epochs" / "epoch=0.ckpt", tmp_path / "mid" / mid):
        done = checkpoints[ckpt.name]
        resumed = _Recorder(lengths)
        _trainer(tmp_path, enable_checkpointing=False).fit(resumed, ckpt_path=ckpt)
        assert resumed.seen == reference.seen[done:], ckpt.name


def test_plan_key_names_the_layout_and_ignores_the_input_dtype(monkeypatch):
    from lit_seqpack.data.indexed import planned_sampler as _planned_sampler

    lengths = np.random.default_rng(5).integers(1, 64, 80)
    assert make("packing", lengths.tolist())._plan_key == make("packing", lengths.astype(np.uint16))._plan_key
    monkeypatch.setattr(_planned_sampler, "PLAN_FORMAT", _planned_sampler.PLAN_FORMAT - 1)
    old = make("packing", lengths, num_replicas=2)
    it = iter(old)
    next(it)
    mid = old.state_dict()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cannot resume mid-epoch"):  # an older layout plans other microbatches
        make("packing", lengths, num_replicas=2).load_state_dict(mid)
