"""``BatchingSettings``: how samples become microbatches, for every source and both pipelines, checked once.

Every setting of :class:`~lit_seqpack.data.datamodule.SeqPackDataModule` that is not a source lives here, with its
documentation written once (the DataModule's docstring points here). The object is frozen and validated in
``__post_init__``: a bad value or a bad combination raises a ``ValueError`` (or ``TypeError``) naming the setting as
the user spelled it, before any data is read. What follows from the settings (the pad multiples, the planner's
configuration for a layout, the collator, the longest document) is derived here too, so the indexed and the
streaming pipeline cannot disagree.

The per-document token budget of a DataModule: the over-long policy applied to it, and the planned lengths.

With ``pad_to_multiple_of`` (or context parallelism) every document of a packed row is padded to a multiple
``m``, so a microbatch of ``max_tokens`` holds documents of at most ``max_tokens - max_tokens % m`` tokens:
that is the budget the over-long policy enforces and the padded lengths are what the planner packs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from lit_seqpack._checks import check_choice, check_flag, check_int
from lit_seqpack.data.batching._samples import sample_loss_tokens
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.batching.context_parallel import ContextParallelCollator, TensorParallelCollator
from lit_seqpack.data.batching.fields import check_fields
from lit_seqpack.data.batching.loss_weights import check_loss_weight_field
from lit_seqpack.data.batching.overlong import (
    OVERLONG_POLICIES,
    DroppedDataset,
    OverlongReport,
    SplitDataset,
    TruncatedDataset,
    apply_overlong_policy,
    check_truncation_side,
)
from lit_seqpack.data.sources.base import declared_counts
from lit_seqpack.parallel import DataParallelLayout, ParallelLayout
from lit_seqpack.planning.algorithms import DEFAULT_ALGORITHM
from lit_seqpack.planning.config import PlanConfig

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_STREAM_WINDOW",
    "MODES",
    "STREAM_SPLITS",
    "BatchingSettings",
    "Collator",
    "Mode",
    "StreamSplit",
    "apply_document_budget",
    "budget_note",
    "document_budget",
    "planned_lengths",
    "view_loss_tokens",
]


def document_budget(max_tokens: int, *, mode: str, pad_to_multiple_of: int, document_multiple: int) -> int:
    """The longest document a microbatch holds: ``max_tokens``, rounded down to the per-document pad multiple.

    Args:
        max_tokens: token budget of a microbatch.
        mode: ``"packing"``, ``"dynamic"`` or ``"padded"``; only packing pads documents.
        pad_to_multiple_of: the user's per-document pad multiple (named in the error).
        document_multiple: the multiple every document is really padded to (with context parallelism too).

    Raises:
        ValueError: the multiple is larger than ``max_tokens``, so no document fits.

    Example:
        >>> document_budget(100, mode="packing", pad_to_multiple_of=16, document_multiple=16)
        96
    """
    budget = max_tokens - max_tokens % document_multiple if mode == "packing" else max_tokens
    if budget == 0:
        raise ValueError(
            f"max_tokens={max_tokens} cannot hold a single document: pad_to_multiple_of="
            f"{pad_to_multiple_of} pads every document to a multiple of {document_multiple} tokens"
            f"{' (with context parallelism)' if document_multiple != pad_to_multiple_of else ''}; "
            "raise max_tokens or lower pad_to_multiple_of"
        )
    return budget


def budget_note(max_tokens: int, budget: int, *, pad_to_multiple_of: int, document_multiple: int) -> str:
    """Why the document budget is below ``max_tokens`` (appended to over-long errors and summaries)."""
    return (
        f"max_tokens={max_tokens} holds documents of at most {budget} tokens because "
        f"pad_to_multiple_of={pad_to_multiple_of} pads each to a multiple of {document_multiple}"
    )


def apply_document_budget(
    data: Sequence[Mapping[str, Any]],
    lengths: np.ndarray,
    loss_tokens: np.ndarray,
    *,
    max_tokens: int,
    mode: str,
    overlong: str,
    pad_to_multiple_of: int,
    document_multiple: int,
    token_fields: Sequence[str] = (),
    truncation_side: str = "right",
) -> tuple[Sequence[Mapping[str, Any]], np.ndarray, np.ndarray, OverlongReport]:
    """Apply the over-long policy at the document budget; log a summary when some samples were over it.

    Args:
        data: the whole dataset.
        lengths: token count of every sample.
        loss_tokens: loss-token count of every sample.
        max_tokens: token budget of a microbatch.
        mode: the DataModule's batching mode.
        overlong: ``"error"``, ``"truncate"``, ``"drop"`` or ``"split"``.
        pad_to_multiple_of: the user's per-document pad multiple.
        document_multiple: the multiple every document is really padded to.
        token_fields: the declared per-token fields, truncated (or split) with the tokens.
        truncation_side: the end ``overlong="truncate"`` cuts.

    Returns:
        The policy's view of the data, its lengths and loss tokens, and the over-long report.
    """
    pads = {"pad_to_multiple_of": pad_to_multiple_of, "document_multiple": document_multiple}
    budget = document_budget(max_tokens, mode=mode, **pads)
    try:
        view, view_lengths, report = apply_overlong_policy(
            data, lengths, budget, overlong, token_fields, truncation_side=truncation_side
        )
    except ValueError as err:
        if budget == max_tokens:
            raise
        raise ValueError(f"{err} ({budget_note(max_tokens, budget, **pads)})") from None
    view_loss = view_loss_tokens(view, lengths, loss_tokens)
    if report.num_overlong:
        note = f" ({budget_note(max_tokens, budget, **pads)})" if budget < max_tokens else ""
        rank_zero_info(f"lit_seqpack: {report.summary()}{note}")
    return view, view_lengths, view_loss, report


def planned_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Document lengths after per-document padding to ``multiple`` (what a packed row really holds).

    Example:
        >>> planned_lengths(np.array([1, 8, 9]), 8).tolist()
        [8, 8, 16]
    """
    if multiple == 1:
        return lengths
    return (lengths + multiple - 1) // multiple * multiple


