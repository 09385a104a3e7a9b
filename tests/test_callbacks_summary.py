"""The end-of-fit summary of a short run reports the losses the logger wrote: the first and the last, truthfully."""

from __future__ import annotations

import csv
import logging

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lit_seqpack.callbacks import PackingMonitor
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset
from lit_seqpack.model.lm import ReferenceLM

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
]


@pytest.mark.parametrize(("steps", "every", "shown"), [(6, 1, 3), (3, 1, 1), (24, 2, 5)])
def test_short_run_summary_matches_the_logged_losses(tmp_path, caplog, steps, every, shown):
    source = SyntheticInstructionDataset(num_samples=400, median_length=24, max_length=64, vocab_size=32)
    data = SeqPackDataModule(source=source, max_tokens=128)
    model = ReferenceLM(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, lr=1e-2)
    trainer = L.Trainer(
        max_steps=steps,
        log_every_n_steps=every,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[PackingMonitor(summary=True, loss_window=5)],
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(model, data)
    with (tmp_path / "run" / "version_0" / "metrics.csv").open() as file:
        logged = [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]
    assert len(logged) == steps // every
    assert logged[0] != logged[-1]  # the run moved (the summary must show it)
    text = next(r.getMessage() for r in caplog.records if "PackingMonitor summary" in r.getMessage())
    line = next(line for line in text.splitlines() if "train/loss" in line)
    head, tail = sum(logged[:shown]) / shown, sum(logged[-shown:]) / shown
    assert f"{head:.4f} -> {tail:.4f}" in line, (line, logged)
    assert f"of {len(logged)} logged steps" in line
