"""Ranks that read different tokens with equal lengths fail loudly on every rank (2 gloo processes)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_seqpack import SeqPackDataModule
from lit_seqpack._hashing import content_digest, sampled_indices
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._samplers import planned_sampler

WORLD = 2
LENGTHS = np.random.default_rng(11).integers(2, 60, 200).tolist()


def _dataset(shift: int = 0) -> list[dict[str, list[int]]]:
    """Samples with LENGTHS tokens; ``shift`` changes the tokens (not the lengths) of every sample."""
    return [{"input_ids": [(i + j + shift) % 97 for j in range(n)]} for i, n in enumerate(LENGTHS)]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        outcome: dict[str, str] = {}
        for case, shift in (("equal", 0), ("different", rank)):
            data = _dataset(shift)
            digest = functools.partial(content_digest, data, 8, 0)
            sampler = planned_sampler("packing", LENGTHS, max_tokens=128, content_digest=digest)
            try:
                sampler.check_plan()
                outcome[case] = f"ok {sum(1 for _ in sampler)}"
            except RuntimeError as err:
                outcome[case] = str(err)
        # the same through the DataModule (its content_check_samples default), outside a Trainer
        module = SeqPackDataModule(source=_dataset(rank), max_tokens=128)
        try:
            next(iter(module.train_dataloader()))
            outcome["datamodule"] = "no error"
        except RuntimeError as err:
            outcome["datamodule"] = str(err)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_different_tokens_with_equal_lengths_fail_on_every_rank(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["equal"].startswith("ok ")
        for case in ("different", "datamodule"):
            assert f"rank {rank} reads different data than ranks [{1 - rank}]" in outcome[case]
            assert "the lengths agree but the tokens" in outcome[case]


def test_content_digest_reads_a_few_fixed_samples():
    picked = sampled_indices(10_000, 8)
    assert picked.size == 8 and picked[0] == 0 and picked[-1] == 9_999 and np.all(np.diff(picked) > 0)
    assert np.array_equal(picked, sampled_indices(10_000, 8))
    data = _dataset()
    changed = [dict(s) for s in data]
    unread = next(i for i in range(len(data)) if i not in set(sampled_indices(len(data), 8).tolist()))
    changed[unread] = {"input_ids": [0] * len(data[unread]["input_ids"])}
    assert content_digest(changed, 8) == content_digest(data, 8)  # only the sampled samples are read
    changed[0] = {"input_ids": [1] * len(data[0]["input_ids"])}
    assert content_digest(changed, 8) != content_digest(data, 8)
    labelled = [{**s, "labels": [-100] * len(s["input_ids"])} for s in data]
    assert content_digest(labelled, 8) != content_digest(data, 8)


def test_datamodule_hands_the_sampler_a_content_digest():
    module = SeqPackDataModule(source=_dataset(), max_tokens=128)
    sampler = module.train_dataloader().batch_sampler
    assert sampler.content_digest() == content_digest(module.splits["train"][0], 8, 0)
    off = SeqPackDataModule(source=_dataset(), max_tokens=128, content_check_samples=0)
    assert off.train_dataloader().batch_sampler.content_digest is None
    with pytest.raises(ValueError, match="content_check_samples"):
        SeqPackDataModule(source=_dataset(), max_tokens=128, content_check_samples=-1)
