"""``overlong="split"``: every token of every sample trained exactly once per epoch, in pieces of the document budget.

Every sample carries a token field ``origin`` (``1000 x sample + position``) and a sample field ``sid``; the batches
of an epoch, gathered over the ranks, must hold every ``origin`` once, each piece as a document of its own (positions
restart, first label masked, the sample's own labels elsewhere), rows within the budget and the planned
``step_loss_tokens`` equal to the loss tokens the step's microbatches really hold.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.data.batching.overlong import OverlongReport, SplitDataset, apply_overlong_policy, split_pieces
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.data.sources.tokenized import TokenizedDataset

VOCAB, MAX_TOKENS = 64, 16


def records(count: int = 40, seed: int = 0) -> list[dict[str, Any]]:
    """Samples of 1-60 tokens (most over the budget), a masked prompt each, plus the edge cases of a split: exactly
    two budgets, and two budgets and one token (a last piece of one token, which trains nothing)."""
    rng = np.random.default_rng(seed)
    sizes = [*rng.integers(1, 61, count - 2).tolist(), 2 * MAX_TOKENS, 2 * MAX_TOKENS + 1]
    out = []
    for sid, size in enumerate(sizes):
        ids = rng.integers(1, VOCAB, size).tolist()
        prompt = int(rng.integers(0, size // 2 + 1))
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        out.append({"input_ids": ids, "labels": labels, "origin": [sid * 1000 + p for p in range(size)], "sid": sid})
    return out


def expected_loss_tokens(samples: list[dict[str, Any]], budget: int) -> int:
    """Loss tokens of every piece: its own labels after its first token."""
    total = 0
    for sample in samples:
        labels = np.asarray(sample["labels"])
        for start in range(0, len(labels), budget):
            total += int(np.count_nonzero(labels[start + 1 : start + budget] != IGNORE_INDEX))
    return total


class FakeTrainer:
    """The attributes the DataModule reads from a Trainer, for one rank of a run (the plan needs no collective)."""

    class _Conn:
        use_distributed_sampler = False

    _accelerator_connector = _Conn()

    def __init__(self, world_size: int, global_rank: int, accumulate: int) -> None:
        self.world_size, self.global_rank, self.accumulate_grad_batches = world_size, global_rank, accumulate
        self.fit_loop = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)))
        self.state = SimpleNamespace(fn="fit")


def documents(batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """The documents of a packed or padded batch: their tokens, labels, positions, origins and sample field."""
    sid = batch["sid"].tolist()
    if batch["is_empty"]:  # a lock-step filler: one row of padding, no document
        return []
    if "cu_seqlens" in batch:
        bounds = batch["cu_seqlens"].tolist()[: len(sid) + 1]
        spans = [(0, slice(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    else:
        spans = [(row, mask.bool()) for row, mask in enumerate(batch["attention_mask"])]
    keys = ("input_ids", "labels", "position_ids", "origin")
    return [{"sid": s} | {k: batch[k][row][where] for k in keys} for s, (row, where) in zip(sid, spans, strict=True)]


def check_epoch(
    rank_batches: list[list[dict[str, Any]]], samples: list[dict[str, Any]], *, budget: int, accumulate: int, mode: str
) -> None:
    """Every token of ``samples`` once over the ranks, each piece a document of its own, rows within the budget,
    ``step_loss_tokens`` equal to the loss tokens of each step."""
    assert len({len(batches) for batches in rank_batches}) == 1  # lock step
    seen: Counter[int] = Counter()
    for batches in rank_batches:
        for batch in batches:
            if mode == "packing":
                assert batch["input_ids"].shape[1] <= MAX_TOKENS
            elif mode == "dynamic":
                assert batch["input_ids"].numel() <= MAX_TOKENS
            for doc in documents(batch):
                origin = doc["origin"].tolist()
                sample, first = origin[0] // 1000, origin[0] % 1000
                assert doc["sid"] == sample and first % budget == 0 and len(origin) <= budget
                assert origin == [sample * 1000 + first + k for k in range(len(origin))]  # the piece's own tokens
                source = samples[sample]
                assert doc["input_ids"].tolist() == source["input_ids"][first : first + len(origin)]
                assert doc["position_ids"].tolist() == list(range(len(origin)))  # positions restart
                labels = source["labels"][first : first + len(origin)]
                assert doc["labels"].tolist() == [IGNORE_INDEX, *labels[1:]]  # a piece's first token has no label
                seen.update(origin)
    assert seen == Counter(sid * 1000 + p for sid, s in enumerate(samples) for p in range(len(s["input_ids"])))
    steps = len(rank_batches[0]) // accumulate
    total = 0
    for step in range(steps):
        step_batches = [b for batches in rank_batches for b in batches[step * accumulate : (step + 1) * accumulate]]
        held = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in step_batches)
        assert {b["step_loss_tokens"] for b in step_batches} == {held}
        total += held
    assert total == expected_loss_tokens(samples, budget)


def module(source: Any, mode: str = "packing", **kwargs: Any) -> SeqPackDataModule:
    settings = {
        "source": source,
        "mode": mode,
        "max_tokens": MAX_TOKENS,
        "overlong": "split",
        "token_fields": {"origin": -1},
        "sample_fields": ["sid"],
        "content_check_samples": 0,
    } | ({"batch_size": 3} if mode == "padded" else {})
    return SeqPackDataModule(**(settings | kwargs))


def test_the_split_view_cuts_pieces_at_multiples_of_the_budget_and_reports_them() -> None:
    samples = records(6)
    lengths = [len(s["input_ids"]) for s in samples]
    view, view_lengths, report = apply_overlong_policy(samples, lengths, MAX_TOKENS, "split", token_fields=["origin"])
    assert isinstance(view, SplitDataset)
    sample, piece, length = split_pieces(lengths, MAX_TOKENS)
    assert view.original_indices.tolist() == sample.tolist() and view.piece_indices.tolist() == piece.tolist()
    assert view_lengths.tolist() == length.tolist() and int(view_lengths.sum()) == sum(lengths)
    assert view.piece(len(view) - 1) == (5, 2) and view_lengths[-1] == 1  # 33 tokens: a last piece of one token
    for i in range(len(view)):
        s, k = view.piece(i)
        assert view[i]["origin"] == samples[s]["origin"][k * MAX_TOKENS : (k + 1) * MAX_TOKENS]
        assert view[i]["sid"] == s  # a sample field repeats on every piece
    over = [n for n in lengths if n > MAX_TOKENS]
    assert report == OverlongReport(
        policy="split",
        max_tokens=MAX_TOKENS,
        num_samples=6,
        num_overlong=len(over),
        num_split=len(over),
        num_pieces=sum(-(-n // MAX_TOKENS) for n in over),
        indices=report.indices,
        lengths=report.lengths,
    )
    assert f"overlong='split' split {len(over)} samples into {report.num_pieces} pieces" in report.summary()
    declared = TokenizedDataset.from_records([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])
    split = apply_overlong_policy(declared, declared.lengths, MAX_TOKENS, "split")[0]
    counts = [int(np.count_nonzero(np.asarray(split[i]["labels"])[1:] != IGNORE_INDEX)) for i in range(len(split))]
    assert split.loss_tokens.tolist() == counts and counts[-1] == 0  # the one-token piece trains nothing
    assert split.fingerprint is None or split.fingerprint.endswith(f"|split:{MAX_TOKENS}")


@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_token_is_trained_once_per_epoch_in_pieces(mode: str, world_size: int) -> None:
    samples, accumulate = records(), 2
    rank_batches = []
    for rank in range(world_size):
        dm = module(samples, mode)
        dm.trainer = FakeTrainer(world_size, rank, accumulate)
        dm.setup("fit")
        rank_batches.append(list(dm.train_dataloader()))
    report = dm.overlong_report
    assert report.num_split == sum(len(s["input_ids"]) > MAX_TOKENS for s in samples) > 0
    assert len(dm.pipeline.splits["train"].lengths) == len(samples) - report.num_split + report.num_pieces
    check_epoch(rank_batches, samples, budget=MAX_TOKENS, accumulate=accumulate, mode=mode)


def test_the_budget_under_pad_to_multiple_of_cuts_the_pieces() -> None:
    samples = records()
    dm = module(samples, pad_to_multiple_of=3)  # documents padded to 3: a row of 16 holds documents of 15
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert dm.overlong_report.max_tokens == 15
    for batch in batches:  # the padding of each document is not a document: drop it before the check
        keep = batch["origin"][0] >= 0
        bounds = [0, *np.cumsum([int((batch["origin"][0][a:b] >= 0).sum()) for a, b in _pairs(batch)]).tolist()]
        for key in ("input_ids", "labels", "position_ids", "origin"):
            batch[key] = batch[key][:, keep]
        batch["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    check_epoch([batches], samples, budget=15, accumulate=1, mode="padded")


def _pairs(batch: dict[str, Any]) -> list[tuple[int, int]]:
    bounds = batch["cu_seqlens"].tolist()[: len(batch["sid"]) + 1]
    return list(zip(bounds, bounds[1:], strict=False))


def test_evaluation_splits_hold_out_whole_samples_and_evaluate_every_piece() -> None:
    samples = records(60)
    dm = module(samples, val_fraction=0.25)
    dm.setup("fit")
    train = dm.pipeline.splits["train"].dataset
    val = dm.pipeline.splits["val"].dataset
    trained = {train.dataset.piece(int(i))[0] for i in train.indices}
    held = {val.dataset.piece(int(i))[0] for i in val.indices}
    assert not trained & held and trained | held == set(range(60)) and len(held) == 15  # a quarter of the samples
    check_epoch([list(dm.val_dataloader())], [samples[i] if i in held else _empty(i) for i in range(60)],
                budget=MAX_TOKENS, accumulate=1, mode="packing")  # fmt: skip
    own = module(samples[:30], val_source=samples[30:])
    own.setup("fit")
    assert own.eval_overlong_reports["val"].num_split == sum(len(s["input_ids"]) > MAX_TOKENS for s in samples[30:])
    origins = Counter(o for b in own.val_dataloader() for o in b["origin"].flatten().tolist() if o >= 0)
    assert origins == Counter(o for s in samples[30:] for o in s["origin"])


def _empty(sid: int) -> dict[str, Any]:
    return {"input_ids": [], "labels": [], "origin": [], "sid": sid}


@pytest.mark.parametrize("mode", ["packing", "padded"])
def test_a_resume_mid_epoch_continues_bitwise(mode: str) -> None:
    samples = records()

    def fresh() -> SeqPackDataModule:
        dm = module(samples, mode, seed=3)
        dm.trainer = FakeTrainer(1, 0, 2)
        dm.setup("fit")
        return dm

    reference = list(fresh().train_dataloader())
    first = fresh()
    batches = iter(first.train_dataloader())
    head = [next(batches) for _ in range(5)]
    resumed = fresh()
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed.train_dataloader())
    assert len(head) + len(rest) == len(reference) > 6
    for got, want in zip(head + rest, reference, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value


def stream(samples: list[dict[str, Any]]) -> GeneratorStream:
    return GeneratorStream(lambda: iter([dict(s) for s in samples]), vocab_size=VOCAB)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_stream_splits_as_it_reads_and_resumes_mid_stream(mode: str) -> None:
    samples = records(60)
    settings = {"window": 8, "num_workers": 0}
    dm = module(stream(samples), mode, **settings)
    reference = list(dm.train_dataloader())
    check_epoch([reference], samples, budget=MAX_TOKENS, accumulate=1, mode=mode)
    indexed = module(samples, mode)
    indexed.setup("fit")
    assert dm.overlong_report == indexed.overlong_report  # the same counts as the map-style path
    first = module(stream(samples), mode, **settings)
    batches = iter(first.train_dataloader())
    head = [next(batches) for _ in range(7)]
    resumed = module(stream(samples), mode, **settings)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed.train_dataloader())
    assert len(head) + len(rest) == len(reference)
    for got, want in zip(head + rest, reference, strict=True):
        for key, value in want.items():
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
    assert resumed.overlong_report == dm.overlong_report


def test_a_dataset_whose_lengths_change_per_epoch_is_split_again_every_epoch() -> None:
    """Re-planned every epoch (``lengths_change_per_epoch``): the second epoch's longer samples are split anew."""
    from lit_seqpack.model import ReferenceLM
    from tests.data.test_plan_check import GrowingPrompt, _Lengths, _trainer

    data = GrowingPrompt({0: 3, 1: 70}, declare=True)  # 7 tokens, then 74 = 64 + 10
    model = ReferenceLM(
        vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32, max_seq_len=64
    )
    seen = _Lengths()
    dm = SeqPackDataModule(source=data, max_tokens=64, overlong="split")
    _trainer(reload_dataloaders_every_n_epochs=1, callbacks=[seen]).fit(model, datamodule=dm)
    assert sorted(seen.seen[0]) == [7] * 24 and sorted(seen.seen[1]) == [10] * 24 + [64] * 24
    assert (dm.overlong_report.num_split, dm.overlong_report.num_pieces) == (24, 48)
