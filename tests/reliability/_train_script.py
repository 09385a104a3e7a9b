"""A small 2-process DDP CPU training run for the crash/resume test (run as a script, never collected).

``python tests/reliability/_train_script.py --out DIR [--kill-at-step K] [--ckpt-path CKPT]`` trains a tiny
``ReferenceLM`` on synthetic data through ``SeqPackDataModule`` with ``Trainer(strategy="ddp", devices=2,
accelerator="cpu")``; Lightning starts the second process itself by running this script again. Every rank appends
one JSON line per *trained* microbatch to ``DIR/rank{r}.jsonl`` (written in ``on_train_batch_end``, after forward
and backward, so a microbatch that a worker prefetched but the model never saw is not in the log)::

    {"epoch": 1, "step": 9, "batch_idx": 4, "indices": [17, 3, 40], "planned": [17, 3, 40], "loss": 1.93...}

``step`` is the number of optimizer steps done before the microbatch (its optimizer step, 0-based), ``indices``
the dataset indices the collator packed into the batch (carried in the batch itself), ``planned`` what the
rank's plan says for position ``batch_idx`` of the epoch, and ``loss`` the value returned for backward.

``--kill-at-step K``: once optimizer step ``K`` is done and a checkpoint exists, rank 0 sends SIGKILL to its whole
process group (both ranks and the loader workers), as a node failure would. ``--ckpt-path`` resumes a run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_seqpack import ReferenceLM, SeqPackDataModule

NUM_SAMPLES = 96
VOCAB = 64
MAX_TOKENS = 128
WORLD = 2
ACCUMULATE = 2
EPOCHS = 2
CHECKPOINT_EVERY = 4


class IndexedSamples:
    """``NUM_SAMPLES`` seeded random documents (2 to 120 tokens); each sample also carries its own ``index``."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = np.clip(np.round(rng.lognormal(np.log(24), 0.8, NUM_SAMPLES)), 2, 120).astype(np.int64)
        self._tokens = [rng.integers(1, VOCAB, int(n)).tolist() for n in self.lengths]

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self._tokens[index], "index": int(index)}


class WithIndices:
    """Wraps the DataModule's collator and adds the dataset indices of the batch (the collator ignores ``index``)."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = self.collate(samples)
        batch["sample_indices"] = [int(sample["index"]) for sample in samples]
        return batch


class RecordingDataModule(SeqPackDataModule):
    """``SeqPackDataModule`` whose training batches carry ``sample_indices``."""

    def train_dataloader(self) -> StatefulDataLoader:
        loader = super().train_dataloader()
        loader.collate_fn = WithIndices(loader.collate_fn)
        return loader


class TrainedLog(Callback):
    """Appends one JSON line per trained microbatch to ``rank{r}.jsonl`` (opened and closed every time)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._step = -1

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sampler = trainer.train_dataloader.batch_sampler
        record = {
            "epoch": trainer.current_epoch,
            "step": self._step,
            "batch_idx": batch_idx,
            "indices": batch["sample_indices"],
            "planned": sampler.plan.microbatch(sampler.rank, batch_idx).indices,
            "loss": float(outputs["loss"]),
        }
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")


class KillAtStep(Callback):
    """SIGKILL the process group once optimizer step ``step`` is done and ``last.ckpt`` exists (rank 0)."""

    def __init__(self, step: int, last: Path) -> None:
        self.step, self.last = step, last

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero and trainer.global_step >= self.step and self.last.is_file():
            os.killpg(os.getpgrp(), signal.SIGKILL)


def make_model() -> ReferenceLM:
    """A 1-layer reference decoder (width 32), seeded identically on every rank and every run."""
    L.seed_everything(0, verbose=False)
    return ReferenceLM(
        vocab_size=VOCAB,
        n_layer=1,
        n_head=2,
        n_kv_head=1,
        n_embd=32,
        intermediate_size=64,
        max_seq_len=MAX_TOKENS,
        lr=3e-3,
        warmup_steps=2,
        attn_backend="sdpa",
    )


def make_datamodule(dataset: Any = None, *, num_workers: int = 1) -> RecordingDataModule:
    """The DataModule of the run (packing, shuffled, seed 0)."""
    return RecordingDataModule(
        source=IndexedSamples() if dataset is None else dataset, max_tokens=MAX_TOKENS, num_workers=num_workers
    )


def parse_args(default_workers: int = 1) -> argparse.Namespace:
    """The command line of a crash/resume run (``--out``, ``--kill-at-step``, ``--ckpt-path``, ``--num-workers``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoints and per-rank logs go here")
    parser.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL the run after this optimizer step")
    parser.add_argument("--ckpt-path", type=str, default=None, help="resume from this checkpoint")
    parser.add_argument("--num-workers", type=int, default=default_workers, help="DataLoader worker processes per rank")
    return parser.parse_args()


def fit(args: argparse.Namespace, log: Callback, datamodule: L.LightningDataModule) -> None:
    """Train :func:`make_model` on ``datamodule`` with DDP over ``WORLD`` CPU ranks, checkpointing every
    ``CHECKPOINT_EVERY`` steps, SIGKILLed after ``--kill-at-step``, resumed from ``--ckpt-path``."""
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoints = args.out / "checkpoints"
    callbacks: list[Callback] = [
        log,
        ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=CHECKPOINT_EVERY, save_last=True, save_top_k=-1),
    ]
    if args.kill_at_step is not None:
        callbacks.append(KillAtStep(args.kill_at_step, checkpoints / "last.ckpt"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp",
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=callbacks,
    )
    trainer.fit(make_model(), datamodule=datamodule, ckpt_path=args.ckpt_path)
    trainer.save_checkpoint(args.out / "final.ckpt")


def main() -> None:
    args = parse_args()
    fit(args, TrainedLog(args.out), make_datamodule(num_workers=args.num_workers))


if __name__ == "__main__":
    main()
