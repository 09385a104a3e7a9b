"""A small 2-process DDP CPU run on a *stream* for the streaming crash/resume test (run as a script, never collected).

``python tests/reliability/_stream_train_script.py --out DIR [--kill-at-step K] [--ckpt-path CKPT]`` trains the
tiny ``ReferenceLM`` of ``_train_script`` on :data:`NUM_SAMPLES` generated samples read as a
:class:`~lit_seqpack.data.sources.GeneratorStream` (windows of :data:`BUFFER` samples, so the stream spans several
windows and ends in a short one) through ``SeqPackDataModule(source=...)`` under ``Trainer(strategy="ddp")``. Each
rank logs every trained microbatch to ``DIR/rank{r}.jsonl`` (``_train_script.TrainedLog`` without the plan lookup)::

    {"epoch": 1, "step": 9, "batch_idx": 4, "indices": [17, 3, 40], "loss": 1.93..., "empty": false}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lit_seqpack import SeqPackDataModule  # noqa: E402
from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.data.streaming.loader import StreamingDataLoader  # noqa: E402
from tests.reliability._train_script import (  # noqa: E402
    ACCUMULATE,
    EPOCHS,
    MAX_TOKENS,
    VOCAB,
    WORLD,
    WithIndices,
    fit,
    parse_args,
)

__all__ = ["ACCUMULATE", "EPOCHS", "NUM_SAMPLES", "WORLD", "StreamTrainedLog", "make_datamodule", "samples"]

NUM_SAMPLES = 150
BUFFER = 40


def samples() -> Any:
    """The stream: seeded documents of 2 to 120 tokens, each carrying its ``index`` (the same on every call)."""
    rng = np.random.default_rng(0)
    for index in range(NUM_SAMPLES):
        length = int(np.clip(np.round(rng.lognormal(np.log(24), 0.8)), 2, 120))
        yield {"input_ids": rng.integers(1, VOCAB, length).tolist(), "index": index}


class RecordingStreamModule(SeqPackDataModule):
    """A streaming ``SeqPackDataModule`` whose batches carry ``sample_indices``."""

    def train_dataloader(self) -> StreamingDataLoader:
        loader = super().train_dataloader()
        loader.dataset.collator = WithIndices(loader.dataset.collator)
        return loader


class StreamTrainedLog(Callback):
    """One JSON line per trained microbatch in ``rank{r}.jsonl``."""

    def __init__(self, out: Path) -> None:
        self.out, self._step = out, -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        record = {
            "epoch": trainer.current_epoch,
            "step": self._step,
            "batch_idx": batch_idx,
            "indices": batch["sample_indices"],
            "loss": float(outputs["loss"]),
            "empty": bool(batch["is_empty"]),
            "step_loss_tokens": int(batch["step_loss_tokens"]),
        }
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")


def make_datamodule(num_workers: int = 1) -> RecordingStreamModule:
    """The streaming DataModule of the run (packing, best fit over each window)."""
    return RecordingStreamModule(
        source=GeneratorStream(samples, vocab_size=VOCAB),
        window=BUFFER,
        max_tokens=MAX_TOKENS,
        algorithm="best_fit_decreasing",
        num_workers=num_workers,
        stream_split="rank",  # each rank reads its own share, in lock step
    )


def main() -> None:
    args = parse_args(default_workers=2)
    fit(args, StreamTrainedLog(args.out), make_datamodule(args.num_workers))


if __name__ == "__main__":
    main()
