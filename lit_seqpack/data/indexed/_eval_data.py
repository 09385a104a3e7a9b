"""Evaluation data of the DataModule: validation / test files (or ``DatasetDict`` splits) and their token budget.

Validation and test samples come either from the training data (``val_fraction`` / ``test_fraction``, held out by
:func:`~lit_seqpack.data.indexed.splits.split_indices`), from a source of their own (``val_source`` /
``test_source``), or from the training source's own split (a file source's ``val_path`` / ``val_split``). Two ways
for one split at once is an error, and so is evaluating on the very samples that train.

Evaluation has no gradients, so its microbatches may hold more tokens: ``eval_max_tokens`` (default:
``max_tokens``) is the budget the validation and test samplers plan with. Documents keep the training budget
(``max_tokens`` and the over-long policy), so every document evaluated is one the model could have trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lit_seqpack.data.batching._budget import apply_document_budget
from lit_seqpack.data.batching.overlong import OverlongReport
from lit_seqpack.data.indexed.splits import Split
from lit_seqpack.data.indexed.validation import DataScan, check_vocab_range
from lit_seqpack.data.sources.base import IndexedSource, source_splits

__all__ = ["EVAL_SPLITS", "eval_sources", "eval_split"]

EVAL_SPLITS: tuple[str, ...] = ("val", "test")


def eval_sources(
    source: IndexedSource,
    explicit: Mapping[str, IndexedSource | None],
    fractions: Mapping[str, float],
) -> dict[str, tuple[IndexedSource, str]]:
    """Where each evaluation split held in its own data is read from: ``{name: (source, split to load)}``.

    A split comes from ``val_source`` / ``test_source`` (its training samples), or from the training source's own
    ``"val"`` / ``"test"`` split (a file source's ``val_path`` / ``val_split``), or is held out of the training
    samples by ``val_fraction`` / ``test_fraction`` (then it is not listed here). Two ways for one split is an error.

    Args:
        source: the training source.
        explicit: ``val_source`` / ``test_source`` by split name (resolved, or ``None``).
        fractions: ``val_fraction`` / ``test_fraction`` by split name.

    Raises:
        ValueError: naming the settings that choose the same split twice.
    """
    held = source_splits(source)
    chosen = {}
    for name in EVAL_SPLITS:
        ways = []
        if explicit.get(name) is not None:
            ways.append((f"{name}_source", (explicit[name], "train")))
        if name in held:
            ways.append(
                (f"the source's {name} data ({name}_path / {name}_split of {type(source).__name__})", (source, name))
            )
        if fractions.get(name, 0.0):
            ways.append((f"{name}_fraction={fractions[name]}", None))
        if len(ways) > 1:
            raise ValueError(
                f"{' and '.join(way for way, _ in ways)} all choose the {name} samples: set one of them "
                f"({name}_fraction holds samples out of the training data, {name}_source or {name}_path read their own)"
            )
        if ways and ways[0][1] is not None:
            chosen[name] = ways[0][1]
    return chosen


def eval_split(
    dataset: Sequence[Mapping[str, Any]],
    scan: DataScan,
    *,
    name: str,
    model_vocab: int | None,
    pad_token_id: int,
    **budget_kwargs: Any,
) -> tuple[Split, OverlongReport | None]:
    """One evaluation file as a :class:`~lit_seqpack.data.indexed.splits.Split`, under the training document budget.

    Args:
        dataset: the evaluation dataset.
        scan: its validation pass (lengths, loss tokens, largest id).
        name: ``"val"`` or ``"test"``, for messages.
        model_vocab: the model's vocabulary, when known.
        pad_token_id: the padding id.
        **budget_kwargs: the settings of :func:`~lit_seqpack.data.batching._budget.apply_document_budget`
            (``max_tokens``
            ``None`` in padded mode without a cap: no policy).

    Raises:
        ValueError: an empty file, an empty sample, or an id outside the model's vocabulary.
    """
    if len(dataset) == 0:
        raise ValueError(f"the {name} data is empty")
    check_vocab_range(scan, vocab_size=model_vocab, pad_token_id=pad_token_id)
    lengths, loss_tokens = scan.lengths, scan.loss_tokens
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"sample {int(empty[0])} of the {name} data has no token")
    if budget_kwargs.get("max_tokens") is None:
        return Split(dataset, lengths, loss_tokens), None
    try:
        view, lengths, loss_tokens, report = apply_document_budget(dataset, lengths, loss_tokens, **budget_kwargs)
    except ValueError as err:
        raise ValueError(f"the {name} data: {err}") from None
    return Split(view, lengths, loss_tokens), report