def view_loss_tokens(view: Any, full_lengths: np.ndarray, full_loss_tokens: np.ndarray) -> np.ndarray:
    """Loss tokens of the samples of an over-long policy's view (dropped samples gone, cut or split ones recounted).

    Args:
        view: what :func:`~lit_seqpack.data.batching.overlong.apply_overlong_policy` returned for the data.
        full_lengths: token count of every sample of the whole dataset.
        full_loss_tokens: loss-token count of every sample of the whole dataset.
    """
    if not isinstance(view, (DroppedDataset, TruncatedDataset, SplitDataset)):  # the data itself: its counts
        return full_loss_tokens
    offered = declared_counts(view, "loss_tokens")
    if offered is not None:
        return offered
    if isinstance(view, DroppedDataset):
        return full_loss_tokens[view.original_indices]
    if isinstance(view, SplitDataset):
        return view.piece_loss_tokens(full_loss_tokens)
    if isinstance(view, TruncatedDataset):
        counts = full_loss_tokens.copy()
        for i in np.flatnonzero(full_lengths > view.max_tokens):
            counts[i] = sample_loss_tokens(view[int(i)])
        return counts
    return full_loss_tokens


Mode = Literal["packing", "dynamic", "padded"]
StreamSplit = Literal["rank", "replicate"]
STREAM_SPLITS: tuple[str, ...] = ("rank", "replicate")
MODES: tuple[str, ...] = ("packing", "dynamic", "padded")
DEFAULT_MAX_TOKENS = 2048
"""``max_tokens="auto"`` in packing and dynamic mode (``None`` in padded mode)."""
DEFAULT_STREAM_WINDOW = 1000
"""``window=None`` for a stream: it cannot be planned whole, so this many samples are planned together."""

