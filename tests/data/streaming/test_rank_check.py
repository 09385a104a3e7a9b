"""Ranks that read different streams fail loudly on every rank (2 gloo processes through Lightning DDP)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack import ReferenceLM, SeqPackDataModule
from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.data.streaming import loader as loader_module
from lit_seqpack.data.streaming import rank_check
from lit_seqpack.data.streaming.buffer import stream_windows
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.data.streaming.rank_check import window_digest
from lit_seqpack.planning.plan import PlanConfig
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks

WORLD, VOCAB, MAX_TOKENS, BUFFER, NUM_SAMPLES = 2, 64, 128, 10, 120


def _samples(changed_from: int | None = None, longer: bool = False) -> Iterator[dict[str, list[int]]]:
    """Seeded samples; from ``changed_from`` on, other tokens with the same lengths (``longer``: one more token)."""
    rng = np.random.default_rng(3)
    for index in range(NUM_SAMPLES):
        ids = rng.integers(1, VOCAB - 1, int(rng.integers(2, 40))).tolist()
        if changed_from is not None and index >= changed_from:
            ids = [t + 1 for t in ids] + ([1] if longer else [])
        yield {"input_ids": ids}


def _stream(changed_from: int | None = None, longer: bool = False) -> GeneratorStream:
    return GeneratorStream(functools.partial(_samples, changed_from, longer), vocab_size=VOCAB)


def _windows(stream: GeneratorStream) -> list[Any]:
    config = PlanConfig(max_tokens=MAX_TOKENS, world_size=WORLD)
    return list(stream_windows(stream.open(), config=config, window_size=BUFFER, epoch=0))


def _stand_in_collate(microbatch: Any) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(1)}


def _dataset(stream: GeneratorStream, *, world: int = 1, rank: int = 0, check_samples: int = 4) -> StreamingDataset:
    """A rank's streaming dataset with a stand-in collator (the check reads the windows, not the batches)."""
    return StreamingDataset(
        stream,
        config=PlanConfig(max_tokens=MAX_TOKENS, world_size=world),
        rank=rank,
        window_size=BUFFER,
        collator=_stand_in_collate,
        check_samples=check_samples,
    )


def test_the_window_digest_tells_lengths_and_tokens_apart() -> None:
    same, tokens, lengths = (_windows(s)[0] for s in (_stream(), _stream(0), _stream(0, longer=True)))
    digest = functools.partial(window_digest, epoch=0, samples=4)
    assert digest(same) == digest(_windows(_stream())[0])
    assert digest(tokens).lengths == digest(same).lengths and digest(tokens).tokens != digest(same).tokens
    assert digest(lengths).lengths != digest(same).lengths
    assert digest(same).window == 0 and digest(same, epoch=3).epoch == 3


def test_batches_carry_a_content_digest_only_when_the_check_is_on() -> None:
    def loader_facts(check_samples: int) -> list[Any]:
        return [batch["_stream"]["digest"] for batch in _dataset(_stream(), check_samples=check_samples)]

    on, off = loader_facts(4), loader_facts(0)
    assert len(off) == len(on)
    off, on = [d for d in off if d is not None], [d for d in on if d is not None]
    assert all(d.lengths is None and d.tokens is None for d in off)  # the window's numbers still travel
    assert [dataclasses.replace(d, lengths=None, tokens=None) for d in on] == off
    windows = [d.window for d in on]
    assert windows == list(range(len(_windows(_stream()))))  # one digest a window, with its record
    assert [d.samples_read for d in on][-1] == NUM_SAMPLES


def _fit(stream: GeneratorStream, **settings: Any) -> str:
    """Fit 2 steps under DDP on ``stream``; ``"trained"`` or the error's message."""
    torch.manual_seed(0)
    model = ReferenceLM(
        vocab_size=VOCAB, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64,
        max_seq_len=MAX_TOKENS, lr_schedule="constant", attn_backend="sdpa",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT),
        max_steps=2,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.setdefault("stream_split", "replicate")  # every rank reads the whole stream: compared across ranks
    data = SeqPackDataModule(source=stream, **settings, max_tokens=MAX_TOKENS, num_workers=1, window=BUFFER)
    try:
        trainer.fit(model, datamodule=data)
    except RuntimeError as err:
        return str(err)
    return "trained"


