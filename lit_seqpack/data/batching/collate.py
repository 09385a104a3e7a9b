"""Collation of a microbatch of samples into the batch contract (packed rows or padded ``[B, L]`` batches).

A sample is a mapping with ``input_ids`` (a list or 1-D tensor of non-negative ints) and optionally either
``labels`` (same length, ``-100`` masks a position, e.g. prompt tokens) or ``loss_mask`` (same length, 1 = train on
the token, 0 = do not); extra per-token and per-sample fields travel when declared (``token_fields``,
``sample_fields``, see :mod:`lit_seqpack.data.batching.fields`), and any other key is reported once. Labels are not
shifted: models shift them by one (Hugging Face convention), so the collators put ``-100`` on the first token of
every document, which has no previous token to be predicted from, and on every padding position. The counts the
loss and the metrics need travel as Python scalars (never tensors, so reading them costs no device sync); the
plan's facts come from the :class:`~lit_seqpack.batch.MicrobatchMeta` that
:class:`~lit_seqpack.data.PlannedDataset` attaches to the list of samples.

What the collators do with declared fields and loss weights (shared by the packed and padded collator).

The collators are frozen dataclasses with ``token_fields``, ``sample_fields``, ``loss_weight_field`` and a private
``_reported`` set; these helpers read those settings (see :mod:`lit_seqpack.data.batching.fields` and
:mod:`lit_seqpack.data.batching.loss_weights`).

The collators' checks of a microbatch against its plan: each sample's length, the token budget, the loss tokens.

The plan was made from lengths and loss tokens computed before training (a scan, a lengths cache, or arrays the
dataset declares). A sample read later with another length (a dataset whose samples change between epochs, a file
re-tokenised behind the same object, a stale cache) would pack rows far above ``max_tokens`` and be trained under
the wrong loss normaliser without an error: on a GPU an out-of-memory or ``max_seq_len`` error far from its cause.
Each check is one comparison per microbatch; a failure names the sample by its dataset index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lit_seqpack._checks import check_int, check_optional_int, round_up
from lit_seqpack.batch import IGNORE_INDEX, MicrobatchMeta
from lit_seqpack.data.batching._samples import read_samples, sample_name, sample_names
from lit_seqpack.data.batching.fields import (
    FieldValues,
    check_fields,
    empty_fields,
    pad_token_field,
    read_fields,
    scatter_tokens,
)
from lit_seqpack.data.batching.loss_weights import (
    check_loss_weight_field,
    loss_weight_scalars,
    read_loss_weights,
)

__all__ = [
    "IGNORE_INDEX",
    "PackedCollator",
    "PaddedCollator",
    "declare_fields",
    "empty_collator_fields",
    "read_collator_fields",
    "token_pads",
    "weight_scalars",
    "check_planned_budget",
    "check_planned_lengths",
    "check_planned_loss_tokens",
]


def declare_fields(collator: Any) -> None:
    """Validate and normalise a collator's ``token_fields`` / ``sample_fields`` (frozen, so via ``object``)."""
    tokens, samples = check_fields(collator.token_fields, collator.sample_fields)
    check_loss_weight_field(collator.loss_weight_field, tokens)
    object.__setattr__(collator, "token_fields", tokens)
    object.__setattr__(collator, "sample_fields", samples)


def read_collator_fields(
    collator: Any, samples: Sequence[Mapping[str, Any]], docs: Sequence[np.ndarray], labels: torch.Tensor
) -> FieldValues:
    """The declared fields of the samples, plus their ``loss_weights`` when a ``loss_weight_field`` is set."""
    names = sample_names(samples)
    fields = read_fields(samples, docs, names, collator.token_fields, collator.sample_fields, collator._reported)
    if collator.loss_weight_field is not None:
        per_doc = labels.split([len(d) for d in docs])
        fields.tokens["loss_weights"] = read_loss_weights(samples, per_doc, collator.loss_weight_field, names)
    return fields


def token_pads(collator: Any) -> dict[str, float | int]:
    """Pad value of every per-token field the collator places (the declared ones and ``loss_weights``)."""
    return collator.token_fields | ({"loss_weights": 0.0} if collator.loss_weight_field is not None else {})


def weight_scalars(collator: Any, batch: dict[str, Any], meta: Any, stats: dict[str, Any]) -> dict[str, Any]:
    if collator.loss_weight_field is None:
        return {}
    return loss_weight_scalars(batch["loss_weights"], meta, stats["step_loss_tokens"], stats["is_empty"])


