from __future__ import annotations

import importlib

import numpy as np
import torch
from torch.utils.data import DataLoader

from lit_seqpack.data import datasets
from lit_seqpack.data.microbatch import Microbatch, MicrobatchMeta, PlannedDataset


def _identity(samples):
    return samples


def test_every_public_name_resolves_to_its_defining_module():
    for name in datasets.__all__:
        value = getattr(datasets, name)
        module = getattr(value, "__module__", None)
        if module is not None and module.startswith("lit_seqpack.data."):
            assert getattr(importlib.import_module(module), name) is value
    assert sorted(datasets.__all__) == sorted(set(datasets.__all__))


def test_synthetic_to_cached_lengths_to_overlong_through_spawned_workers(tmp_path):
    """The path the DataModule will take: lengths once (cached), the policy, then reads in worker processes."""
    ds = datasets.SyntheticInstructionDataset(num_samples=400, median_length=64, max_length=1024, seed=9)
    lengths = datasets.cached_lengths(ds, tmp_path)
    loss_tokens = datasets.cached_loss_tokens(ds, tmp_path)
    view, kept_lengths, report = datasets.apply_overlong_policy(ds, lengths, 256, "drop")
    assert report.num_dropped == int((lengths > 256).sum()) > 0
    assert len(view) == 400 - report.num_dropped and kept_lengths.max() <= 256
    assert np.array_equal(datasets.compute_loss_tokens(view), loss_tokens[view.original_indices])

    meta = MicrobatchMeta(step=0, step_loss_tokens=1, world_size=1, accumulate_grad_batches=1)
    batches = [Microbatch(list(range(start, min(start + 7, len(view)))), meta=meta) for start in range(0, 35, 7)]
    loader = DataLoader(
        PlannedDataset(view),
        batch_sampler=batches,
        collate_fn=_identity,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    for indices, samples in zip(batches, loader, strict=True):
        assert samples.meta == meta
        for index, sample in zip(indices, samples, strict=True):
            direct = ds[int(view.original_indices[index])]
            assert torch.equal(sample["input_ids"], direct["input_ids"])
            assert torch.equal(sample["labels"], direct["labels"])
            assert len(sample["input_ids"]) == kept_lengths[index]
