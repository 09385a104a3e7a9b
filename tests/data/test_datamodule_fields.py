"""Declared fields through SeqPackDataModule: packed, dynamic, padded and context-parallel loaders, the over-long
policy and the CLI's YAML config."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from lit_seqpack.data.batching.overlong import apply_overlong_policy
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.parallel.context import gather_packed_batches

PAD = -1.0
FIELDS = {"token_fields": {"score": PAD}, "sample_fields": ["reward"]}


def _records(n: int = 60, seed: int = 0, longest: int = 40) -> list[dict]:
    """Samples whose token field is ``id / 4`` (so alignment is checkable) and whose reward is the sample's index."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(1, 50, size=int(rng.integers(2, longest))).tolist()
        labels = [-100] + ids[1:]
        out.append({"input_ids": ids, "labels": labels, "score": [t / 4 for t in ids], "reward": float(i)})
    return out


def _check_batch(batch, records, max_tokens=None):
    ids, score = batch["input_ids"], batch["score"]
    assert score.shape == ids.shape and score.dtype == torch.float32
    if "attention_mask" in batch:
        real = batch["attention_mask"].bool()
        docs = [ids[row][real[row]].tolist() for row in range(ids.shape[0])]
    else:
        cu, real_cu = batch["cu_seqlens"].tolist(), batch.get("cu_seqlens_unpadded", batch["cu_seqlens"]).tolist()
        real = torch.zeros_like(ids, dtype=torch.bool)
        docs = []
        for d in range(batch["num_documents"]):
            real[0, cu[d] : cu[d] + real_cu[d + 1] - real_cu[d]] = True
            docs.append(ids[0, cu[d] : cu[d] + real_cu[d + 1] - real_cu[d]].tolist())
    torch.testing.assert_close(score[real], ids[real].float() / 4, rtol=0, atol=0)
    assert bool((score[~real] == PAD).all())
    assert batch["reward"].shape == (len(docs),)
    for doc, reward in zip(docs, batch["reward"].tolist(), strict=True):  # the reward follows its own document
        expected = records[int(reward)]["input_ids"]
        assert doc == (expected if max_tokens is None else expected[:max_tokens])


@pytest.mark.parametrize(("mode", "extra"), [("packing", {}), ("dynamic", {}), ("padded", {"batch_size": 4})])
def test_fields_travel_aligned_through_every_mode(mode, extra):
    records = _records()
    dm = SeqPackDataModule(
        source=records,
        **FIELDS,
        **extra,
        mode=mode,
        max_tokens=None if mode == "padded" else 64,
        val_fraction=0.1,
    )
    dm.setup("fit")
    seen = 0
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        _check_batch(batch, records)
        seen += batch["num_documents"]
    assert seen == len(records)


def test_fields_are_truncated_with_the_sample_and_sample_fields_kept():
    records = _records(longest=70)
    dm = SeqPackDataModule(source=records, **FIELDS, mode="packing", max_tokens=32, overlong="truncate")
    dm.setup("fit")
    assert dm.overlong_report.num_truncated > 0
    for batch in dm.train_dataloader():
        _check_batch(batch, records, max_tokens=32)


def test_truncate_cuts_loss_mask_and_declared_fields_and_refuses_a_misaligned_field():
    data = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1], "w": [1.0, 2.0, 3.0, 4.0], "r": 7}]
    view, _, _ = apply_overlong_policy(data, [4], max_tokens=2, policy="truncate", token_fields=["w"])
    assert view[0] == {"input_ids": [1, 2], "loss_mask": [0, 1], "w": [1.0, 2.0], "r": 7}
    short = [{"input_ids": [1, 2, 3, 4], "w": [1.0, 2.0, 3.0]}]
    view, _, _ = apply_overlong_policy(short, [4], max_tokens=2, policy="truncate", token_fields=["w"])
    with pytest.raises(ValueError, match="sample 0: w has 3 entries but input_ids has 4 tokens"):
        view[0]


class _FakeTrainer:
    """The attributes SeqPackDataModule reads from a Trainer, for one global rank of a multi-process run."""

    _accelerator_connector = SimpleNamespace(use_distributed_sampler=False)

    def __init__(self, world_size: int, global_rank: int) -> None:
        self.world_size, self.global_rank, self.accumulate_grad_batches = world_size, global_rank, 1
        self.fit_loop = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)))


def test_fields_are_sharded_under_context_parallelism_and_gather_back():
    records = _records()
    shards = []
    for rank in range(2):
        dm = SeqPackDataModule(source=records, **FIELDS, mode="packing", max_tokens=96, context_parallel_size=2)
        dm.trainer = _FakeTrainer(2, rank)
        dm.setup("fit")
        shards.append(list(dm.train_dataloader()))
    for first, second in zip(*shards, strict=True):
        assert first["shift_score"].shape == first["input_ids"].shape
        assert first["reward"].tolist() == second["reward"].tolist()
        _check_batch(gather_packed_batches([first, second]), records)


def test_undeclared_keys_warn_through_the_datamodule(caplog):
    dm = SeqPackDataModule(source=_records(), mode="packing", max_tokens=64, sample_fields=["reward"])
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.batching.fields"):
        batches = list(dm.train_dataloader())
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["samples carry ['score']"]
    assert all("score" not in b for b in batches)


def test_a_bad_declaration_fails_at_construction():
    with pytest.raises(ValueError, match="token_fields declares 'labels', a key of the batch contract"):
        SeqPackDataModule(token_fields={"labels": 0})


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*")
def test_fields_are_settable_from_the_cli_yaml(tmp_path):
    from lit_seqpack.cli import SeqPackCLI

    data = tmp_path / "data.jsonl"  # a file source keeps the declared fields (the synthetic task has none)
    record = {"input_ids": [1, 2, 3], "advantages": [0.5, 1.0, 2.0], "mask": [1, 0, 1], "reward": 1.0}
    data.write_text(json.dumps(record) + "\n")
    config = {
        "data": {
            "source": {"class_path": "lit_seqpack.data.sources.TokenizedSource", "init_args": {"path": str(data)}},
            "token_fields": {"advantages": 0.0, "mask": 0},
            "sample_fields": ["reward"],
        },
        "trainer": {"logger": False},
    }
    path = tmp_path / "fields.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = SeqPackCLI(args=["--model", "lit_seqpack.model.lm.ReferenceLM", "--config", str(path)], run=False)
    collator = cli.datamodule.settings.collator()
    assert collator.token_fields == {"advantages": 0.0, "mask": 0} and collator.sample_fields == ("reward",)
    assert type(collator.token_fields["mask"]) is int and type(collator.token_fields["advantages"]) is float