def empty_collator_fields(collator: Any) -> FieldValues:
    fields = empty_fields(collator.token_fields, collator.sample_fields)
    if collator.loss_weight_field is not None:
        fields.tokens["loss_weights"] = []
    return fields


def _scalars(
    meta: MicrobatchMeta | None, *, documents: int, real: int, total: int, loss: int, is_empty: bool
) -> dict[str, Any]:
    """The batch contract's Python scalars; the plan's facts come from ``meta`` when there is one."""
    check_planned_loss_tokens(meta, loss, is_empty)
    return {
        "num_documents": documents,
        "num_real_tokens": real,
        "num_padding_tokens": total - real,
        "num_loss_tokens": loss,
        "step_loss_tokens": loss if meta is None else meta.step_loss_tokens,
        "world_size": 1 if meta is None else meta.world_size,
        "accumulate_grad_batches": 1 if meta is None else meta.accumulate_grad_batches,
        "max_tokens": None if meta is None else meta.max_tokens,
        "is_empty": is_empty,
    }


def _is_empty(samples: Sequence[Any], meta: MicrobatchMeta | None) -> bool:
    if meta is not None and meta.is_empty and len(samples) > 0:
        raise ValueError(f"meta.is_empty is True but the microbatch holds {len(samples)} samples")
    return len(samples) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedCollator:
    """Concatenates a microbatch's documents into one packed row (``B == 1``) for varlen attention.

    Docs of 3, 5 and 2 tokens with ``pad_to_multiple_of=4`` (``-`` is ``-100``, ``p`` the pad token)::

        docs          a a a b b b b b c c p p      the padding tail is a segment of its own
        input_ids     a a a b b b b b c c p p
        labels        - a a - b b b b - c - -      -100 at each document's first token and on padding
        position_ids  0 1 2 0 1 2 3 4 0 1 0 1      restart per document and for the tail
        cu_seqlens    0     3         8   10  12   int32, cu_seqlens[-1] == T;  max_seqlen = 5

    With ``pad_document_to_multiple_of=4`` (context parallelism splits every document into equal chunks) each
    document is padded at its end; positions keep counting through that padding and ``cu_seqlens`` holds the
    padded boundaries, while ``cu_seqlens_unpadded`` holds the boundaries of the real tokens as if they were
    packed without padding (Transformer Engine's ``cu_seqlens`` / ``cu_seqlens_padded`` pair)::

        input_ids            a a a p b b b b b p p p c c p p
        labels               - a a - - b b b b - - - - c - -
        position_ids         0 1 2 3 0 1 2 3 4 5 6 7 0 1 2 3
        cu_seqlens           0       4               12      16
        cu_seqlens_unpadded  0 3 8 10                          (real lengths 3, 5, 2)

    Both tensors always have the same number of entries: a padding tail added by ``pad_to_multiple_of`` on top
    appears in ``cu_seqlens_unpadded`` as a segment of length 0.

    A declared token field (``token_fields={"weights": 0.0}``) is placed like ``input_ids``, with its pad value
    on every padding position; a sample field (``sample_fields=["reward"]``) holds one value a document::

        weights       1 1 1 .5 .5 .5 .5 .5 0 0 0 0     [1, T], unshifted (value t belongs to token t)
        reward        [r_a, r_b, r_c]                   [num_documents], in cu_seqlens order

    The output dict holds ``input_ids``, ``labels``, ``position_ids`` (int64 ``[1, T]``), ``cu_seqlens`` (int32
    ``[segments + 1]``), ``max_seqlen`` (int), ``cu_seqlens_unpadded`` when documents are padded, and the
    scalars ``num_documents``, ``num_real_tokens``, ``num_padding_tokens``, ``num_loss_tokens``,
    ``step_loss_tokens``, ``world_size``, ``accumulate_grad_batches``, ``max_tokens``, ``is_empty``. An empty
    microbatch (a lock-step filler) becomes a dummy row of padding with every label ``-100``.

    Args:
        pad_token_id: token id written on padding positions.
        pad_to_multiple_of: round the row length ``T`` up to a multiple of this (e.g. 8 or 64 for kernels).
        pad_document_to_multiple_of: round every document's length up to a multiple of this.
        token_fields: extra per-token fields to carry, each name mapped to its pad value; each arrives as a
            ``[1, T]`` tensor aligned with ``input_ids`` (see :mod:`lit_seqpack.data.batching.fields`).
        sample_fields: extra per-sample fields to carry; each arrives as a ``[num_documents]`` tensor.
        loss_weight_field: ``"loss_mask"`` (its values are weights in ``[0, 1]``) or a declared token field that
            scales each token's loss; the batch then holds ``loss_weights``, ``num_loss_weight`` and
            ``step_loss_weight`` (see :mod:`lit_seqpack.data.batching.loss_weights`).

    Example:
        >>> batch = PackedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> batch["position_ids"].tolist(), batch["cu_seqlens"].tolist(), batch["labels"].tolist()
        ([[0, 1, 2, 0, 1]], [0, 3, 5], [[-100, 6, 7, -100, 9]])
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    pad_document_to_multiple_of: int | None = None
    token_fields: Mapping[str, float | int] | None = None
    sample_fields: Sequence[str] | None = None
    loss_weight_field: str | None = None
    _reported: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("pad_token_id", self.pad_token_id, minimum=0)
        check_optional_int("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        check_optional_int("pad_document_to_multiple_of", self.pad_document_to_multiple_of, minimum=1)
        declare_fields(self)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        meta = getattr(samples, "meta", None)
        if _is_empty(samples, meta):
            length = math.lcm(self.pad_to_multiple_of or 1, self.pad_document_to_multiple_of or 1)
            empty = torch.empty(0, dtype=torch.int64)
            return self._layout([], empty, empty, empty_collator_fields(self), meta, length)
        docs, ids, labels = read_samples(samples, weighted_mask=self.loss_weight_field == "loss_mask")
        multiple = self.pad_document_to_multiple_of or 1
        sizes = [doc.shape[0] for doc in docs]
        check_planned_lengths(samples, sizes, meta, multiple)
        body = sum(-(-size // multiple) * multiple for size in sizes)
        check_planned_budget(samples, docs, round_up(body, self.pad_to_multiple_of), meta)
        return self._layout(docs, ids, labels, read_collator_fields(self, samples, docs, labels), meta, None)

    def _layout(
        self,
        docs: Sequence[np.ndarray],
        ids: torch.Tensor,
        labels: torch.Tensor,
        fields: FieldValues,
        meta: Any,
        dummy: int | None,
    ) -> dict[str, Any]:
        lengths = np.array([d.shape[0] for d in docs], dtype=np.int64)
        multiple = self.pad_document_to_multiple_of
        padded = lengths if multiple is None else -(-lengths // multiple) * multiple
        body = int(padded.sum())
        total = dummy if dummy is not None else round_up(body, self.pad_to_multiple_of)
        segments = np.append(padded, total - body) if total > body else padded
        cu_seqlens = np.concatenate([[0], np.cumsum(segments)])
        where: slice | np.ndarray = slice(0, body)
        if self.pad_document_to_multiple_of is not None:  # scatter each document to its padded start
            real_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(docs) else lengths
            where = np.arange(len(ids)) + np.repeat(cu_seqlens[: len(docs)] - real_starts, lengths)
        # numpy index arithmetic throughout: torch's repeat_interleave and index_put_ CPU kernels wake every
        # torch thread on each call
        out_labels = scatter_tokens(labels, IGNORE_INDEX, (total,), where)
        out_labels[cu_seqlens[: len(docs)]] = IGNORE_INDEX
        input_ids = torch.from_numpy(scatter_tokens(ids, self.pad_token_id, (total,), where))
        position_ids = torch.from_numpy(np.arange(total) - np.repeat(cu_seqlens[:-1], segments))
        batch = {
            "input_ids": input_ids[None],
            "labels": torch.from_numpy(out_labels)[None],
            "position_ids": position_ids[None],
            "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
            "max_seqlen": int(segments.max()),
        }
        if self.pad_document_to_multiple_of is not None:
            real = np.append(lengths, 0) if len(segments) > len(lengths) else lengths
            batch["cu_seqlens_unpadded"] = torch.from_numpy(np.concatenate([[0], np.cumsum(real)]).astype(np.int32))
        pads = token_pads(self)
        for key, parts in fields.tokens.items():
            batch[key] = pad_token_field(parts, pads[key], (total,), where)[None]
        batch |= fields.samples
        loss = int(np.count_nonzero(out_labels != IGNORE_INDEX))
        stats = _scalars(meta, documents=len(docs), real=len(ids), total=total, loss=loss, is_empty=dummy is not None)
        return batch | stats | weight_scalars(self, batch, meta, stats)


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedCollator:
    """Right-pads a microbatch into ``[B, L]`` rows (dynamic batching or the padded baseline).

    Rows of 3, 5 and 2 tokens with ``pad_to_multiple_of=3`` (``-`` is ``-100``, ``p`` the pad token)::

        input_ids       a a a p p p    labels   - a a - - -    attention_mask  1 1 1 0 0 0
                        b b b b b p             - b b b b -                    1 1 1 1 1 0
                        c c p p p p             - c - - - -                    1 1 0 0 0 0
        position_ids    0 1 2 3 4 5 in every row (padding positions keep counting)

    The output dict holds ``input_ids``, ``labels``, ``attention_mask`` and ``position_ids`` (int64 ``[B, L]``,
    no ``cu_seqlens``) and the same scalars as :class:`PackedCollator` (``num_padding_tokens = B * L -
    num_real_tokens``). An empty microbatch becomes one dummy row of padding with every label ``-100``; its
    ``attention_mask`` is all ones so that no attention row is fully masked (which makes SDPA return NaN).

    Args:
        pad_token_id: token id written on padding positions.
        pad_to_multiple_of: round ``L`` up to a multiple of this (the plan's ``sequence_length_round``).
        token_fields: extra per-token fields to carry, each name mapped to its pad value; each arrives as a
            ``[B, L]`` tensor aligned with ``input_ids`` (see :mod:`lit_seqpack.data.batching.fields`).
        sample_fields: extra per-sample fields to carry; each arrives as a ``[B]`` tensor (one value a row).
        loss_weight_field: ``"loss_mask"`` or a declared token field holding per-token loss weights (as for
            :class:`PackedCollator`).

    Example:
        >>> batch = PaddedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]])
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    token_fields: Mapping[str, float | int] | None = None
    sample_fields: Sequence[str] | None = None
    loss_weight_field: str | None = None
    _reported: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("pad_token_id", self.pad_token_id, minimum=0)
        check_optional_int("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        declare_fields(self)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        meta = getattr(samples, "meta", None)
        if _is_empty(samples, meta):
            width = self.pad_to_multiple_of or 1
            input_ids = torch.full((1, width), self.pad_token_id, dtype=torch.int64)
            batch = {
                "input_ids": input_ids,
                "labels": torch.full_like(input_ids, IGNORE_INDEX),
                "attention_mask": torch.ones_like(input_ids),
                "position_ids": torch.arange(width)[None],
            }
            batch |= self._fields(empty_collator_fields(self), (1, width), slice(0, 0))
            stats = _scalars(meta, documents=0, real=0, total=width, loss=0, is_empty=True)
            return batch | stats | weight_scalars(self, batch, meta, stats)
        docs, ids, labels = read_samples(samples, weighted_mask=self.loss_weight_field == "loss_mask")
        sizes = [len(doc) for doc in docs]
        check_planned_lengths(samples, sizes, meta)
        fields = read_collator_fields(self, samples, docs, labels)
        lengths = np.array(sizes, dtype=np.int64)
        rows, width = len(docs), round_up(int(lengths.max()), self.pad_to_multiple_of)
        check_planned_budget(samples, docs, rows * width, meta)
        real = np.arange(width) < lengths[:, None]
        where = real.reshape(-1)  # row-major order matches the concatenation
        out_labels = scatter_tokens(labels, IGNORE_INDEX, (rows, width), where)
        out_labels[:, 0] = IGNORE_INDEX
        batch = {
            "input_ids": torch.from_numpy(scatter_tokens(ids, self.pad_token_id, (rows, width), where)),
            "labels": torch.from_numpy(out_labels),
            "attention_mask": torch.from_numpy(real.astype(np.int64)),
            "position_ids": torch.arange(width).expand(rows, width).contiguous(),
        }
        batch |= self._fields(fields, (rows, width), where)
        loss = int(np.count_nonzero(out_labels != IGNORE_INDEX))
        stats = _scalars(meta, documents=rows, real=len(ids), total=rows * width, loss=loss, is_empty=False)
        return batch | stats | weight_scalars(self, batch, meta, stats)

    def _fields(self, fields: FieldValues, shape: tuple[int, int], where: slice | np.ndarray) -> dict[str, Any]:
        pads = token_pads(self)
        return {key: pad_token_field(parts, pads[key], shape, where) for key, parts in fields.tokens.items()} | dict(
            fields.samples
        )


_CAUSES = (
    "Samples that change between epochs (augmentation, a prompt that grows, a file re-tokenised behind the same "
    "dataset) must say so: set lengths_change_per_epoch = True on the dataset and it is re-scanned every epoch. A "
    "stale lengths cache (content changed behind the same fingerprint or key) is cleared by deleting cache_dir; a "
    "dataset's own lengths attribute must match its samples"
)


def check_planned_lengths(samples: Sequence[Any], sizes: Sequence[int], meta: Any, multiple: int = 1) -> None:
    """Refuse a microbatch whose samples do not have the lengths the plan was made with.

    Args:
        samples: the microbatch (a :class:`~lit_seqpack.batch.Microbatch` names the dataset indices).
        sizes: each sample's number of tokens.
        meta: the microbatch's :class:`~lit_seqpack.batch.MicrobatchMeta` (``None`` or no ``lengths``: unchecked).
        multiple: the per-document pad multiple the planned lengths are rounded to (packing with
            ``pad_to_multiple_of``), so a planned length is ``ceil(length / multiple) * multiple``.

    Raises:
        ValueError: naming the first sample that differs, its planned and actual length and the likely causes.

    Example:
        >>> from lit_seqpack.batch import MicrobatchMeta
        >>> meta = MicrobatchMeta(step=0, step_loss_tokens=2, world_size=1, accumulate_grad_batches=1, lengths=(3,))
        >>> check_planned_lengths([{}], [3], meta)
    """
    planned = None if meta is None else meta.lengths
    if planned is None:
        return
    # plain Python ints: a list comparison of a microbatch's lengths costs about a microsecond, numpy's set-up more
    actual = list(sizes) if multiple == 1 else [-(-size // multiple) * multiple for size in sizes]
    if actual == list(planned):
        return
    if len(planned) != len(actual):
        raise ValueError(f"the plan gives {len(planned)} sample lengths for a microbatch of {len(actual)} samples")
    i = next(k for k, (want, have) in enumerate(zip(planned, actual, strict=True)) if want != have)
    padded = f" ({int(actual[i])} padded to a multiple of {multiple})" if multiple > 1 else ""
    raise ValueError(
        f"{sample_name(samples, i)} has {sizes[i]} tokens{padded} but the plan was made with a length of "
        f"{int(planned[i])}: its rows would not hold the planned budget. {_CAUSES}"
    )


def check_planned_budget(samples: Sequence[Any], docs: Sequence[np.ndarray], slots: int, meta: Any) -> None:
    """Refuse a microbatch that takes more token slots than the plan's budget: its samples grew after planning.

    Catches what :func:`check_planned_lengths` cannot see when the plan's lengths did not travel with the
    microbatch (a hand-built :class:`~lit_seqpack.batch.MicrobatchMeta`).

    Raises:
        ValueError: naming the budget, the slots and the longest samples with their dataset indices.
    """
    budget = None if meta is None else meta.max_tokens
    if budget is None or slots <= budget:
        return
    longest = sorted(range(len(docs)), key=lambda i: -len(docs[i]))[:3]
    named = ", ".join(f"{sample_name(samples, i)}: {len(docs[i])} tokens" for i in longest)
    raise ValueError(
        f"this microbatch takes {slots} token slots but the plan's budget is max_tokens={budget} (longest: {named}): "
        f"its samples are longer than the lengths it was planned with. {_CAUSES}"
    )


def check_planned_loss_tokens(meta: Any, loss: int, is_empty: bool) -> None:
    """Refuse a microbatch whose labels hold other loss tokens than the plan counted (a wrong loss normaliser).

    Raises:
        ValueError: naming the planned and the actual count.
    """
    if meta is None or is_empty:
        return
    if meta.loss_tokens is not None and meta.loss_tokens != loss:
        raise ValueError(
            f"the plan counted {meta.loss_tokens} loss tokens for this microbatch but its labels hold {loss}: the "
            "step_loss_tokens normaliser would be wrong. Give the batch sampler the samples' real loss tokens "
            "(loss_tokens=lit_seqpack.data.compute_loss_tokens(dataset)); the default assumes every token "
            "but the first of each sample is trained on"
        )
    if meta.step_loss_tokens < loss:
        raise ValueError(
            f"the plan says step_loss_tokens={meta.step_loss_tokens} for this optimizer step, but this microbatch "
            f"alone has {loss} loss tokens: the loss tokens given to the planner do not match the samples' labels"
        )
