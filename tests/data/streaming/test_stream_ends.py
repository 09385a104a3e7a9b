"""The ends of a replicated stream never hang: a rank that reads more, or an empty stream, raises on every rank.

``stream_split="replicate"`` (every rank reads the whole stream); the ends of shares read by rank are in
``test_rank_split_ddp``.

Two gloo processes train through Lightning DDP (and read a bare loader) on JSONL files that differ only in the tail,
as a file appended while training does; before the end of the stream was compared, both ranks stopped after the
shorter stream's microbatches and waited for each other forever. The collectives carry
:data:`~tests._limits.COLLECTIVE_TIMEOUT` and the test :data:`~tests._limits.TEST_TIMEOUT_S`, so a regression fails
instead of hanging the suite.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack import ReferenceLM, SeqPackDataModule
from lit_seqpack.data.sources import GeneratorStream, JsonlStream
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.planning.plan import PlanConfig
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks

WORLD, VOCAB, MAX_TOKENS, WINDOW, NUM_SAMPLES = 2, 64, 128, 10, 60


def _write(path: Path, count: int) -> Path:
    """``count`` seeded JSONL samples (the first ``n`` are the same for every ``count >= n``)."""
    rng = np.random.default_rng(3)
    lines = [
        json.dumps({"input_ids": rng.integers(1, VOCAB - 1, int(rng.integers(2, 40))).tolist()}) for _ in range(count)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _model() -> ReferenceLM:
    torch.manual_seed(0)
    return ReferenceLM(
        vocab_size=VOCAB, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64,
        max_seq_len=MAX_TOKENS, lr_schedule="constant", attn_backend="sdpa",
    )  # fmt: skip


def _fit(source: Any, *, devices: int = WORLD, mode: str = "packing", **limits: Any) -> dict[str, Any]:
    """Fit on ``source``; the outcome (``"trained"`` and the steps, or the error) and the seconds it took."""
    strategy = DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT) if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **limits,
    )
    data = SeqPackDataModule(
        source=source, mode=mode, max_tokens=MAX_TOKENS, num_workers=1, window=WINDOW, stream_split="replicate"
    )
    began = time.perf_counter()
    try:
        trainer.fit(_model(), datamodule=data)
        outcome = f"trained {trainer.global_step} steps"
    except (RuntimeError, ValueError) as err:
        outcome = f"{type(err).__name__}: {err}"
    return {"outcome": outcome, "seconds": round(time.perf_counter() - began, 2)}


def _stand_in_collate(microbatch: Any) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(1)}


def _read(source: Any, rank: int) -> dict[str, Any]:
    """A bare loader (2 workers, dynamic batching: windows of exactly ``WINDOW`` samples) read to the end."""
    dataset = StreamingDataset(
        source,
        config=PlanConfig(mode="dynamic", max_tokens=MAX_TOKENS, world_size=WORLD),
        rank=rank,
        window_size=WINDOW,
        collator=_stand_in_collate,
        check_samples=4,
    )
    try:
        return {"outcome": f"read {sum(1 for _ in StreamingDataLoader(dataset, num_workers=2))}"}
    except RuntimeError as err:
        return {"outcome": f"RuntimeError: {err}"}


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_ranks(rank, WORLD, port)
    files = Path(out_dir, f"files{rank}")

    def stream(name: str, count: int) -> JsonlStream:
        return JsonlStream(str(_write(files / f"{name}.jsonl", count)), vocab_size=VOCAB)

    outcome = {
        "equal": _fit(stream("equal", NUM_SAMPLES), max_epochs=2),
        # dynamic batching carries no sample between windows: rank 1's 10 more samples are one more window
        "extra_window": _fit(stream("extra_window", NUM_SAMPLES + 10 * rank), mode="dynamic", max_epochs=1),
        "longer_last_window": _fit(stream("longer_last_window", NUM_SAMPLES + 3 * rank), max_epochs=1),
        "read_extra_window": _read(stream("read", NUM_SAMPLES + 10 * rank), rank),
        "empty": _fit(stream("empty", 0), max_steps=3),
        "one_empty": _fit(stream("one_empty", NUM_SAMPLES * rank), max_steps=3),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_streams_that_differ_in_the_tail_or_are_empty_raise_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    print({k: [o[k].get("seconds") for o in outcomes] for k in outcomes[0]})  # seconds until each rank's fit ended
    windows = NUM_SAMPLES // WINDOW  # dynamic batching: windows of exactly WINDOW samples
    last = list(_windows_of(tmp_path / "files0" / "equal.jsonl"))[-1]  # packing: the last window carries none
    for rank, outcome in enumerate(outcomes):
        said = {key: value["outcome"] for key, value in outcome.items()}
        assert said["equal"].startswith("trained ")  # two epochs: the end of each is compared, and agrees
        different = f"RuntimeError: rank {rank} reads a different stream than ranks [{1 - rank}]"
        for key in ("extra_window", "read_extra_window"):
            assert said[key].startswith(different)
            assert (
                f"rank 0: its stream ended after {windows} windows of epoch 0, {NUM_SAMPLES} samples read" in said[key]
            )
            assert f"rank 1: window {windows} of epoch 0, read stream samples {NUM_SAMPLES} to 69)" in said[key]
        assert said["longer_last_window"].startswith(different)
        rank0 = f"rank 0: window {last.index} of epoch 0, read stream samples {last.first_sample} to {NUM_SAMPLES - 1}"
        rank1 = f"rank 1: window {last.index} of epoch 0, read stream samples {last.first_sample} to {NUM_SAMPLES + 2}"
        assert f"({rank0}; {rank1})" in said["longer_last_window"]  # rank 1 read 3 more samples in its last window
        assert said["empty"].startswith("ValueError: the stream JsonlStream(")
        assert f"files{rank}/empty.jsonl) gave no microbatch in epoch 0" in said["empty"]
        assert said["one_empty"].startswith(different)
        assert (
            "rank 0: its stream ended after 0 windows of epoch 0, 0 samples read; rank 1: window 0" in said["one_empty"]
        )


def _windows_of(path: Path) -> Any:
    from lit_seqpack.data.streaming.buffer import stream_windows

    config = PlanConfig(max_tokens=MAX_TOKENS, world_size=WORLD)
    return stream_windows(JsonlStream(str(path)).open(), config=config, window_size=WINDOW, epoch=0)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("limits", [{"max_steps": 3}, {"max_epochs": 1}])
def test_an_empty_stream_is_refused_at_its_first_window_naming_it(tmp_path: Path, limits: dict) -> None:
    empty = _write(tmp_path / "empty.jsonl", 0)
    said = _fit(JsonlStream(str(empty), vocab_size=VOCAB), devices=1, **limits)["outcome"]
    assert said.startswith(f"ValueError: the stream JsonlStream({empty}) gave no microbatch in epoch 0: it is empty")


def test_a_stream_whose_every_sample_is_dropped_is_refused() -> None:
    def overlong() -> Any:
        return ({"input_ids": [1] * (MAX_TOKENS + 1)} for _ in range(5))

    data = SeqPackDataModule(
        source=GeneratorStream(overlong, vocab_size=VOCAB), max_tokens=MAX_TOKENS, overlong="drop", window=WINDOW
    )
    data.setup("fit")
    with pytest.raises(ValueError, match=r"GeneratorStream\(.*overlong\) gave no microbatch in epoch 0"):
        next(iter(data.train_dataloader()))
