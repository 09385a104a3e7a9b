from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import lit_seqpack.data as data
import lit_seqpack.model as model
from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.overlong import apply_overlong_policy
from lit_seqpack.data.indexed.lengths import cached_lengths, cached_loss_tokens, compute_loss_tokens


def _identity(samples):
    return samples


@pytest.mark.parametrize("package", [data, model], ids=["data", "model"])
def test_every_public_name_resolves_to_its_defining_module(package):
    for name in package.__all__:
        value = getattr(package, name)
        module = getattr(value, "__module__", None)
        if module is not None and module.startswith(f"{package.__name__}."):
            assert getattr(importlib.import_module(module), name) is value
    assert sorted(package.__all__) == sorted(set(package.__all__))
    assert set(package.__all__) <= set(dir(package))


def test_an_unknown_name_is_an_attribute_error_naming_the_package():
    with pytest.raises(AttributeError, match="module 'lit_seqpack.data' has no attribute 'PackedColator'"):
        data.PackedColator  # noqa: B018


def test_synthetic_to_cached_lengths_to_overlong_through_spawned_workers(tmp_path):
    """The path the DataModule will take: lengths once (cached), the policy, then reads in worker processes."""
    ds = data.SyntheticInstructionDataset(num_samples=400, median_length=64, max_length=1024, seed=9)
    lengths = cached_lengths(ds, tmp_path)
    loss_tokens = cached_loss_tokens(ds, tmp_path)
    view, kept_lengths, report = apply_overlong_policy(ds, lengths, 256, "drop")
    assert report.num_dropped == int((lengths > 256).sum()) > 0
    assert len(view) == 400 - report.num_dropped and kept_lengths.max() <= 256
    assert np.array_equal(compute_loss_tokens(view), loss_tokens[view.original_indices])

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


def test_importing_one_data_module_does_not_load_the_datamodule():
    code = (
        "import sys, lit_seqpack.data.indexed.splits\n"
        "assert 'lit_seqpack.data.datamodule' not in sys.modules and 'lightning' not in sys.modules\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
