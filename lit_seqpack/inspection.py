"""Compare every batching mode and packing algorithm on one dataset's lengths, without training.

This is the engine of ``lit-seqpack inspect``: :func:`compare_plans` plans one epoch with each packing
algorithm, dynamic batching and the padded baseline (same budget, same layout), :func:`format_table` renders
the figures and :func:`plot_inspection` draws the length histogram and the fill of every microbatch::

    mode     algorithm                   microbatches  empty  steps  padding  efficiency  imbalance  plan ms
    packing  concatenative                      2,292      0  2,292    0.31%      0.9474  1.00/1.00      4.5
    packing  first_fit_decreasing    *          2,173      0  2,173    0.04%      0.9993  1.00/1.00      4.3
    ...
    dynamic  -                                  2,381      0  2,381    3.90%      0.9120  1.00/1.00      2.9
    padded   - (batch_size=13)                  2,262      0  2,262   59.48%      0.1477  1.00/1.00      1.3

Pure Python + numpy like :mod:`lit_seqpack.planning` (matplotlib is imported only by :func:`plot_inspection`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lit_seqpack._checks import check_optional_int, round_up
from lit_seqpack._imports import require
from lit_seqpack.planning import algorithms
from lit_seqpack.planning.plan import Plan, PlanConfig, PlanStats, as_counts, build_plan

__all__ = [
    "LOSS_MARKS",
    "PlanComparison",
    "compare_plans",
    "default_padded_batch_size",
    "format_microbatch",
    "format_table",
    "plot_inspection",
]

_WARMUP_SAMPLES = 256  # a small first plan compiles the numba kernels, so the timed plan measures planning only


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanComparison:
    """One row of the comparison: a mode (and algorithm), its epoch figures and how long planning took.

    Args:
        config: the plan configuration of this row.
        stats: the plan's :class:`~lit_seqpack.planning.PlanStats`.
        seconds: wall time of :func:`~lit_seqpack.planning.build_plan` (after a warm-up plan).
        fills: real tokens of every microbatch over the row's budget (``max_tokens``; padded: the largest
            microbatch), all ranks, empty fillers as 0; the mean is ``stats.utilization``.
        configured: whether this row is the mode (and algorithm) the configuration selects.
    """

    config: PlanConfig
    stats: PlanStats
    seconds: float
    fills: np.ndarray
    configured: bool = False

    @property
    def label(self) -> str:
        """``algorithm`` for packing rows, ``batch_size=B`` for the padded row, ``-`` for dynamic."""
        if self.config.mode == "packing":
            return str(self.config.algorithm)
        if self.config.mode == "padded":
            return f"- (batch_size={self.config.batch_size})"
        return "-"


def default_padded_batch_size(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> int:
    """Samples per padded microbatch carrying, on average, as many real tokens as a ``max_tokens`` budget.

    Example:
        >>> default_padded_batch_size([100, 300, 200], max_tokens=1000)
        5
    """
    lengths = as_counts("lengths", lengths)
    mean = float(lengths.mean()) if lengths.size else 1.0
    return max(1, int(max_tokens // max(mean, 1.0)))


def _variants(base: PlanConfig, padded_batch_size: int) -> list[PlanConfig]:
    """Every packing algorithm, dynamic and padded, from a packing ``base`` without an algorithm."""
    rows = [dataclasses.replace(base, algorithm=a) for a in algorithms.ALGORITHMS]
    rows.append(dataclasses.replace(base, mode="dynamic"))
    rows.append(dataclasses.replace(base, mode="padded", max_tokens=None, batch_size=padded_batch_size))
    return rows


def _fills(plan: Plan, lengths: np.ndarray) -> np.ndarray:
    """Real tokens of every microbatch (all ranks) over the row's budget."""
    config, real, computed = plan.config, [], []
    for rank in range(config.world_size):
        for indices in plan.rank_microbatches(rank):
            block = lengths[indices]
            real.append(int(block.sum()))
            if config.mode == "packing":
                computed.append(round_up(int(block.sum()), config.sequence_length_round))
            else:
                computed.append(block.size * round_up(int(block.max(initial=0)), config.sequence_length_round))
    budget = config.max_tokens or max(computed, default=0)
    return np.asarray(real, dtype=np.float64) / budget if budget else np.zeros(len(real))


