"""Packed ``trainer.predict``: per-sample log-probabilities, in the source's order, every index once over the ranks.

:class:`~lit_seqpack.model.mixin.PackedSequenceMixin`'s ``predict_step`` returns one :class:`SamplePrediction` per
document of a batch (:func:`sample_predictions`), keyed by its index in the predict source (the batch's
``sample_index``, written by ``SeqPackDataModule.predict_dataloader``); lock-step fillers return none.

- one process: :func:`predictions_in_order` sorts what ``trainer.predict`` returned by index (each index once);
- several ranks: :class:`PredictionWriter` (a Lightning ``BasePredictionWriter``) writes each rank's records to its
  own file (JSONL, or Parquet with pyarrow) as they come, and rank 0 merges them into one file in index order at
  the end (:func:`merge_predictions`, which also merges rank files written elsewhere);
- :func:`read_predictions` reads a JSONL or Parquet prediction file back.

A record's ``token_logprobs[t - 1]`` is ``log p(input_ids[t] | input_ids[:t])`` for ``t = 1 .. L - 1`` (empty for a
one-token sample); ``nll`` is minus the sum of ``log p(labels[t])`` over the sample's label positions
(``labels != -100``) and ``num_loss_tokens`` their count, so ``exp(nll / num_loss_tokens)`` is its perplexity.

Example:
    >>> records = [[{"index": 2, "nll": 1.0}], [], [{"index": 0, "nll": 3.0}, {"index": 1, "nll": 2.0}]]
    >>> [r["index"] for r in predictions_in_order(records)]
    [0, 1, 2]
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from lit_seqpack._imports import require
from lit_seqpack.batch import IGNORE_INDEX

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = [
    "PredictionWriter",
    "SamplePrediction",
    "merge_predictions",
    "predictions_in_order",
    "read_predictions",
    "sample_predictions",
]

log = logging.getLogger(__name__)

FORMATS = (".jsonl", ".parquet")
"""The file formats of prediction files, by suffix."""


class SamplePrediction(TypedDict):
    """One sample's prediction record."""

    index: int
    """The sample's index in the predict source."""
    token_logprobs: torch.Tensor
    """Float32 ``[L - 1]``: ``log p(input_ids[t] | input_ids[:t])`` for ``t = 1 .. L - 1`` (on the CPU)."""
    nll: float
    """Minus the summed log-probability of the sample's labels (its label positions only)."""
    num_loss_tokens: int
    """The sample's label positions (``labels != -100`` after its first token)."""