def _later_window(rank: int) -> str:
    """A loader (2 workers) read to the end outside a Trainer, the streams differing from sample 70 on rank 1."""
    dataset = _dataset(_stream(70 if rank else None), world=WORLD, rank=rank)
    try:
        return f"read {sum(1 for _ in StreamingDataLoader(dataset, num_workers=2))}"
    except RuntimeError as err:
        return str(err)


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_ranks(rank, WORLD, port)
    outcome = {
        "equal": _fit(_stream()),
        "different": _fit(_stream(0 if rank else None)),
        "unchecked": _fit(_stream(0 if rank else None), content_check_samples=0),
        "later": _later_window(rank),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def _first_window_holding(sample: int) -> int:
    return next(w.index for w in _windows(_stream()) if w.samples_read > sample)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ranks_reading_different_streams_fail_on_every_rank_and_equal_streams_train(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["equal"] == "trained"
        assert outcome["unchecked"] == "trained"  # content_check_samples=0 turns the check off
        assert f"rank {rank} reads a different stream than ranks [{1 - rank}]" in outcome["different"]
        assert "window 0 of epoch 0" in outcome["different"]
        assert "agree but the tokens of the sampled samples do not" in outcome["different"]
        assert f"window {_first_window_holding(70)} of epoch 0" in outcome["later"]  # every window is compared


def _loader(num_workers: int, check_samples: int = 4) -> StreamingDataLoader:
    return StreamingDataLoader(_dataset(_stream(), check_samples=check_samples), num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_checks_every_window_and_the_stream_end(monkeypatch, num_workers: int) -> None:
    checked: list[tuple[int, int, bool]] = []

    def record(digest: Any) -> None:
        checked.append((digest.epoch, digest.window, digest.ended))

    monkeypatch.setattr(loader_module, "check_ranks_agree", record)
    loader = _loader(num_workers)
    for _ in loader:
        pass
    count = len(_windows(_stream()))
    assert checked == [(0, w, False) for w in range(count)] + [(0, count, True)]  # one gather a window, one at the end
    checked.clear()
    batches = iter(loader)  # epoch 1, stopped after 13 microbatches and resumed in another loader
    for _ in range(13):
        next(batches)
    state = loader.state_dict()
    resumed_at = max(w["window"] for w in state["windows"] if w["first_microbatch"] <= state["yielded"])
    assert checked == [(1, w, False) for w in range(resumed_at + 1)]
    checked.clear()
    resumed = _loader(num_workers)
    resumed.load_state_dict(state)
    for _ in resumed:
        pass
    assert checked == [(1, w, False) for w in range(resumed_at, count)] + [(1, count, True)]
    checked.clear()
    for _ in _loader(num_workers, check_samples=0):  # the content check off: the windows' numbers are still compared
        pass
    assert checked == [(0, w, False) for w in range(count)] + [(0, count, True)]


def test_the_error_names_what_differs(monkeypatch) -> None:
    mine = rank_check.WindowDigest(epoch=0, window=8, first_sample=77, lengths="a", tokens="b")
    monkeypatch.setattr(rank_check, "distributed", lambda: True)
    monkeypatch.setattr(rank_check.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(rank_check.dist, "get_rank", lambda: 0)
    for other, message in (
        (dataclasses.replace(mine), None),
        (dataclasses.replace(mine, tokens="c"), "the lengths of window 8 of epoch 0 .from stream sample 77. agree"),
        (dataclasses.replace(mine, lengths="c"), "the lengths of the samples of window 8 of epoch 0 .* differ"),
        (
            dataclasses.replace(mine, window=9),
            r"the ranks are at different points of their streams .*"
            r"rank 0: window 8 of epoch 0; rank 1: window 9 of epoch 0\)",
        ),
        (
            dataclasses.replace(mine, samples_read=90, ended=True),
            r"the ranks are at .*rank 0: window 8 of epoch 0; "
            r"rank 1: its stream ended after 8 windows of epoch 0, 90 samples read",
        ),
    ):

        def gather(everyone: list, digest: Any, other: Any = other) -> None:
            everyone[:] = [digest, other]

        monkeypatch.setattr(rank_check.dist, "all_gather_object", gather)
        if message is None:
            rank_check.check_ranks_agree(mine)
        else:
            with pytest.raises(RuntimeError, match=r"rank 0 reads a different stream than ranks \[1\]: " + message):
                rank_check.check_ranks_agree(mine)