def compare_plans(
    lengths: Sequence[int] | np.ndarray,
    config: PlanConfig,
    *,
    loss_tokens: Sequence[int] | np.ndarray | None = None,
    max_tokens: int | None = None,
    padded_batch_size: int | None = None,
    pad_to_multiple_of: int = 1,
    epoch: int = 0,
) -> list[PlanComparison]:
    """Plan one epoch with every packing algorithm, dynamic batching and the padded baseline.

    Args:
        lengths: token count of every sample.
        config: the configured plan; its budget, window, rounding, layout and seed apply to every row.
        loss_tokens: loss tokens per sample (default ``max(length - 1, 0)``).
        max_tokens: the budget of the packing and dynamic rows (default ``config.max_tokens``; required when
            ``config`` is padded).
        padded_batch_size: samples per padded microbatch (default: ``config.batch_size`` in padded mode, else
            :func:`default_padded_batch_size`).
        pad_to_multiple_of: packed rows plan every document padded to a multiple of this, like
            ``SeqPackDataModule``'s setting of the same name.
        epoch: the epoch to plan.

    Returns:
        One packing row per record of :data:`~lit_seqpack.planning.algorithms.ALGORITHMS` (in its order), then
            dynamic, then padded.

    Raises:
        ValueError: no ``max_tokens``, or a bad ``padded_batch_size`` / ``pad_to_multiple_of`` (named).
    """
    lengths = as_counts("lengths", lengths)
    max_tokens = config.max_tokens if max_tokens is None else max_tokens
    if max_tokens is None:
        raise ValueError("max_tokens is None: the comparison needs the token budget of packing and dynamic batching")
    check_optional_int("padded_batch_size", padded_batch_size, minimum=1)
    check_optional_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
    if padded_batch_size is None:
        padded_batch_size = config.batch_size or default_padded_batch_size(lengths, max_tokens)
    base = dataclasses.replace(config, mode="packing", max_tokens=max_tokens, algorithm=None, batch_size=None)
    packed_lengths = (lengths + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
    return [
        _compare_one(variant, packed_lengths if variant.mode == "packing" else lengths, loss_tokens, config, epoch)
        for variant in _variants(base, padded_batch_size)
    ]


def _compare_one(
    variant: PlanConfig,
    lengths: np.ndarray,
    loss_tokens: Sequence[int] | np.ndarray | None,
    configured: PlanConfig,
    epoch: int,
) -> PlanComparison:
    """Plan ``variant`` (timed after a warm-up on a few samples) and collect its row."""
    build_plan(lengths[:_WARMUP_SAMPLES], variant, epoch=epoch)
    start = time.perf_counter()
    plan = build_plan(lengths, variant, epoch=epoch, loss_tokens=loss_tokens)
    seconds = time.perf_counter() - start
    same_algorithm = variant.algorithm == algorithms.packing_algorithm(configured.algorithm).name
    return PlanComparison(
        config=variant,
        stats=plan.stats,
        seconds=seconds,
        fills=_fills(plan, lengths),
        configured=variant.mode == configured.mode and (variant.mode != "packing" or same_algorithm),
    )


_COLUMNS = ("mode", "algorithm", "", "microbatches", "empty", "steps", "padding", "efficiency", "imbalance", "plan ms")


def format_table(rows: Sequence[PlanComparison]) -> str:
    """A fixed-width text table of the rows; ``*`` marks the configured mode.

    Columns: microbatches over all ranks, empty lock-step fillers, optimizer steps, padding ratio
    (``1 - real / computed tokens``), efficiency (``real tokens / (microbatches x budget)``), rank imbalance
    (mean / worst step of max over mean real tokens per rank) and planning time.
    """
    body = [
        (
            row.config.mode,
            row.label,
            "*" if row.configured else "",
            f"{row.stats.num_microbatches:,}",
            f"{row.stats.num_empty_microbatches:,}",
            f"{row.stats.num_steps:,}",
            f"{row.stats.padding_ratio:.2%}",
            f"{row.stats.utilization:.4f}",
            f"{row.stats.imbalance_mean:.2f}/{row.stats.imbalance_max:.2f}",
            f"{row.seconds * 1e3:.1f}",
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [_COLUMNS, *body]) for i in range(len(_COLUMNS))]
    lines = []
    for cells in [_COLUMNS, *body]:
        left = [c.ljust(w) for c, w in zip(cells[:3], widths[:3], strict=True)]
        right = [c.rjust(w) for c, w in zip(cells[3:], widths[3:], strict=True)]
        lines.append("  ".join(left + right).rstrip())
    return "\n".join(lines)


def _length_bins(lengths: np.ndarray, target: int = 60) -> np.ndarray:
    """Histogram edges on whole multiples of the lengths' common divisor (no empty stripes between bins)."""
    step = max(int(np.gcd.reduce(lengths)) if lengths.size else 1, 1)
    low, high = (int(lengths.min()), int(lengths.max())) if lengths.size else (0, 1)
    width = step * max(1, -(-(high - low + 1) // (target * step)))
    return np.arange(low - step / 2, high + width, width)


def _draw_lengths(axes: Any, lengths: np.ndarray, budget: int | None) -> None:
    """The length histogram, with the median and the token budget."""
    axes.hist(lengths, bins=_length_bins(lengths), color="tab:blue", alpha=0.8)
    if budget:
        axes.axvline(budget, color="tab:red", linestyle="--", label=f"max_tokens = {budget}")
    median = float(np.median(lengths))
    axes.axvline(median, color="black", linestyle=":", label=f"median = {median:g}")
    axes.set(xlabel="sample length (tokens)", ylabel="samples", title=f"lengths of {lengths.size:,} samples")
    axes.legend()


def _draw_fills(axes: Any, rows: Sequence[PlanComparison]) -> None:
    """Every row's microbatch fills, fullest first, on a common 0..1 axis (the configured row in bold)."""
    for row in rows:
        values = np.sort(row.fills)[::-1]
        x = np.linspace(0.0, 1.0, values.size) if values.size > 1 else np.zeros(values.size)
        label = f"packing {row.label}" if row.config.mode == "packing" else row.config.mode
        if row.config.mode == "padded":
            label += f" B={row.config.batch_size}, budget: its largest microbatch"
        width = 2.5 if row.configured else 1.2
        style = "-" if row.config.mode == "packing" else "--"
        axes.plot(x, values, style, linewidth=width, label=f"{label} ({row.stats.utilization:.3f})")
    axes.set(
        xlabel="microbatches, fullest first (fraction of the epoch)",
        ylabel="real tokens / budget",
        ylim=(0, 1.05),
        title="bin fill (efficiency in brackets; bold: configured)",
    )
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(0.0, 0.55))


def plot_inspection(
    rows: Sequence[PlanComparison], lengths: Sequence[int] | np.ndarray, path: str | Path, *, title: str = ""
) -> Path:
    """Save a PNG: the length histogram (with ``max_tokens``) and the sorted fill of every row's microbatches.

    Args:
        rows: the output of :func:`compare_plans`.
        lengths: the lengths the rows were planned on.
        path: the image file to write (its suffix picks the format).
        title: a title above both panels.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    figure_type = require("matplotlib.figure", purpose="plotting").Figure
    lengths = as_counts("lengths", lengths)
    figure = figure_type(figsize=(12, 4.8), layout="constrained")
    hist, fill = figure.subplots(1, 2)
    _draw_lengths(hist, lengths, next((row.config.max_tokens for row in rows if row.config.max_tokens), None))
    _draw_fills(fill, rows)
    if title:
        figure.suptitle(title)
    path = Path(path)
    figure.savefig(path, dpi=110)
    return path


LOSS_MARKS = ("[[", "]]")
"""How :func:`format_microbatch` marks the tokens that carry loss (``labels != -100``)."""


def _documents(batch: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every document of a packed row or a padded batch."""
    if batch.get("cu_seqlens") is not None:
        bounds = batch["cu_seqlens"].tolist()
        real = batch.get("cu_seqlens_unpadded")
        sizes = bounds if real is None else real.tolist()
        return [(0, bounds[i], sizes[i + 1] - sizes[i]) for i in range(int(batch["num_documents"]))]
    lengths = batch["attention_mask"].sum(-1).tolist()
    return [(row, 0, int(n)) for row, n in enumerate(lengths) if not batch.get("is_empty", False)]


def format_microbatch(batch: dict[str, Any], *, decode: Any = None, number: int = 0) -> str:
    """One microbatch as text: a header, then each document decoded, its loss tokens between ``[[`` and ``]]``.

    A token carries loss when its label is not ``-100`` (it is trained to be predicted from the tokens before it):
    ``[[`` opens before the first such token of a run and ``]]`` closes after its last, so a prompt-masked sample
    reads ``prompt [[answer]]``. Newlines are shown as ``\\n``.

    Args:
        batch: a collated microbatch of the batch contract (packed or padded).
        decode: turns a list of token ids into text (a tokenizer's ``decode``); ``None``: the ids themselves.
        number: the microbatch's position, for the header.

    Example:
        >>> import torch
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> batch = PackedCollator()([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [9, 4]}])
        >>> print(format_microbatch(batch))
        microbatch 0: packed row of 6 tokens, 2 documents, 6 real / 0 padding tokens, 3 loss tokens
          document 0 (4 tokens, 2 loss): 5 6 [[7 8]]
          document 1 (2 tokens, 1 loss): 9 [[4]]
    """
    kind = (
        "packed row of"
        if batch.get("cu_seqlens") is not None
        else "padded batch {}x{} =".format(*batch["input_ids"].shape)
    )
    lines = [
        f"microbatch {number}: {kind} {batch['input_ids'].numel()} tokens, {batch['num_documents']} documents, "
        f"{batch['num_real_tokens']} real / {batch['num_padding_tokens']} padding tokens, "
        f"{batch['num_loss_tokens']} loss tokens" + (" (a lock-step filler)" if batch.get("is_empty") else "")
    ]
    ids, labels = batch["input_ids"], batch["labels"]
    for doc, (row, start, length) in enumerate(_documents(batch)):
        tokens = ids[row, start : start + length].tolist()
        loss = (labels[row, start : start + length] != -100).tolist()
        pieces = []
        position = 0
        while position < length:  # runs of tokens with and without loss
            end = position
            while end < length and loss[end] == loss[position]:
                end += 1
            run = tokens[position:end]
            text = decode(run) if decode is not None else " ".join(map(str, run))
            text = text.replace("\n", "\\n")
            pieces.append(f"{LOSS_MARKS[0]}{text}{LOSS_MARKS[1]}" if loss[position] else text)
            position = end
        separator = "" if decode is not None else " "
        lines.append(f"  document {doc} ({length} tokens, {sum(loss)} loss): {separator.join(pieces)}")
    return "\n".join(lines)