# ------------------------------------------------------------------------------------------------- the records
def _spans(batch: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every document of a packed row or a padded batch (one device read)."""
    cu = batch.get("cu_seqlens")
    if cu is not None:
        real = batch.get("cu_seqlens_unpadded")
        starts = cu.tolist()
        bounds = starts if real is None else real.tolist()
        count = int(batch.get("num_documents", len(starts) - 1))
        return [(0, starts[i], bounds[i + 1] - bounds[i]) for i in range(count)]
    mask = batch.get("attention_mask")
    rows, width = batch["input_ids"].shape
    lengths = [width] * rows if mask is None else mask.sum(-1).tolist()
    return [(row, 0, int(length)) for row, length in enumerate(lengths)]


def sample_predictions(logits: torch.Tensor, batch: Mapping[str, Any]) -> list[SamplePrediction]:
    """One :class:`SamplePrediction` per document of ``batch`` (none for a lock-step filler), on the CPU.

    Each document's log-probabilities are computed in float32 from its own slice of the logits (memory of one
    document's ``[L, V]`` at a time beside the logits), then moved to the CPU in one transfer per batch.

    Args:
        logits: ``[B, T, V]``; ``logits[:, t]`` predicts token ``t + 1``.
        batch: the batch, with ``sample_index`` (``SeqPackDataModule.predict_dataloader`` writes it).

    Raises:
        ValueError: the batch has no ``sample_index`` (not a predict batch), holds another number of documents, or
            is a context-parallel shard.

    Example:
        >>> batch = {"input_ids": torch.tensor([[1, 2, 3, 0]]), "labels": torch.tensor([[-100, 2, 3, -100]]),
        ...          "cu_seqlens": torch.tensor([0, 3, 4]), "num_documents": 2, "sample_index": torch.tensor([7, 4])}
        >>> records = sample_predictions(torch.zeros(1, 4, 4), batch)  # uniform over 4 tokens: log(1/4) each
        >>> [(r["index"], r["token_logprobs"].numel(), round(r["nll"], 4)) for r in records]
        [(7, 2, 2.7726), (4, 0, 0.0)]
    """
    if batch.get("is_empty", False):
        return []
    index = batch.get("sample_index")
    if index is None:
        raise ValueError(
            "predict_step needs the batch's sample_index (each document's index in the predict source), which "
            "SeqPackDataModule.predict_dataloader writes: predict with the DataModule (trainer.predict(model, "
            "datamodule=data)), or wrap your collator in lit_seqpack.data.indexed.planned_sampler.IndexedCollator"
        )
    if batch.get("shift_labels") is not None or int(batch.get("context_parallel_size", 1)) > 1:
        raise ValueError("predict_step does not take context-parallel shards: predict with context_parallel_size=1")
    spans, indices = _spans(batch), index.tolist()
    if len(spans) != len(indices):
        raise ValueError(f"the batch holds {len(spans)} documents but {len(indices)} sample_index entries")
    ids, labels = batch["input_ids"], batch["labels"]
    logprobs, nlls, counts = [], [], []
    for row, start, length in spans:
        piece = logits[row, start : start + length - 1].float()
        norm = piece.logsumexp(-1)
        logprobs.append(piece.gather(-1, ids[row, start + 1 : start + length, None]).squeeze(-1) - norm)
        targets = labels[row, start + 1 : start + length]
        kept = targets != IGNORE_INDEX
        target_lp = piece.gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1) - norm
        nlls.append(0.0 - target_lp.masked_fill(~kept, 0.0).sum())  # 0.0, not -0.0, without label
        counts.append(kept.sum())
    flat = torch.cat(logprobs).detach().cpu()
    nll_values, count_values = torch.stack(nlls).tolist(), torch.stack(counts).tolist()
    pieces = flat.split([max(length - 1, 0) for _, _, length in spans])
    return [
        SamplePrediction(index=int(i), token_logprobs=lp, nll=float(n), num_loss_tokens=int(c))
        for i, lp, n, c in zip(indices, pieces, nll_values, count_values, strict=True)
    ]


def _records(predictions: Any) -> Iterator[Mapping[str, Any]]:
    if predictions is None:
        return
    if isinstance(predictions, Mapping):
        if "index" not in predictions:
            raise ValueError(f"a prediction record needs an 'index', got the keys {sorted(predictions)}")
        yield predictions
        return
    if not isinstance(predictions, (list, tuple)):
        raise TypeError(f"predictions must be (nested lists of) records, got {type(predictions).__name__}")
    for item in predictions:
        yield from _records(item)


def predictions_in_order(predictions: Any) -> list[Mapping[str, Any]]:
    """What ``trainer.predict`` returned (nested lists of records, per batch and per loader), sorted by ``index``.

    One process's records only: on several ranks each holds its own share; write them with
    :class:`PredictionWriter` (merged over ranks).

    Raises:
        ValueError: an index appears twice, or a record has none.
    """
    ordered = sorted(_records(predictions), key=lambda record: int(record["index"]))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if int(before["index"]) == int(after["index"]):
            raise ValueError(f"sample index {int(after['index'])} was predicted twice")
    return ordered


# ------------------------------------------------------------------------------------------------- files
def _plain(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record with tensors as lists (JSON and Parquet hold no tensors)."""
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in record.items()}


def _format(path: Path) -> str:
    if path.suffix not in FORMATS:
        raise ValueError(f"a prediction file must end in {' or '.join(FORMATS)}, got {str(path)!r}")
    if path.suffix == ".parquet":
        _parquet()
    return path.suffix


def _parquet() -> Any:
    """``pyarrow.parquet``, or an ImportError naming the extra to install."""
    return require("pyarrow.parquet", purpose="Parquet prediction files")


