"""The batch contract: every key that travels from the collators to the model, the loss and the metrics.

This module is the one declaration of what a batch holds. The data layer writes it, the model layer and the
metrics read it, and both import only this module (plus :mod:`lit_seqpack.parallel` for sharding), never each
other. A batch stays a plain ``dict`` (Lightning's ``transfer_batch_to_device`` moves every tensor in it); the
:class:`PackedBatch` and :class:`PaddedBatch` ``TypedDict`` views only tell a type checker which keys it has.

A packed microbatch is one row of ``T`` tokens. Documents of 3, 5 and 2 tokens padded to a multiple of 4
(``-`` is :data:`IGNORE_INDEX`, ``p`` the pad token)::

    docs          a a a b b b b b c c p p      the padding tail is a segment of its own
    input_ids     a a a b b b b b c c p p      int64 [1, T]
    labels        - a a - b b b b - c - -      int64 [1, T]: -100 at each document's first token and on padding
    position_ids  0 1 2 0 1 2 3 4 0 1 0 1      int64 [1, T]: restart per document and for the tail
    cu_seqlens    0     3         8   10  12   int32 [segments + 1], cu_seqlens[-1] == T
    max_seqlen    5                            Python int (no device sync)

A padded (or dynamic) microbatch is ``[B, L]``: ``input_ids``, ``labels``, ``attention_mask`` (1 on real
tokens) and ``position_ids``, no ``cu_seqlens``. Both kinds carry the Python scalars of :data:`SCALAR_KEYS`.

**The shift convention, stated once.** Collators do *not* shift labels (Hugging Face convention): a per-token
field at position ``t`` is aligned with ``input_ids[t]``, and ``labels[t]`` is the token at ``t`` itself (or
``-100``). The model's loss shifts (:func:`shift_labels`): the logits at ``t`` predict ``labels[t + 1]``. So a
document's first label is ``-100`` (no earlier token of the document predicts it), and no position is ever
trained to predict across a document boundary. The only pre-shifted keys are ``shift_labels`` and
``shift_<name>`` (:data:`SHIFT_PREFIX`), written by the context-parallel sharder, whose next-token target of a
chunk's last token lives on another rank.

**Declared fields.** Extra fields declared on the collators (``token_fields={"advantages": 0.0}``,
``sample_fields=["reward"]``, see :mod:`~lit_seqpack.data.batching.fields`) travel under their own names: a token
field is ``[1, T]`` (packed) or ``[B, L]`` (padded), aligned with ``input_ids`` and padded with its declared value; a
sample field is ``[num_documents]`` (packed) or ``[B]`` (padded). No declared name may be one of :data:`CONTRACT_KEYS`
or start with :data:`SHIFT_PREFIX`. With a ``loss_weight_field`` the batch also carries ``loss_weights``,
``num_loss_weight`` and ``step_loss_weight``, the step's weight sum that normalises the loss.

Keys are spelled as plain strings everywhere (``batch["cu_seqlens"]``), each declared once in the TypedDicts below
(:class:`Sample`, :class:`PackedBatch`, :class:`PaddedBatch`), from which :data:`SCALAR_KEYS` and :data:`CONTRACT_KEYS`
are derived.

Example:
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "cu_seqlens": torch.tensor([0, 3], dtype=torch.int32)}
    >>> is_packed_batch(batch)
    True
    >>> shift_labels(torch.tensor([[-100, 6, 7]])).tolist()
    [[6, 7, -100]]

Which padded batches need an attention mask: a causal row padded on the right does not.

A dynamic or padded microbatch is ``[B, L]`` with an ``attention_mask`` (1 on real tokens). When every row is its
real tokens followed by its padding, causal attention alone is exact for every real token: query ``t`` sees keys
``0..t``, all real, and the padding after them carries no loss (``labels`` is -100 there). So such a batch runs
with ``is_causal`` and no mask, which spares the dense ``[B, 1, L, L]`` mask and, on CUDA, lets SDPA pick its flash
kernel::

    right padded   1 1 1 1 0 0      -> no mask (causal)
                   1 1 0 0 0 0
    left padded    0 0 1 1 1 1      -> the mask stays
    a hole         1 1 0 1 0 0      -> the mask stays
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import torch.nn.functional as F

from lit_seqpack._checks import check_int

__all__ = [
    "CONTRACT_KEYS",
    "IGNORE_INDEX",
    "SCALAR_KEYS",
    "SHIFT_PREFIX",
    "Microbatch",
    "MicrobatchMeta",
    "PackedBatch",
    "PaddedBatch",
    "Sample",
    "is_packed_batch",
    "shift_labels",
    "is_right_padded",
]


SHIFT_PREFIX = "shift_"
"""Context-parallel shards carry ``shift_<name>`` for every declared token field (and ``shift_labels``): the value
of each local token's target, shifted on the whole row like the labels. Declared names may not start with it."""

