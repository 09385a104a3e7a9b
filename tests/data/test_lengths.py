from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from lit_seqpack.data.lengths import (
    cache_path,
    cached_lengths,
    cached_lengths_and_loss_tokens,
    cached_loss_tokens,
    compute_lengths,
    compute_lengths_and_loss_tokens,
    compute_loss_tokens,
    dataset_fingerprint,
    sample_loss_tokens,
)
from lit_seqpack.data.synthetic import SyntheticInstructionDataset

SAMPLES = [
    {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
    {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])},
    {"input_ids": np.array([8])},
    {"input_ids": [9, 9], "labels": [9, -100]},
]
LENGTHS = [4, 3, 1, 2]
LOSS = [2, 2, 0, 0]


class Counting:
    """A dataset without fast paths that counts reads."""

    def __init__(self, samples, fingerprint=None):
        self.samples = samples
        self.reads = 0
        if fingerprint is not None:
            self.fingerprint = fingerprint

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        self.reads += 1
        return self.samples[index]


def test_sample_loss_tokens_masks_the_first_position():
    assert [sample_loss_tokens(s) for s in SAMPLES] == LOSS
    assert sample_loss_tokens({"input_ids": [1, 2, 3]}) == 2
    assert sample_loss_tokens({"input_ids": [3, 4], "labels": [3, -100]}) == 0  # only the untrainable first


def test_slow_path_reads_each_sample_once():
    data = Counting(SAMPLES)
    lengths, loss = compute_lengths_and_loss_tokens(data)
    assert lengths.tolist() == LENGTHS and loss.tolist() == LOSS
    assert lengths.dtype == loss.dtype == np.int64
    assert data.reads == len(SAMPLES)
    assert compute_lengths(SAMPLES).tolist() == LENGTHS
    assert compute_loss_tokens(SAMPLES).tolist() == LOSS


def test_fast_path_reads_nothing_and_returns_a_copy():
    ds = SyntheticInstructionDataset(num_samples=2000, seed=1)
    lengths, loss = compute_lengths_and_loss_tokens(ds)
    assert np.array_equal(lengths, ds.lengths) and np.array_equal(loss, ds.loss_tokens)
    lengths[0] = -1
    assert ds.lengths[0] > 0
    for i in range(0, 2000, 97):  # the fast path agrees with reading
        assert compute_lengths([ds[i]])[0] == ds.lengths[i]
        assert compute_loss_tokens([ds[i]])[0] == ds.loss_tokens[i]


def test_partial_fast_path_scans_for_the_rest():
    data = Counting(SAMPLES)
    data.lengths = np.array(LENGTHS)
    assert compute_lengths(data).tolist() == LENGTHS and data.reads == 0
    assert compute_loss_tokens(data).tolist() == LOSS and data.reads == len(SAMPLES)


def test_fast_path_shape_is_checked_and_methods_are_ignored():
    data = Counting(SAMPLES)
    data.lengths = np.array([1, 2])
    with pytest.raises(ValueError, match=r"dataset.lengths has shape \(2,\) but the dataset has 4 samples"):
        compute_lengths(data)
    data.lengths = lambda: None
    assert compute_lengths(data).tolist() == LENGTHS


def test_scan_rejects_samples_without_input_ids():
    with pytest.raises(TypeError, match=r"dataset\[1\] must be a mapping with 'input_ids'"):
        compute_lengths([{"input_ids": [1]}, [1, 2]])


def test_cache_miss_then_hit(tmp_path):
    data = Counting(SAMPLES, fingerprint="my-data-v1")
    lengths = cached_lengths(data, tmp_path / "cache")
    assert lengths.tolist() == LENGTHS and data.reads == len(SAMPLES)
    assert cache_path(data, tmp_path / "cache").is_file()
    again = Counting(SAMPLES, fingerprint="my-data-v1")
    assert cached_lengths(again, tmp_path / "cache").tolist() == LENGTHS
    assert cached_loss_tokens(again, tmp_path / "cache").tolist() == LOSS
    assert again.reads == 0


def test_cache_key_overrides_and_size_is_part_of_the_key(tmp_path):
    data = Counting(SAMPLES)
    with pytest.raises(ValueError, match="pass key="):
        cached_lengths(data, tmp_path)
    cached_lengths_and_loss_tokens(data, tmp_path, key="k")
    assert data.reads == len(SAMPLES)
    assert cache_path(data, tmp_path, key="k") != cache_path(data, tmp_path, key="other")
    assert cache_path(data, tmp_path, key="k") != cache_path(Counting(SAMPLES[:3]), tmp_path, key="k")
    shorter = Counting(SAMPLES[:3])
    assert cached_lengths(shorter, tmp_path, key="k").tolist() == LENGTHS[:3]
    assert shorter.reads == 3


def test_cache_keyed_by_synthetic_config(tmp_path):
    a = SyntheticInstructionDataset(num_samples=500, seed=1)
    b = SyntheticInstructionDataset(num_samples=500, seed=2)
    assert not np.array_equal(cached_lengths(a, tmp_path), cached_lengths(b, tmp_path))
    assert len(list(tmp_path.iterdir())) == 2
    assert np.array_equal(cached_lengths(SyntheticInstructionDataset(num_samples=500, seed=1), tmp_path), a.lengths)


@pytest.mark.parametrize("content", [b"not a zip", "wrong-shape"])
def test_broken_cache_is_recomputed_with_a_warning(tmp_path, caplog, content):
    data = Counting(SAMPLES, fingerprint="fp")
    path = cache_path(data, tmp_path)
    if content == "wrong-shape":
        np.savez(path, lengths=np.arange(2), loss_tokens=np.arange(2))
    else:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.lengths"):
        assert cached_lengths(data, tmp_path).tolist() == LENGTHS
    assert "ignoring" in caplog.text and data.reads == len(SAMPLES)
    fresh = Counting(SAMPLES, fingerprint="fp")
    assert cached_lengths(fresh, tmp_path).tolist() == LENGTHS and fresh.reads == 0  # rewritten


def test_fingerprint_must_be_a_string():
    assert dataset_fingerprint([1, 2]) is None
    with pytest.raises(TypeError, match="fingerprint must be a str"):
        dataset_fingerprint(Counting(SAMPLES, fingerprint=42))