def _write(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    rows = [_plain(r) for r in records]
    if _format(path) == ".parquet":
        pa = require("pyarrow", purpose="Parquet prediction files")
        _parquet().write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
    return len(rows)


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL or Parquet prediction file, as written (``token_logprobs`` as lists).

    Raises:
        ValueError: another suffix than ``.jsonl`` / ``.parquet``, or a JSONL line that is not JSON (file:line).
    """
    path = Path(path)
    if _format(path) == ".parquet":
        return _parquet().read_table(path).to_pylist()
    records = []
    with path.open() as file:
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not a JSON record ({err})") from None
    return records


def merge_predictions(parts: Sequence[str | Path], output: str | Path) -> int:
    """Merge per-rank prediction files into one file sorted by ``index``; return the number of records.

    Args:
        parts: the rank files (JSONL or Parquet, mixed as they come).
        output: the merged file (``.jsonl`` or ``.parquet``).

    Raises:
        ValueError: an index appears twice (in one file or across files: named with both files).
    """
    output = Path(output)
    _format(output)
    seen: dict[int, Path] = {}
    records = []
    for part in map(Path, parts):
        for record in read_predictions(part):
            index = int(record["index"])
            if index in seen:
                raise ValueError(f"sample index {index} is in {seen[index]} and in {part}: predicted twice")
            seen[index] = part
            records.append(record)
    records.sort(key=lambda record: int(record["index"]))
    output.parent.mkdir(parents=True, exist_ok=True)
    return _write(output, records)


# ------------------------------------------------------------------------------------------------- the writer
class PredictionWriter(BasePredictionWriter):
    """Writes every rank's prediction records to its own file, then rank 0 merges them into ``output`` in index order.

    Rank ``r`` writes ``<output stem>.rank<r><suffix>`` beside ``output`` (JSONL line by line as batches come;
    Parquet at the end of the pass); after every rank finished (a barrier), rank 0 merges them with
    :func:`merge_predictions` and removes them unless ``keep_rank_files``. Run ``trainer.predict(...,
    return_predictions=False)`` so the records are not also held in memory.

    Args:
        output: the merged file, ``.jsonl`` or ``.parquet`` (pyarrow).
        keep_rank_files: keep the per-rank files after the merge.

    Example::

        trainer = L.Trainer(callbacks=[PredictionWriter("scores.jsonl")], use_distributed_sampler=False)
        trainer.predict(model, datamodule=data, return_predictions=False)
    """

    def __init__(self, output: str | Path, *, keep_rank_files: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output = Path(output)
        self.suffix = _format(self.output)
        self.keep_rank_files = keep_rank_files
        self._file: Any = None
        self._buffer: list[dict[str, Any]] = []
        self.written = 0
        """Records this rank wrote in the last pass."""
        self.merged: int | None = None
        """Records merged into ``output`` (rank 0, after the pass; ``None`` elsewhere)."""

    def rank_file(self, rank: int) -> Path:
        """The file rank ``rank`` writes."""
        return self.output.with_name(f"{self.output.stem}.rank{rank}{self.suffix}")

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self._buffer, self.written = [], 0
        if self.suffix == ".jsonl":
            self._file = self.rank_file(trainer.global_rank).open("w")

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        records = [_plain(record) for record in _records(prediction)]
        self.written += len(records)
        if self._file is not None:
            self._file.writelines(json.dumps(record) + "\n" for record in records)
        else:
            self._buffer.extend(records)

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_predict_epoch_end(trainer, pl_module)
        if self._file is not None:
            self._file.close()
            self._file = None
        else:
            _write(self.rank_file(trainer.global_rank), self._buffer)
            self._buffer = []

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.barrier("lit_seqpack.PredictionWriter")
        if trainer.global_rank == 0:
            parts = [self.rank_file(rank) for rank in range(trainer.world_size)]
            self.merged = merge_predictions(parts, self.output)
            if not self.keep_rank_files:
                for part in parts:
                    part.unlink()
            log.info("lit_seqpack: wrote %d predictions to %s", self.merged, self.output)
        trainer.strategy.barrier("lit_seqpack.PredictionWriter.merged")