IGNORE_INDEX = -100
"""The label of a position that carries no loss (a prompt token, a document's first token, padding)."""


class Sample(TypedDict, total=False):
    """What a dataset's item holds (unshifted); declared token and sample fields travel beside these keys."""

    input_ids: Sequence[int]
    """Token ids (always there)."""
    labels: Sequence[int]
    """Unshifted targets aligned with ``input_ids``; :data:`IGNORE_INDEX` where no loss is taken."""
    loss_mask: Sequence[int]
    """1 to train on a token, 0 not to (the collators turn it into ``labels``); weights in ``[0, 1]`` with
    ``loss_weight_field="loss_mask"``."""


class _BatchScalars(TypedDict):
    """The Python scalars every collator writes (never tensors, so reading them costs no device sync)."""

    num_documents: int
    num_real_tokens: int
    num_padding_tokens: int
    num_loss_tokens: int
    step_loss_tokens: int
    """Loss tokens of the whole optimizer step over all ranks: the exact-loss normaliser."""
    world_size: int
    """Data-parallel ranks the plan was made for."""
    accumulate_grad_batches: int
    max_tokens: int | None
    """The plan's token budget of a microbatch (``None`` for the padded baseline)."""
    is_empty: bool
    """A lock-step filler: a zero-weight dummy batch that the plan had no sample for."""


class _LossWeights(TypedDict, total=False):
    """With a ``loss_weight_field`` only."""

    loss_weights: torch.Tensor
    """Float32 per-token loss weights, 0 wherever ``labels`` is :data:`IGNORE_INDEX`."""
    num_loss_weight: float
    """This microbatch's weight sum (a Python float)."""
    step_loss_weight: float
    """The weight sum of the whole optimizer step over all ranks (the normaliser)."""


class _Prediction(TypedDict, total=False):
    """Predict batches only (``SeqPackDataModule.predict_dataloader``)."""

    sample_index: torch.Tensor
    """Int64 ``[num_documents]``: each document's index in the predict source (``cu_seqlens`` order, or per row)."""


class PackedBatch(_BatchScalars, _LossWeights, _Prediction, total=False):
    """Typed view of a packed row (``B == 1``); at run time a plain ``dict``.

    ``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens`` and ``max_seqlen`` are always there;
    ``cu_seqlens_unpadded`` with per-document padding; the ``context_parallel_*`` / ``tensor_parallel_size`` keys
    and ``shift_labels`` on a context-parallel shard.
    """

    input_ids: torch.Tensor
    """Token ids, int64 ``[1, T]``."""
    labels: torch.Tensor
    """Unshifted targets, int64 ``[1, T]``: :data:`IGNORE_INDEX` at every document's first token and on padding."""
    position_ids: torch.Tensor
    """Positions, int64, restarting at 0 for every document of the row (and for the padding tail)."""
    cu_seqlens: torch.Tensor
    """Int32 cumulative segment boundaries, ``cu_seqlens[-1] == T`` (FlashAttention-2 name)."""
    max_seqlen: int
    """The longest segment, a Python int."""
    cu_seqlens_unpadded: torch.Tensor
    """With per-document padding only: the boundaries of the real tokens (same number of entries)."""
    shift_labels: torch.Tensor
    """Context-parallel shards only: each local token's next-token target, shifted on the whole row."""
    context_parallel_size: int
    context_parallel_rank: int
    tensor_parallel_size: int


