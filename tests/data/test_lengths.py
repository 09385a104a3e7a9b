from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from lit_seqpack.data.indexed.lengths import (
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
from lit_seqpack.data.sources import TokenizedSource
from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset

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
    assert again.reads == 2 * len(SAMPLES)  # each load checks a sample of min(n, 16) records against the cache


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


def test_a_dataset_that_offers_its_lengths_never_reads_or_writes_the_cache(tmp_path):
    a = SyntheticInstructionDataset(num_samples=500, seed=1)
    b = SyntheticInstructionDataset(num_samples=500, seed=2)
    assert not np.array_equal(cached_lengths(a, tmp_path), cached_lengths(b, tmp_path))
    assert list(tmp_path.iterdir()) == []  # exact and free: a cache could only disagree with them
    assert np.array_equal(cached_lengths(SyntheticInstructionDataset(num_samples=500, seed=1), tmp_path), a.lengths)


@pytest.mark.parametrize("content", [b"not a zip", b"", "wrong-shape"])
def test_broken_cache_is_recomputed_with_a_warning(tmp_path, caplog, content):
    data = Counting(SAMPLES, fingerprint="fp")
    path = cache_path(data, tmp_path)
    if content == "wrong-shape":
        np.savez(path, lengths=np.arange(2), loss_tokens=np.arange(2))
    else:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.indexed.lengths"):
        assert cached_lengths(data, tmp_path).tolist() == LENGTHS
    assert "ignoring" in caplog.text and data.reads == len(SAMPLES)
    fresh = Counting(SAMPLES, fingerprint="fp")
    assert cached_lengths(fresh, tmp_path).tolist() == LENGTHS and fresh.reads == len(SAMPLES)  # rewritten: a hit


def test_fingerprint_must_be_a_string():
    assert dataset_fingerprint([1, 2]) is None
    with pytest.raises(TypeError, match="fingerprint must be a str"):
        dataset_fingerprint(Counting(SAMPLES, fingerprint=42))


def test_a_cache_that_disagrees_with_the_data_is_recomputed_with_a_warning(tmp_path, caplog):
    """Regression: a cache keyed by path/size/mtime overrode the lengths of rewritten data (an 80-token row)."""
    cached_lengths(Counting(SAMPLES, fingerprint="fp"), tmp_path)
    changed = [*SAMPLES[:3], {"input_ids": [9, 9, 9, 9, 9, 9]}]  # same fingerprint and size, other content
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.indexed.lengths"):
        assert cached_lengths(Counting(changed, fingerprint="fp"), tmp_path).tolist() == [4, 3, 1, 6]
    assert "dataset[3] has length 6 and 5 loss tokens, the cache says 2 and 0; recomputing" in caplog.text


@pytest.mark.parametrize(
    ("arrays", "problem"),
    [
        ({"lengths": np.array([4, 3, 0, 2]), "loss_tokens": np.array(LOSS)}, "impossible values"),
        ({"lengths": np.array(LENGTHS), "loss_tokens": np.array([2, 2, 0, 2])}, "impossible values"),
        ({"lengths": np.array([4.0, 3, 1, 2]), "loss_tokens": np.array(LOSS)}, "not integers"),
        ({"lengths": np.array(LENGTHS), "loss_tokens": np.array(LOSS), "identity": np.array("x")}, "other data"),
    ],
)
def test_a_cache_with_bad_values_is_blamed_not_the_data(tmp_path, caplog, arrays, problem):
    data = Counting(SAMPLES, fingerprint="fp")
    path = cache_path(data, tmp_path)
    from lit_seqpack.data.indexed.lengths import _identity

    np.savez(path, **({"max_id": np.int64(9), "identity": np.array(_identity(data, None))} | arrays))
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.indexed.lengths"):
        assert cached_lengths(data, tmp_path).tolist() == LENGTHS
    assert f"ignoring the lengths cache {path}" in caplog.text and problem in caplog.text


def test_the_cache_is_written_atomically_and_cleaned_up_on_failure(tmp_path, monkeypatch):
    data = Counting(SAMPLES, fingerprint="fp")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        cached_lengths(data, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no partial file left behind
    monkeypatch.undo()
    stale = tmp_path / f".{cache_path(data, tmp_path).name}.killed.partial"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (1, 1))  # a writer killed long ago
    cached_lengths(data, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_path(data, tmp_path).name]


def test_the_cache_never_follows_a_symlink(tmp_path, caplog):
    data = Counting(SAMPLES, fingerprint="fp")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    cache = tmp_path / "cache"
    cache.mkdir()
    cache_path(data, cache).symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.indexed.lengths"):
        assert cached_lengths(data, cache).tolist() == LENGTHS
    assert "symbolic link" in caplog.text and victim.read_text() == "keep me"
    assert not cache_path(data, cache).is_symlink() and cache_path(data, cache).is_file()


def test_a_same_size_rewrite_of_a_jsonl_file_plans_the_new_lengths(tmp_path):
    """Regression: the cache gave an 80-token packed row under max_tokens=64 after a same-size rewrite."""
    import json

    from lit_seqpack import SeqPackDataModule

    path = tmp_path / "d.jsonl"
    rows = [[1] * 40, [2] * 10, [3] * 10, [4] * 40]
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    stat = path.stat()
    dm = SeqPackDataModule(
        source=TokenizedSource(str(path), format="jsonl"), max_tokens=64, cache_dir=str(tmp_path / "c")
    )
    assert sum(b["num_real_tokens"] for b in dm.train_dataloader()) == 100
    rows = [[1] * 10, [2] * 40, [3] * 40, [4] * 10]  # the same size, other lengths, the same mtime
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    dm = SeqPackDataModule(
        source=TokenizedSource(str(path), format="jsonl"), max_tokens=64, cache_dir=str(tmp_path / "c")
    )
    assert dm.splits["train"].lengths.tolist() == [10, 40, 40, 10]
    assert all(b["input_ids"].shape[1] <= 64 for b in dm.train_dataloader())