Collator = PackedCollator | PaddedCollator | ContextParallelCollator | TensorParallelCollator


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchingSettings:
    """How samples become microbatches: the mode, the budgets, the plan, the layout, the fields and the loader.

    Example:
        >>> settings = BatchingSettings(mode="packing", max_tokens=1024, sequence_length_round=8)
        >>> settings.plan_config(DataParallelLayout(world_size=2, rank=0, accumulate_grad_batches=4)).world_size
        2
        >>> BatchingSettings(mode="padded", batch_size=8).max_tokens is None
        True
    """

    mode: Mode = "packing"
    """``"packing"``, ``"dynamic"`` or ``"padded"`` (the baseline); one field, so packing and dynamic batching can
    never both be on."""
    max_tokens: int | Literal["auto"] | None = "auto"
    """Token budget of a microbatch (packing and dynamic). ``"auto"`` is 2048 in packing and dynamic mode and ``None``
    in padded mode (no cap, as a plain DataLoader); an int in padded mode caps every sample at it (``overlong``)."""
    eval_max_tokens: int | None = None
    """Token budget of validation and test microbatches (packing and dynamic; ``None``: ``max_tokens``). Without
    gradients 2-4x more tokens fit; documents keep the training budget."""
    algorithm: str = DEFAULT_ALGORITHM
    """Packing algorithm, a name in :data:`~lit_seqpack.planning.algorithms.ALGORITHMS` (packing only)."""
    window: int | None = None
    """Consecutive samples planned together: of the shuffled epoch for indexed data (``None``: the whole epoch, the
    fullest rows), of the look-ahead buffer for a stream (``None``: 1000; memory holds one window per loader
    process, larger packs fuller rows)."""
    sequence_length_round: int = 1
    """Rows are padded to a multiple of this (the packed row, or the longest row of a dynamic/padded block);
    ``max_tokens`` must be a multiple of it."""
    pad_to_multiple_of: int = 1
    """Every document is padded to a multiple of this inside a packed row (context/tensor parallel kernels need it);
    the planner plans on the padded lengths."""
    microbatch_order: Literal["largest_first", "packer"] = "largest_first"
    """``"largest_first"`` or ``"packer"`` (see :class:`~lit_seqpack.planning.PlanConfig`)."""
    cost_quadratic: float | Literal["auto"] = "auto"
    """``b`` of the per-document cost ``L + b*L^2`` that ranks are balanced on; ``"auto"``: ``1 / max_tokens``."""
    overlong: Literal["error", "truncate", "drop", "split"] = "error"
    """What happens to samples longer than the document budget (``max_tokens``, less per-document padding):
    ``"error"``, ``"truncate"`` (see ``truncation_side``), ``"drop"`` or ``"split"`` (cut at multiples of the budget
    into ``ceil(L / budget)`` pieces, each a document of its own: every token kept); counted, logged and kept in
    ``overlong_report``."""
    truncation_side: Literal["right", "left"] = "right"
    """Which end ``overlong="truncate"`` cuts: ``"right"`` keeps a sample's first tokens, ``"left"`` its last ones
    (the first kept token then carries no label, as every document's first token). Only with ``"truncate"``."""
    batch_size: int | None = None
    """Samples per microbatch (padded mode only, where it is required)."""
    val_fraction: float = 0.0
    """Share of the training source's samples held out for validation (0: none; indexed sources only)."""
    test_fraction: float = 0.0
    """Share of the training source's samples held out for testing (0: none; indexed sources only)."""
    num_workers: int = 0
    """DataLoader worker processes (may differ between a checkpoint and its resume). Under ``torch.distributed``
    they start with ``forkserver`` when the data pickles (:mod:`~lit_seqpack.data.workers`)."""
    loader_timeout: float = 600.0
    """Seconds a loader waits for a worker's start-up or next batch before every rank raises, naming the loader and
    the stuck rank (with ``num_workers > 0``; must be > 0: a stuck worker never hangs the job)."""
    pad_token_id: int = 0
    """The id written on padding positions."""
    seed: int = 0
    """Seed of the shuffles and of the held-out split (the same on every rank)."""
    shuffle: bool = True
    """Reshuffle the training samples every epoch."""
    cache_dir: str | None = None
    """Folder where the lengths of data without declared lengths are cached (``None``: no cache)."""
    context_parallel_size: int = 1
    """Ranks that split every sequence (context parallelism, packing only). Every document is then padded to
    ``lcm(pad_to_multiple_of, 2 x cp x tp)`` and each rank receives its shard."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks with sequence parallelism: rows are padded to a multiple of it. Under a strategy with a
    device mesh the data-parallel size and rank are the mesh's, and its tp/cp sizes must equal these two settings;
    without a mesh, global ranks are laid out tensor-parallel innermost, then context-parallel, then
    data-parallel."""
    content_check_samples: int = 8
    """Under ``torch.distributed``, the tokens of this many samples (the same on every rank) are hashed and compared
    across ranks with the plan (indexed) or with every window (stream), so ranks that read different data
    fail loudly on every rank; 0 compares the lengths only (indexed) or turns the stream check off."""
    stream_split: StreamSplit = "rank"
    """How data-parallel ranks read a stream: ``"rank"`` (each rank reads a disjoint share, plans its own windows and
    keeps lock step with one small collective per window; the reading cost per rank falls with the ranks) or
    ``"replicate"`` (every rank reads the whole stream and keeps its part of one global plan; the content of the
    windows is compared across ranks). Indexed sources ignore it."""
    token_fields: dict[str, int | float] | None = None
    """Extra per-token fields carried in every batch, each mapped to its pad value (e.g. ``{"advantages": 0.0}``):
    concatenated or padded like ``input_ids``, truncated with the sample, sharded under context parallelism."""
    sample_fields: list[str] | tuple[str, ...] | None = None
    """Extra per-sample fields carried in every batch (e.g. ``["reward"]``), one value a document."""
    loss_weight_field: str | None = None
    """A declared token field of per-token loss weights (finite, ``>= 0``), or ``"loss_mask"`` (the samples'
    ``loss_mask`` holds weights in ``[0, 1]``): the loss becomes ``sum(w * ce)`` over the step's planned weight
    sum."""
    parallel: ParallelLayout = field(init=False, repr=False, compare=False)
    """The context- and tensor-parallel sizes, and the pad multiples that follow from them (derived)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        check_choice("mode", self.mode, MODES)
        if isinstance(self.max_tokens, str):
            if self.max_tokens != "auto":
                raise ValueError(f"max_tokens={self.max_tokens!r} must be an int, 'auto' or null")
            set_(self, "max_tokens", None if self.mode == "padded" else DEFAULT_MAX_TOKENS)
        check_choice("overlong", self.overlong, OVERLONG_POLICIES)
        check_truncation_side(self.truncation_side, self.overlong)
        check_flag("shuffle", self.shuffle)
        check_int("pad_token_id", self.pad_token_id, minimum=0)
        check_int("num_workers", self.num_workers, minimum=0)
        timeout = self.loader_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"loader_timeout={timeout!r} must be a finite number of seconds > 0")
        check_int("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        check_int("content_check_samples", self.content_check_samples, minimum=0)
        check_choice("stream_split", self.stream_split, STREAM_SPLITS)
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            raise TypeError(f"cache_dir={self.cache_dir!r} must be a str or None")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}={value!r} must be a number")
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r} must be in [0, 1)")
        tokens, samples = check_fields(self.token_fields, self.sample_fields)
        set_(self, "token_fields", tokens)
        set_(self, "sample_fields", samples)
        check_loss_weight_field(self.loss_weight_field, tokens)
        set_(
            self,
            "parallel",
            ParallelLayout(
                context_parallel_size=self.context_parallel_size, tensor_parallel_size=self.tensor_parallel_size
            ),
        )
        self._check_combinations()
        set_(self, "eval_max_tokens", self._eval_budget())
        self.plan_config(DataParallelLayout())  # the planner's own checks of the plan settings
        if self.max_tokens is not None:
            self.document_budget  # noqa: B018 - raises when no document fits a microbatch

    def _check_combinations(self) -> None:
        """Settings that only make sense together, each refused naming both."""
        if self.pad_to_multiple_of > 1 and self.mode != "packing":
            raise ValueError(
                f"pad_to_multiple_of={self.pad_to_multiple_of} pads the documents of a packed row and needs "
                f"mode='packing', got mode={self.mode!r} (sequence_length_round pads the rows of dynamic and padded "
                "batches)"
            )
        if self.mode == "padded" and self.batch_size is None:
            raise ValueError(
                "mode='padded' needs batch_size (data.batch_size: the samples of every microbatch), got None; or "
                "batch by a token budget with mode='dynamic' or 'packing' and max_tokens"
            )
        if self.parallel.model_parallel_size == 1:
            return
        if self.mode != "packing" and self.context_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} needs mode='packing', got mode={self.mode!r} "
                f"(tensor_parallel_size={self.tensor_parallel_size} alone works in every mode)"
            )
        if isinstance(self.max_tokens, int) and self.max_tokens % self.row_multiple:
            raise ValueError(
                f"max_tokens={self.max_tokens} must be a multiple of {self.row_multiple}, the row multiple that "
                "sequence_length_round, pad_to_multiple_of, context_parallel_size and tensor_parallel_size give"
            )

    def _eval_budget(self) -> int | None:
        """``eval_max_tokens`` checked, or ``max_tokens`` when it is ``None``."""
        value = self.eval_max_tokens
        if value is None:
            return self.max_tokens
        if self.mode == "padded":
            raise ValueError(
                f"eval_max_tokens={value!r} is a token budget, but mode='padded' batches batch_size samples "
                "(validation and test too): remove eval_max_tokens or use mode='packing' or 'dynamic'"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"eval_max_tokens={value!r} must be an int (or null: max_tokens)")
        assert isinstance(self.max_tokens, int)  # packing and dynamic always have a budget
        if value < self.max_tokens:
            raise ValueError(
                f"eval_max_tokens={value} is below max_tokens={self.max_tokens}: a document of the training budget "
                "would not fit an evaluation microbatch; set eval_max_tokens >= max_tokens (evaluation fits more)"
            )
        if value % self.row_multiple:
            raise ValueError(f"eval_max_tokens={value} must be a multiple of {self.row_multiple}, as max_tokens is")
        return value

    # ------------------------------------------------------------------ derived
    @property
    def document_multiple(self) -> int:
        """Every document of a packed row is padded to a multiple of this (planner and collator alike)."""
        return self.parallel.document_multiple(self.pad_to_multiple_of)

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this (``sequence_length_round`` unless cp or tp > 1)."""
        return self.parallel.row_multiple(self.sequence_length_round, self.pad_to_multiple_of)

    @property
    def planned_document_multiple(self) -> int:
        """The multiple the planner pads documents to: :attr:`document_multiple` in packing mode, else 1."""
        return self.document_multiple if self.mode == "packing" else 1

    @property
    def document_budget(self) -> int | None:
        """The longest document a microbatch holds (``None`` without a budget): the over-long policy's limit."""
        if self.max_tokens is None:
            return None
        return document_budget(
            self.max_tokens,
            mode=self.mode,
            pad_to_multiple_of=self.pad_to_multiple_of,
            document_multiple=self.document_multiple,
        )

    @property
    def longest_row(self) -> int | None:
        """The longest row a microbatch can have (``eval_max_tokens``: evaluation rows are the longest), ``None``
        without a budget (padded mode without ``max_tokens``): the model's ``max_seq_len`` must reach it."""
        return self.eval_max_tokens if self.max_tokens is not None else None

    def length_conflict(self, longest: dict[str, tuple[Any, ...]], model_max_seq_len: int | None) -> str | None:
        """One message naming every length setting and a value of each that works, or ``None`` when they fit.

        Args:
            longest: per split read (``"train"``, ``"val"``, ``"test"``), its longest sample ``(tokens, index)``,
                optionally followed by the over-long summary of the split (which samples are past the budget).
            model_max_seq_len: the longest row the model accepts (``None``: no limit).

        Example:
            >>> settings = BatchingSettings(max_tokens=256, eval_max_tokens=512, sequence_length_round=8)
            >>> print(settings.length_conflict({"train": (700, 3)}, 512))  # doctest: +NORMALIZE_WHITESPACE
            the length settings do not fit the data: the longest sample (index 3) has 700 tokens, but
            data.max_tokens=256 (data.overlong='error'), data.eval_max_tokens=512,
            model max_seq_len=512. Values that work together: data.max_tokens: 704 (a multiple of 8),
            data.eval_max_tokens: 704 or more (or null: max_tokens), model.init_args.max_seq_len: at least
            data.eval_max_tokens (the CLI sets it so when the config leaves it out); or raise max_tokens, or set
            overlong='split' (every token kept, in pieces), overlong='truncate' or overlong='drop'
        """
        if self.max_tokens is None:
            return None
        over = {name: value for name, value in longest.items() if value[0] > self.document_budget}
        needs_docs = self.overlong == "error" and bool(over)
        needs_model = model_max_seq_len is not None and model_max_seq_len < self.longest_row
        if not (needs_docs or needs_model):
            return None
        step = self.planned_document_multiple
        tokens = max([value[0] for value in over.values()], default=0) if needs_docs else self.max_tokens
        tokens = -(-tokens // step) * step
        tokens = -(-tokens // self.row_multiple) * self.row_multiple
        facts = [self._over_fact(name, value) for name, value in over.items()]
        model = "no limit" if model_max_seq_len is None else str(model_max_seq_len)
        rounding = f" (a multiple of {self.row_multiple})" if self.row_multiple > 1 else ""
        eval_tokens = max(tokens, self.eval_max_tokens)
        fix = (
            ""
            if not needs_docs
            else (
                "; or raise max_tokens, or set overlong='split' (every token kept, in pieces), overlong='truncate' or "
                "overlong='drop'"
            )
        )
        return (
            f"the length settings do not fit the data: {', '.join(facts) or 'every sample fits'}, but "
            f"data.max_tokens={self.max_tokens} (data.overlong={self.overlong!r}), data.eval_max_tokens="
            f"{self.eval_max_tokens}, model max_seq_len={model}. Values that work together: data.max_tokens: "
            f"{tokens}{rounding}, data.eval_max_tokens: {eval_tokens} or more (or null: max_tokens), "
            "model.init_args.max_seq_len: at least data.eval_max_tokens (the CLI sets it so when the config leaves it "
            f"out){fix}"
        )

    def _over_fact(self, name: str, value: tuple[Any, ...]) -> str:
        length, index, *summary = value
        where = "" if name == "train" else f"the {name} data: "
        if not summary:
            return f"{where}the longest sample (index {index}) has {length} tokens"
        return f"{where}{summary[0]}"

    @property
    def stream_window(self) -> int:
        """Samples of a stream planned together: :attr:`window`, or :data:`DEFAULT_STREAM_WINDOW`."""
        return DEFAULT_STREAM_WINDOW if self.window is None else self.window

    def plan_config(self, layout: DataParallelLayout, *, train: bool = True) -> PlanConfig:
        """The planner's configuration for ``layout`` (``train=False``: an evaluation split, unshuffled).

        Args:
            layout: the data-parallel world size and accumulation to plan for (the rank is not planned on).
            train: plan the training split (shuffled when :attr:`shuffle`, budget ``max_tokens``) rather than an
                evaluation split (budget :attr:`eval_max_tokens`, no accumulation).
        """
        budget = self.max_tokens if train else self.eval_max_tokens
        return PlanConfig(
            mode=self.mode,
            max_tokens=budget if self.mode != "padded" else None,
            algorithm=self.algorithm if self.mode == "packing" else None,
            window=self.window,
            sequence_length_round=self.row_multiple,
            batch_size=self.batch_size,
            world_size=layout.world_size,
            accumulate_grad_batches=layout.accumulate_grad_batches if train else 1,
            seed=self.seed,
            shuffle=self.shuffle and train,
            microbatch_order=self.microbatch_order,
            cost_quadratic=self.cost_quadratic,
        )

    def collator(self, context_parallel_rank: int = 0) -> Collator:
        """The collator of this mode and layout (``context_parallel_rank``: the shard this process keeps)."""
        tp = self.tensor_parallel_size
        fields: dict[str, Any] = {
            "token_fields": self.token_fields,
            "sample_fields": self.sample_fields,
            "loss_weight_field": self.loss_weight_field,
        }
        if self.mode != "packing":
            padded = PaddedCollator(pad_token_id=self.pad_token_id, pad_to_multiple_of=self.row_multiple, **fields)
            return padded if tp == 1 else TensorParallelCollator(collator=padded, tensor_parallel_size=tp)
        multiple = self.document_multiple
        collator = PackedCollator(
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.row_multiple,
            pad_document_to_multiple_of=multiple if multiple > 1 else None,
            **fields,
        )
        if self.parallel.model_parallel_size == 1:
            return collator
        if self.context_parallel_size == 1:  # sequence parallelism splits the row, not each document
            return TensorParallelCollator(collator=collator, tensor_parallel_size=tp)
        return ContextParallelCollator(
            collator=collator,
            context_parallel_size=self.context_parallel_size,
            context_parallel_rank=context_parallel_rank,
            tensor_parallel_size=tp,
        )
