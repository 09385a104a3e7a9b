"""``stream_split="rank"`` on 2 gloo ranks through Lightning DDP: each rank reads its own share, in lock step.

Every sample is trained exactly once per epoch over the ranks, every rank runs the same number of microbatches, each
step's ``step_loss_tokens`` is the step's total over both ranks (so the first step's gradient equals the unpacked
token-mean gradient of its samples, fp64, 1e-6), and shares of unequal length, an empty share (more ranks than row
groups) or an empty stream end on both ranks without a hang. The process group carries
:data:`~tests._limits.COLLECTIVE_TIMEOUT` and the test :data:`~tests._limits.TEST_TIMEOUT_S`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import JsonlStream, ParquetStream
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match, make_module, reference_gradients
from tests.reliability._train_script import WithIndices

WORLD, ACCUMULATE, MAX_TOKENS, WINDOW, NUM_SAMPLES = 2, 2, 64, 12, 70


def _samples(count: int) -> list[dict[str, Any]]:
    """Seeded documents of 2..30 tokens, some with a masked prompt, each carrying its ``index``."""
    gen = torch.Generator().manual_seed(5)
    samples = []
    for index in range(count):
        length = int(torch.randint(2, 31, (1,), generator=gen))
        ids = torch.randint(1, 64, (length,), generator=gen).tolist()
        prompt = length // 3 if index % 3 == 0 else 0
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "index": index})
    return samples


class Recorder(Callback):
    """Every trained microbatch of this rank: step, sample indices, filler or not, loss tokens."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.records.append(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step - (1 if (batch_idx + 1) % ACCUMULATE == 0 else 0),
                "indices": batch["sample_indices"],
                "empty": bool(batch["is_empty"]),
                "loss_tokens": int(batch["num_loss_tokens"]),
                "step_loss_tokens": int(batch["step_loss_tokens"]),
            }
        )


class Indexed(SeqPackDataModule):
    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        loader.dataset.collator = WithIndices(loader.dataset.collator)
        return loader


def _fit(source: Any, out: Path | None = None, *, workers: int = 1, **limits: Any) -> dict[str, Any]:
    recorder = Recorder()
    callbacks: list[Callback] = [recorder] + ([GradientCapture(str(out))] if out is not None else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT),
        precision="64-true",
        accumulate_grad_batches=ACCUMULATE,
        use_distributed_sampler=False,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **limits,
    )
    data = Indexed(source=source, max_tokens=MAX_TOKENS, window=WINDOW, num_workers=workers, stream_split="rank")
    try:
        trainer.fit(make_module("reference"), datamodule=data)
    except (RuntimeError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"records": recorder.records, "steps": trainer.global_step}


def _write_streams(folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    samples = _samples(NUM_SAMPLES)
    (folder / "data.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (folder / "empty.jsonl").write_text("")
    pq.write_table(pa.Table.from_pylist(samples[:60]), folder / "unequal.parquet", row_group_size=20)
    pq.write_table(pa.Table.from_pylist(samples[:30]), folder / "one.parquet", row_group_size=64)


class Unsplittable:
    """A stream with ``open`` only."""

    vocab_size = 64

    def open(self, position: Any = None) -> Any:
        return iter(_samples(4))


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_ranks(rank, WORLD, port)
    folder = Path(out_dir)
    jsonl = JsonlStream(str(folder / "data.jsonl"), vocab_size=64)
    outcome = {
        "even": _fit(jsonl, folder / "grads.pt", max_epochs=2),
        "even_no_workers": _fit(jsonl, workers=0, max_epochs=1),
        # 3 row groups of 20 rows: rank 0 reads 40 rows, rank 1 reads 20 and then fills
        "unequal": _fit(ParquetStream(str(folder / "unequal.parquet"), vocab_size=64), max_epochs=1),
        # one row group: rank 1's share is empty (more ranks than row groups); max_steps beyond the stream
        "one_group": _fit(ParquetStream(str(folder / "one.parquet"), vocab_size=64), max_steps=1000, max_epochs=2),
        "empty": _fit(JsonlStream(str(folder / "empty.jsonl"), vocab_size=64), max_steps=3),
        "unsplittable": _fit(Unsplittable(), max_epochs=1),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def _check_lock_step(outcomes: list[dict[str, Any]], count: int, epochs: int) -> None:
    """Every sample once per epoch over the ranks, the same microbatches on each rank, one normaliser a step."""
    per_rank = [o["records"] for o in outcomes]
    assert len({len(records) for records in per_rank}) == 1, [len(r) for r in per_rank]
    for epoch in range(epochs):
        trained = Counter(i for records in per_rank for r in records if r["epoch"] == epoch for i in r["indices"])
        assert trained == Counter(range(count)), f"epoch {epoch}: every sample exactly once"
    for step in {r["step"] for r in per_rank[0]}:
        records = [r for rank in per_rank for r in rank if r["step"] == step]
        assert len(records) == WORLD * ACCUMULATE
        assert {r["step_loss_tokens"] for r in records} == {sum(r["loss_tokens"] for r in records)}, step


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ranks_read_their_own_shares_in_lock_step_with_the_exact_loss(tmp_path: Path) -> None:
    _write_streams(tmp_path)
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    case = {key: [o[key] for o in outcomes] for key in outcomes[0]}
    assert not any("error" in o for key in ("even", "even_no_workers", "unequal", "one_group") for o in case[key])
    _check_lock_step(case["even"], NUM_SAMPLES, epochs=2)
    _check_lock_step(case["even_no_workers"], NUM_SAMPLES, epochs=1)
    assert all({frozenset(r["indices"]) for r in o["records"]} for o in case["even"])
    shares = [{i for r in o["records"] if r["epoch"] == 0 for i in r["indices"]} for o in case["even"]]
    assert shares[0] and shares[1] and not shares[0] & shares[1]  # each rank trained its own share
    _check_lock_step(case["unequal"], 60, epochs=1)
    fillers = [sum(r["empty"] for r in o["records"]) for o in case["unequal"]]
    assert fillers[1] > fillers[0]  # rank 1's share ended first: it filled until rank 0's ended
    _check_lock_step(case["one_group"], 30, epochs=2)
    assert all(r["empty"] for r in case["one_group"][1]["records"])  # an empty share: fillers only, no hang
    for outcome in case["empty"]:
        assert outcome["error"].startswith("ValueError: the stream JsonlStream(")
        assert "gave no microbatch in epoch 0" in outcome["error"]
    for outcome in case["unsplittable"]:
        assert outcome["error"].startswith("ValueError: stream_split='rank' reads a share of the stream on each of")
        assert "Unsplittable has no split(index, count)" in outcome["error"]
    first = [r for o in case["even"] for r in o["records"] if r["epoch"] == 0 and r["step"] == 0]
    samples = _samples(NUM_SAMPLES)
    step_samples = [samples[i] for r in first for i in r["indices"]]
    expected = reference_gradients(make_module("reference"), step_samples)
    assert_gradients_match(torch.load(tmp_path / "grads.pt"), expected, rtol=1e-6)
