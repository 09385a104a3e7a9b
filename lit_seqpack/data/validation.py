"""One validation of the samples at setup, for every source, with the collators' rules.

The collators refuse bad samples too, but only when a microbatch holding one is built, mid-epoch, naming its
position in the microbatch. :func:`scan_dataset` checks every sample once before training and names its dataset
index (the file and line or row where there is one):

- ``input_ids``: a non-empty flat list of ints ``>= 0``; no bool (``True`` is not token 1), no ``None``;
- ``labels`` (ids ``>= 0`` or -100) or ``loss_mask`` (0/1), the same length as ``input_ids``, never ``None``;
- the lengths and loss tokens a dataset offers (``dataset.lengths``) agree with its samples;
- every id (``input_ids``, ``labels`` and ``pad_token_id``) is below the model's vocabulary when it is known.

Cost: pre-tokenised data (:class:`~lit_seqpack.data.sources.TokenizedDataset`, which every file reader and
``TextDataset`` build) was validated row by row, vectorised, when it was read; here it costs one ``max`` over
the token buffer (about 0.1 s for 100M tokens). The synthetic task is valid by construction (nothing is read).
Any other map-style dataset is read once, sample by sample (about 10 us a sample of 100 Python ints: 10 s per
million samples), which also gives its lengths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_seqpack.data.labels import IGNORE_INDEX

__all__ = ["DataScan", "check_vocab_range", "model_vocab_size", "scan_dataset"]


@dataclass(frozen=True, slots=True)
class DataScan:
    """What one validation pass learnt about a dataset.

    Args:
        lengths: token count of every sample.
        loss_tokens: loss tokens of every sample.
        max_id: the largest id of ``input_ids`` and ``labels`` (-1 for no id).
        max_where: where that id is (``"dataset[3]"`` or a file and line), for messages.
    """

    lengths: np.ndarray
    loss_tokens: np.ndarray
    max_id: int
    max_where: str


def scan_dataset(dataset: Sequence[Mapping[str, Any]]) -> DataScan:
    """Validate every sample of ``dataset`` (vectorised where the source is columnar) and return its facts.

    Raises:
        ValueError: the first bad sample, naming its dataset index and the rule it breaks; or ``lengths`` /
            ``loss_tokens`` attributes that disagree with the samples.
    """
    from lit_seqpack.data.sources import TokenizedDataset
    from lit_seqpack.data.synthetic import SyntheticInstructionDataset

    if isinstance(dataset, TokenizedDataset):
        return _scan_columnar(dataset)
    if isinstance(dataset, SyntheticInstructionDataset):
        return DataScan(
            np.asarray(dataset.lengths, dtype=np.int64),
            np.asarray(dataset.loss_tokens, dtype=np.int64),
            dataset.config.vocab_size - 1,
            f"the synthetic task (vocab_size={dataset.config.vocab_size})",
        )
    return _scan_samples(dataset)


def _scan_columnar(dataset: Any) -> DataScan:
    tokens, labels = dataset.tokens, dataset.labels
    top = int(tokens.max())
    where_flat, kind = int(np.argmax(tokens)), "input_ids"
    if labels is not None and labels.size and int(labels.max()) > top:
        top, where_flat, kind = int(labels.max()), int(np.argmax(labels)), "labels"
    row = int(np.searchsorted(dataset.offsets, where_flat, side="right") - 1)
    return DataScan(
        np.asarray(dataset.lengths, dtype=np.int64),
        np.asarray(dataset.loss_tokens, dtype=np.int64),
        top,
        f"{dataset.source}, sample {row} ({kind})",
    )


def _scan_samples(dataset: Sequence[Mapping[str, Any]]) -> DataScan:
    from lit_seqpack.data.sources import validate_record

    size = len(dataset)
    lengths = np.empty(size, dtype=np.int64)
    loss_tokens = np.empty(size, dtype=np.int64)
    top, top_at = -1, 0
    for i in range(size):
        sample = dataset[i]
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            raise TypeError(f"dataset[{i}] must be a mapping with 'input_ids', got {type(sample).__name__}")
        ids, labels = validate_record(sample, f"dataset[{i}]")
        lengths[i] = len(ids)
        if labels is None:
            loss_tokens[i], high = len(ids) - 1, int(ids.max())
        else:
            loss_tokens[i] = int((labels[1:] != IGNORE_INDEX).sum())
            high = max(int(ids.max()), int(labels.max()))
        if high > top:
            top, top_at = high, i
    for name, scanned in (("lengths", lengths), ("loss_tokens", loss_tokens)):
        _check_offered(dataset, name, scanned)
    return DataScan(lengths, loss_tokens, top, f"dataset[{top_at}]")


def _check_offered(dataset: Any, name: str, scanned: np.ndarray) -> None:
    """A ``lengths`` / ``loss_tokens`` attribute must agree with the samples (the planner trusts it)."""
    offered = getattr(dataset, name, None)
    if offered is None or callable(offered):
        return
    offered = np.asarray(offered, dtype=np.int64)
    if offered.shape != scanned.shape:
        raise ValueError(f"dataset.{name} has shape {offered.shape} but the dataset has {len(scanned)} samples")
    wrong = np.flatnonzero(offered != scanned)
    if wrong.size:
        i = int(wrong[0])
        raise ValueError(
            f"dataset.{name}[{i}] = {int(offered[i])} but dataset[{i}] has {int(scanned[i])} ({wrong.size} samples "
            f"disagree): the planner would pack by the wrong {name}; fix the dataset's {name} attribute"
        )


def check_vocab_range(scan: DataScan, *, vocab_size: int | None, pad_token_id: int, owner: str = "model") -> None:
    """Fail when a data id or the pad id is outside a known vocabulary (``None``: nothing to check).

    Args:
        scan: the data's facts from :func:`scan_dataset`.
        vocab_size: the number of ids the model embeds.
        pad_token_id: the id written on padding positions (it reaches the embedding too).
        owner: who has that vocabulary, for the message.

    Raises:
        ValueError: naming the id, where it is, the vocabulary size and the setting to change.
    """
    if vocab_size is None:
        return
    if pad_token_id >= vocab_size:
        raise ValueError(
            f"pad_token_id={pad_token_id} is >= the {owner}'s vocab_size={vocab_size}: padding would index past "
            f"the embedding. Set data.pad_token_id below {vocab_size} or raise the {owner}'s vocab_size"
        )
    if scan.max_id >= vocab_size:
        raise ValueError(
            f"token id {scan.max_id} ({scan.max_where}) is >= the {owner}'s vocab_size={vocab_size}: it would index "
            f"past the embedding. Raise the {owner}'s vocab_size to at least {scan.max_id + 1} (for ReferenceLM: "
            "model.init_args.vocab_size; for HFCausalLM: model.init_args.config.vocab_size) or fix the data"
        )


def model_vocab_size(model: Any) -> int | None:
    """The number of token ids ``model`` can embed, or ``None`` when it does not say.

    Looked up, in order: the ``config.vocab_size`` of the wrapped network ``model.model`` (the reference decoder
    and transformers models both have one), then the hyperparameter ``vocab_size``, then the ``vocab_size`` of a
    ``config`` hyperparameter (:class:`~lit_seqpack.model.lm.HFCausalLM` built from a config dict).
    """
    inner_config = getattr(getattr(model, "model", None), "config", None)
    value = getattr(inner_config, "vocab_size", None)
    hparams = getattr(model, "hparams", None) or {}
    if value is None:
        value = hparams.get("vocab_size")
    if value is None and isinstance(hparams.get("config"), Mapping):
        value = hparams["config"].get("vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