class PaddedBatch(_BatchScalars, _LossWeights, _Prediction):
    """Typed view of a padded or dynamic ``[B, L]`` batch; at run time a plain ``dict``. Never sent with a packed
    row: ``attention_mask`` (1 on real tokens, 0 on padding)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor


SCALAR_KEYS: tuple[str, ...] = tuple(_BatchScalars.__annotations__)
"""The Python scalars every collator writes (never tensors, so reading them costs no device sync)."""

CONTRACT_KEYS: frozenset[str] = frozenset(
    {*Sample.__annotations__, *PackedBatch.__annotations__, *PaddedBatch.__annotations__}
)
"""Every key the library itself writes or reads: no declared token or sample field may take one of these names."""


def is_packed_batch(batch: Mapping[str, Any]) -> bool:
    """Whether ``batch`` is a packed row (it carries ``cu_seqlens``) rather than a padded ``[B, L]`` batch.

    Example:
        >>> is_packed_batch({"input_ids": torch.zeros(2, 4), "attention_mask": torch.ones(2, 4)})
        False
    """
    return batch.get("cu_seqlens") is not None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the logits: ``out[..., t] = labels[..., t + 1]``, the last position ignored.

    Shifting the labels (a copy of ``[B, T]`` integers) rather than slicing the logits keeps the ``[B, T, V]``
    logits contiguous, so they flatten without a copy.

    Example:
        >>> shift_labels(torch.tensor([[-100, 5, 6]])).tolist()
        [[5, 6, -100]]
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


# ---------------------------------------------------------------------- what a batch sampler hands over
@dataclass(frozen=True, kw_only=True, slots=True)
class MicrobatchMeta:
    """Plan facts about one microbatch that the model side needs.

    A DataLoader hands what its batch sampler yields to ``dataset.__getitems__`` and that method's return value to
    ``collate_fn``. The samplers yield :class:`Microbatch` lists of indices carrying a ``MicrobatchMeta``;
    :class:`PlannedDataset` returns the samples as a :class:`Microbatch` with the same metadata, so the collator
    can write the exact-loss normaliser into the batch without any collective. Both pickle, so they cross
    DataLoader worker processes unchanged.

    Args:
        step: index of the optimizer step within the epoch.
        step_loss_tokens: loss tokens of every microbatch of this optimizer step, summed over all ranks.
        world_size: number of ranks the plan was made for.
        accumulate_grad_batches: microbatches per rank per optimizer step in the plan.
        max_tokens: the token budget of a microbatch (``None`` for the padded baseline).
        is_empty: the plan had no sample for this slot (lock-step filler); the collator emits a
            zero-weight dummy batch.
        loss_tokens: the loss tokens the plan counted for this microbatch (``None``: not checked); the
            collator compares them with the samples' labels, so a wrong count cannot skew the exact loss.
        step_loss_weight: the loss-weight sum of this optimizer step over all ranks, for a weighted loss
            (:mod:`lit_seqpack.data.batching.loss_weights`); ``None`` without one.
        lengths: the length the plan gave each sample, in order (packing pads them to the per-document multiple;
            ``None``: not checked); the collators compare them with the samples, so a sample whose length changed
            after planning cannot overfill a row.

    Example:
        >>> MicrobatchMeta(step=0, step_loss_tokens=12, world_size=2, accumulate_grad_batches=1).max_tokens is None
        True
    """

    step: int
    step_loss_tokens: int
    world_size: int
    accumulate_grad_batches: int
    max_tokens: int | None = None
    is_empty: bool = False
    loss_tokens: int | None = None
    step_loss_weight: float | None = None
    lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_int("step_loss_tokens", self.step_loss_tokens, minimum=0)
        check_int("world_size", self.world_size, minimum=1)
        check_int("accumulate_grad_batches", self.accumulate_grad_batches, minimum=1)
        if self.step_loss_weight is not None and not self.step_loss_weight >= 0:
            raise ValueError(f"step_loss_weight must be >= 0 or None, got {self.step_loss_weight}")


class Microbatch(list):
    """A ``list`` (of dataset indices, or of samples) with an optional :class:`MicrobatchMeta`.

    Example:
        >>> mb = Microbatch([3, 1], meta=None)
        >>> list(mb), mb.meta
        ([3, 1], None)
    """

    __slots__ = ("indices", "meta")

    def __init__(
        self, items: Iterable[Any] = (), meta: MicrobatchMeta | None = None, indices: Sequence[int] | None = None
    ) -> None:
        super().__init__(items)
        self.meta = meta
        self.indices = indices  # the dataset indices of fetched samples (named in the collators' errors)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Microbatch, (list(self), self.meta, self.indices))

    def __repr__(self) -> str:
        return f"Microbatch({list.__repr__(self)}, meta={self.meta!r})"


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a ``[B, L]`` padding mask is ones then zeros (nonzero counts as a real token).

    Exact, not a heuristic: one comparison of neighbours, read once on the host. A mask on the CPU costs no device
    sync; a mask on an accelerator costs one small read per call (call it once per forward, not per layer).

    Example:
        >>> is_right_padded(torch.tensor([[1, 1, 0], [1, 0, 0]])), is_right_padded(torch.tensor([[0, 1, 1]]))
        (True, False)
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, length], got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[1] < 2 or attention_mask.numel() == 0:
        return True
    keep = attention_mask.bool()
    return not bool((keep[:, 1:] & ~keep[:, :-1]).any())  # a real token right after a padding one
