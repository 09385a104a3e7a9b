"""Validation from ``val_path`` with ``eval_max_tokens`` on 2 gloo ranks through Lightning's DDP strategy."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import TokenizedSource
from tests._limits import TEST_TIMEOUT_S

WORLD, MAX_TOKENS, EVAL_MAX_TOKENS, NUM_VAL, FIRST_ID = 2, 64, 256, 37, 1000


class RecordingModule(L.LightningModule):
    """Evaluates nothing; records the first token (the sample's id) of every document of every val microbatch."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.out_dir = out_dir
        self.seen: list[dict] = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        row, bounds = batch["input_ids"][0], batch["cu_seqlens"].tolist()[: batch["num_documents"] + 1]
        self.seen.append({"tokens": row.numel(), "firsts": [int(row[start]) for start in bounds[:-1]]})

    def on_validation_end(self) -> None:
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))


def _write(path: Path, count: int, seed: int, first_id: int | None = None) -> str:
    rng = np.random.default_rng(seed)
    with path.open("w") as handle:
        for i, length in enumerate(rng.integers(2, MAX_TOKENS, count)):
            ids = rng.integers(1, 100, int(length)).tolist()
            if first_id is not None:
                ids[0] = first_id + i  # the sample's identity, read back from the packed rows
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_every_val_sample_once_over_two_ranks_within_eval_max_tokens(tmp_path):
    data = SeqPackDataModule(
        source=TokenizedSource(
            _write(tmp_path / "train.jsonl", 50, 0),
            format="jsonl",
            val_path=_write(tmp_path / "val.jsonl", NUM_VAL, 1, first_id=FIRST_ID),
        ),
        max_tokens=MAX_TOKENS,
        eval_max_tokens=EVAL_MAX_TOKENS,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp_spawn",
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(RecordingModule(str(tmp_path)), datamodule=data)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert len(seen[0]) == len(seen[1]) > 0  # lock-step: the same number of val microbatches on both ranks
    tokens = [batch["tokens"] for records in seen for batch in records]
    assert max(tokens) <= EVAL_MAX_TOKENS and max(tokens) > MAX_TOKENS  # the eval budget, not the training one
    firsts = Counter(first for records in seen for batch in records for first in batch["firsts"])
    assert firsts == Counter(range(FIRST_ID, FIRST_ID + NUM_VAL))  # every val sample exactly once over the ranks
