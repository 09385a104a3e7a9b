"""``SeqPackDataModule``: packed, dynamic or padded batches for one or many ranks, resumable mid-epoch."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_seqpack._checks import check_int
from lit_seqpack.batch import PlannedDataset
from lit_seqpack.data._budget import apply_document_budget, document_budget, planned_lengths
from lit_seqpack.data._eval_data import EvalFile, check_padded_batch_size, eval_budget, eval_files, eval_split
from lit_seqpack.data._hashing import content_digest
from lit_seqpack.data._layout import read_layout
from lit_seqpack.data._loader import ResumableDataLoader
from lit_seqpack.data._resume import (
    LOADER_STATE,
    PLAN_STATE,
    check_resume,
    check_start,
    layout_state,
    plan_settings,
    rewind_fit_loop,
)
from lit_seqpack.data._settings import check_batching_settings, check_parallel_settings, check_setting_types
from lit_seqpack.data.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.context_parallel import ContextParallelCollator, ParallelLayout, TensorParallelCollator
from lit_seqpack.data.fields import check_fields
from lit_seqpack.data.lengths import cached_scan
from lit_seqpack.data.loss_weights import LOSS_MASK, check_datamodule_weight_field, with_step_loss_weights
from lit_seqpack.data.overlong import OVERLONG_POLICIES, OverlongReport
from lit_seqpack.data.samplers import DynamicBatchSampler, PackedBatchSampler, PaddedBatchSampler
from lit_seqpack.data.sources import SOURCES, SyntheticInstructionDataset, TokenizedDataset, build_dataset
from lit_seqpack.data.sources.factory import FILE_SOURCES
from lit_seqpack.data.splits import IndexView, Split, split_indices
from lit_seqpack.data.streaming.module import (
    STREAM_STATE,
    build_stream_loader,
    check_stream_settings,
    load_stream_state,
    stream_state,
)
from lit_seqpack.data.streaming.sources import StreamSource
from lit_seqpack.data.validation import DataScan, check_vocab_range, scan_dataset
from lit_seqpack.planning.plan import PlanConfig

if TYPE_CHECKING:
    from lit_seqpack.data.planned_sampler import PlannedBatchSampler

__all__ = ["SeqPackDataModule"]


Mode = Literal["packing", "dynamic", "padded"]
DEFAULT_MAX_TOKENS = 2048
"""``max_tokens="auto"`` in packing and dynamic mode (``None`` in padded mode)."""
_SAMPLERS = {"packing": PackedBatchSampler, "dynamic": DynamicBatchSampler, "padded": PaddedBatchSampler}


def _int32(counts: np.ndarray) -> np.ndarray:
    """Token counts in 4 bytes a sample when they fit (they always do below 2^31 tokens a sample)."""
    fits = counts.size == 0 or int(counts.max()) < 1 << 31
    return counts.astype(np.int32, copy=False) if fits else counts


class SeqPackDataModule(LightningDataModule):
    """Token sequences batched by the lit_seqpack planner, for a ``Trainer`` with one or many ranks.

    The plan of every epoch is computed identically on every rank (no communication); each rank's
    batch sampler yields its own microbatches, the same number on every rank and per optimizer step,
    and carries the optimizer step's loss-token total so the model side normalises the loss exactly.
    The Trainer must run with ``use_distributed_sampler=False`` (the ``lit-seqpack`` CLI sets it).

    Args:
        source: where samples come from: ``"synthetic"`` (the embedded task, no download), ``"jsonl"``,
            ``"parquet"``, ``"hf_disk"`` (pre-tokenised), ``"text"`` (raw text + local tokenizer) or ``"chat"``
            (conversations + the local tokenizer's chat template, :class:`~lit_seqpack.data.sources.chat.ChatDataset`).
        path: the file or folder of an on-disk source.
        synthetic: keyword arguments of :class:`~lit_seqpack.data.sources.SyntheticInstructionDataset`.
        tokenizer: path of a local Hugging Face tokenizer (``source="text"`` or ``"chat"``); the vocabulary the data
            needs (:attr:`vocab_size`, linked to the model's by the CLI) is then the tokenizer's.
        text_field: the JSONL field holding raw text (``source="text"``).
        chat: keyword arguments of :class:`~lit_seqpack.data.sources.chat.ChatDataset` (``source="chat"``):
            ``chat_template``, ``train_on``, ``mask_method``, ``messages_field``.
        split: the split of ``path`` when it is a saved ``DatasetDict`` folder (``hf_disk`` or ``chat``).
        val_path: a file or folder of validation samples, read like ``path`` (instead of ``val_fraction``).
        test_path: a file or folder of test samples, read like ``path`` (instead of ``test_fraction``).
        val_split: the split of ``val_path`` (or, without ``val_path``, of ``path``) for a ``DatasetDict`` folder.
        test_split: the split of ``test_path`` (or, without ``test_path``, of ``path``) for a ``DatasetDict`` folder.
        eval_max_tokens: token budget of validation and test microbatches (packing and dynamic; ``None``:
            ``max_tokens``). Without gradients 2-4x more tokens fit; documents keep the training budget.
        mode: ``"packing"``, ``"dynamic"`` or ``"padded"`` (the baseline); one field, so packing and
            dynamic batching can never both be on.
        max_tokens: token budget of a microbatch (packing and dynamic). ``"auto"`` (the default) is 2048 in
            packing and dynamic mode and ``None`` in padded mode (no cap, as a plain DataLoader); an int in padded
            mode caps every sample at it (``overlong``).
        algorithm: packing algorithm (``lit_seqpack.PACKING_ALGORITHMS``; packing only).
        window: consecutive shuffled samples planned together (``None``: the whole epoch).
        sequence_length_round: rows are padded to a multiple of this (the packed row, or the longest
            row of a dynamic/padded block); ``max_tokens`` must be a multiple of it.
        pad_to_multiple_of: every document is padded to a multiple of this inside a packed row
            (context/tensor parallel kernels need it); the planner plans on the padded lengths.
        context_parallel_size: ranks that split every sequence (context parallelism, packing only). Every
            document is then padded to ``lcm(pad_to_multiple_of, 2 x cp x tp)``, the planner plans on those
            lengths and each rank receives its shard (:mod:`lit_seqpack.data.context_parallel`).
        tensor_parallel_size: tensor-parallel ranks with sequence parallelism: rows are padded to a multiple of
            it (packed rows, or the ``L`` of dynamic and padded blocks; every document to a multiple of
            ``2 x cp x tp`` with context parallelism); documents of any length are fine.
            The ``cp x tp`` ranks of one data-parallel rank get the same microbatches. Under a strategy with a
            device mesh (``ModelParallelStrategy``) the data-parallel size and rank are the mesh's, and the mesh's
            tensor/context-parallel sizes must equal these two settings (``ValueError`` naming both otherwise);
            without a mesh, global ranks are laid out tensor-parallel innermost, then context-parallel, then
            data-parallel (:class:`~lit_seqpack.data.context_parallel.ParallelLayout`), and the plan is made for
            ``trainer.world_size / (cp x tp)`` data-parallel ranks.
        microbatch_order: ``"largest_first"`` or ``"packer"`` (see :class:`~lit_seqpack.planning.PlanConfig`).
        cost_quadratic: ``b`` of the per-document cost ``L + b*L^2`` that ranks are balanced on; ``"auto"``:
            ``1 / max_tokens`` (attention-heavy long documents no longer make one rank the slowest).
        overlong: what happens to samples longer than ``max_tokens``: ``"error"``, ``"truncate"`` or
            ``"drop"``; counted, logged and kept in :attr:`overlong_report`.
        batch_size: samples per microbatch (padded mode only).
        val_fraction: share of the samples held out for validation (0 disables validation).
        test_fraction: share of the samples held out for ``lit-seqpack test`` / ``trainer.test`` (0: none).
        num_workers: DataLoader worker processes (may differ between a checkpoint and its resume).
        pad_token_id: the id written on padding positions.
        seed: seed of the shuffles and of the validation split (the same on every rank).
        shuffle: reshuffle the training samples every epoch.
        cache_dir: folder where the lengths of on-disk data are cached (``None``: no cache).
        dataset: a ready map-style dataset for Python users; it replaces ``source``/``path``/``synthetic``.
        content_check_samples: under ``torch.distributed``, the tokens of this many samples (the same indices on
            every rank) are hashed and compared across ranks with the plan at the first batch, so ranks that
            read different data with equal lengths fail loudly on every rank; 0 compares the lengths only (for
            datasets whose samples change between reads). With ``stream``, each checked window's lengths and the
            tokens of this many of its samples are compared instead; 0 turns that check off.
        token_fields: extra per-token fields of the samples to carry in every batch, each name mapped to its pad
            value (e.g. ``{"advantages": 0.0}``): concatenated or padded like ``input_ids``, truncated with the
            sample by ``overlong="truncate"``, sharded with the tokens under context parallelism (see
            :mod:`lit_seqpack.data.fields`).
        sample_fields: extra per-sample fields to carry (e.g. ``["reward"]``), one value a document.
        loss_weight_field: a declared token field holding per-token loss weights (finite, ``>= 0``), or
            ``"loss_mask"`` (the samples' ``loss_mask`` holds weights in ``[0, 1]``; ``dataset=`` only: a file source
            turns ``loss_mask`` into labels when it loads the data): the default loss becomes
            ``sum(w * ce)`` over the step's weight sum, which is planned from the samples' weight sums
            (one pass over the data per loader; see :mod:`lit_seqpack.data.loss_weights`).
        stream: a :class:`~lit_seqpack.data.streaming.StreamSource` read as a stream instead of an indexed dataset
            (too big to index: generators, sharded JSONL/Parquet, HF ``IterableDataset``, mixtures); packed online
            in windows of ``stream_buffer`` samples (:mod:`lit_seqpack.data.streaming`). No held-out fractions.
        stream_buffer: samples of the look-ahead buffer planned together (memory holds one such window per loader
            process; larger packs fuller rows).
    """

    def __init__(
        self,
        *,
        source: str = "synthetic",
        path: str | None = None,
        synthetic: dict[str, Any] | None = None,
        tokenizer: str | None = None,
        text_field: str = "text",
        chat: dict[str, Any] | None = None,
        split: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        val_split: str | None = None,
        test_split: str | None = None,
        eval_max_tokens: int | None = None,
        mode: Mode = "packing",
        max_tokens: int | Literal["auto"] | None = "auto",
        algorithm: str = "first_fit_decreasing",
        window: int | None = None,
        sequence_length_round: int = 1,
        pad_to_multiple_of: int = 1,
        microbatch_order: Literal["largest_first", "packer"] = "largest_first",
        cost_quadratic: float | Literal["auto"] = "auto",
        overlong: Literal["error", "truncate", "drop"] = "error",
        batch_size: int | None = None,
        val_fraction: float = 0.0,
        test_fraction: float = 0.0,
        num_workers: int = 0,
        pad_token_id: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        cache_dir: str | None = None,
        dataset: Sequence[Mapping[str, Any]] | None = None,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        content_check_samples: int = 8,
        token_fields: dict[str, int | float] | None = None,
        sample_fields: list[str] | None = None,
        loss_weight_field: str | None = None,
        stream: StreamSource | None = None,
        stream_buffer: int = 1000,
    ) -> None:
        super().__init__()
        if (
            isinstance(content_check_samples, bool)
            or not isinstance(content_check_samples, int)
            or content_check_samples < 0
        ):
            raise ValueError(f"content_check_samples must be an int >= 0, got {content_check_samples!r}")
        self.save_hyperparameters(ignore=["dataset", "stream"])
        if isinstance(max_tokens, str) and max_tokens == "auto":
            max_tokens = self.hparams.max_tokens = None if mode == "padded" else DEFAULT_MAX_TOKENS
        check_setting_types(
            source=source,
            sources=SOURCES,
            overlong=overlong,
            policies=OVERLONG_POLICIES,
            shuffle=shuffle,
            pad_token_id=pad_token_id,
            strings={
                "path?": path,
                "tokenizer?": tokenizer,
                "text_field": text_field,
                "cache_dir?": cache_dir,
                "split?": split,
                "val_path?": val_path,
                "test_path?": test_path,
                "val_split?": val_split,
                "test_split?": test_split,
            },
            fractions={"val_fraction": val_fraction, "test_fraction": test_fraction},
        )
        check_batching_settings(
            mode=mode,
            modes=_SAMPLERS,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            num_workers=num_workers,
            pad_to_multiple_of=pad_to_multiple_of,
        )
        self._token_fields, self._sample_fields = check_fields(token_fields, sample_fields)
        file_source = source if dataset is None and stream is None and source in FILE_SOURCES else None
        check_datamodule_weight_field(loss_weight_field, self._token_fields, file_source=file_source)
        self._parallel = ParallelLayout(
            context_parallel_size=context_parallel_size, tensor_parallel_size=tensor_parallel_size
        )
        check_parallel_settings(self._parallel, mode, max_tokens, self.row_multiple)
        check_padded_batch_size(mode, batch_size)
        self._eval_max_tokens = eval_budget(
            eval_max_tokens, max_tokens=max_tokens, mode=mode, row_multiple=self.row_multiple
        )
        self._eval_files = eval_files(
            source=source,
            path=path,
            split=split,
            paths={"val": val_path, "test": test_path},
            splits={"val": val_split, "test": test_split},
            fractions={"val": val_fraction, "test": test_fraction},
            dataset_given=dataset is not None,
        )
        self._eval_data: dict[str, tuple[Sequence[Mapping[str, Any]], DataScan]] = {}
        # Validate the plan settings now (world size and accumulation are read from the Trainer in setup).
        self.plan_config(world_size=1, accumulate_grad_batches=1)
        if max_tokens is not None:
            document_budget(
                max_tokens, mode=mode, pad_to_multiple_of=pad_to_multiple_of, document_multiple=self.document_multiple
            )
        if stream is not None:
            check_stream_settings(
                stream,
                buffer_size=stream_buffer,
                val_fraction=val_fraction,
                test_fraction=test_fraction,
                dataset=dataset,
                source=source,
                unsupported={"val_path": val_path, "test_path": test_path, "loss_weight_field": loss_weight_field},
            )
        self._stream = stream
        self._dataset = dataset
        self._data_scan: DataScan | None = None
        self.overlong_report: OverlongReport | None = None
        self.eval_overlong_reports: dict[str, OverlongReport | None] = {}  # of val_path / test_path data
        self._splits: dict[str, Split] = {}
        self._layout: tuple[int, int, int] = (1, 0, 1)  # data-parallel world size and rank, accumulation
        self._cp_rank = 0
        self._train_sampler: PlannedBatchSampler | None = None
        self._train_loader: StatefulDataLoader | None = None
        self._pending_loader_state: dict[str, Any] | None = None
        self._fabric: tuple[Any, int] | None = None
        self._resume_point: tuple[int, int] | None = None  # (epoch, microbatch) of the restored loader state

    @property
    def _weighted_mask(self) -> bool:
        """Whether the samples' ``loss_mask`` holds loss weights in ``[0, 1]`` (``loss_weight_field="loss_mask"``)."""
        return self.hparams.loss_weight_field == LOSS_MASK

    @property
    def document_multiple(self) -> int:
        """Every document of a packed row is padded to a multiple of this (planner and collator alike)."""
        return self._parallel.document_multiple(self.hparams.pad_to_multiple_of)

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this (``sequence_length_round`` unless cp or tp > 1)."""
        return self._parallel.row_multiple(self.hparams.sequence_length_round, self.hparams.pad_to_multiple_of)

    # ------------------------------------------------------------------ data
    @property
    def dataset(self) -> Sequence[Mapping[str, Any]]:
        """The whole dataset (before the over-long policy and the validation split)."""
        if self._dataset is None:
            hp = self.hparams
            self._dataset = self._build(hp.path, hp.split)
        return self._dataset

    def _build(self, path: str | None, split: str | None) -> Sequence[Mapping[str, Any]]:
        hp = self.hparams
        return build_dataset(
            hp.source,
            path=path,
            synthetic=hp.synthetic,
            tokenizer=hp.tokenizer,
            text_field=hp.text_field,
            chat=hp.chat,
            split=split,
            token_fields=tuple(self._token_fields),  # the files keep the declared fields (dataset= is as given)
            sample_fields=self._sample_fields,
        )

    @property
    def eval_max_tokens(self) -> int | None:
        """Token budget of validation and test microbatches (``max_tokens`` unless ``eval_max_tokens`` is set)."""
        return self._eval_max_tokens

    def _eval_file(self, name: str) -> tuple[Sequence[Mapping[str, Any]], DataScan]:
        """The dataset read from ``{name}_path`` / ``{name}_split`` and its validation pass (once)."""
        if name not in self._eval_data:
            file: EvalFile = self._eval_files[name]
            data = self._build(file.path, file.split)
            cache_dir = self.hparams.cache_dir
            direct = cache_dir is None or isinstance(data, TokenizedDataset)  # lengths free: never cached
            weighted = {"weighted_mask": self._weighted_mask}
            scan = scan_dataset(data, **weighted) if direct else cached_scan(data, cache_dir, **weighted)
            self._eval_data[name] = (data, scan)
        return self._eval_data[name]

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the data needs, ``pad_token_id`` included (linked to the model's by the CLI)."""
        if self._stream is not None:
            value = getattr(self._stream, "vocab_size", None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(
                    f"the stream {type(self._stream).__name__} has no vocab_size (a stream is never scanned): pass "
                    "vocab_size= to the stream source, or set the model's vocab_size yourself"
                )
            return max(value, self.hparams.pad_token_id + 1)
        data = self.dataset
        for owner in (data, getattr(data, "config", None)):
            value = getattr(owner, "vocab_size", None)
            if isinstance(value, int) and not isinstance(value, bool):
                return max(value, self.hparams.pad_token_id + 1)
        top = max([self._scan().max_id] + [self._eval_file(name)[1].max_id for name in self._eval_files])
        return max(top, self.hparams.pad_token_id) + 1

    def prepare_data(self) -> None:
        """Validate the samples and compute (and cache, with ``cache_dir``) the lengths once per process."""
        if self._stream is None:  # a stream is validated window by window as it is read
            self._scan()
        for name in self._eval_files:
            self._eval_file(name)

    def _scan(self) -> DataScan:
        """Every sample validated once (:mod:`~lit_seqpack.data.validation`), with its lengths and loss tokens."""
        if self._data_scan is None:
            data, cache_dir = self.dataset, self.hparams.cache_dir
            exact = isinstance(data, (TokenizedDataset, SyntheticInstructionDataset))  # lengths free, never cached
            weighted = {"weighted_mask": self._weighted_mask}
            direct = cache_dir is None or exact
            scan = scan_dataset(data, **weighted) if direct else cached_scan(data, cache_dir, **weighted)
            # kept for the module's lifetime: 4 bytes a sample for each array, not 8
            self._data_scan = dataclasses.replace(
                scan, lengths=_int32(scan.lengths), loss_tokens=_int32(scan.loss_tokens)
            )
        return self._data_scan

    def _lengths(self) -> tuple[np.ndarray, np.ndarray]:
        scan = self._scan()
        return scan.lengths, scan.loss_tokens

    def _check_model_vocab(self) -> None:
        """Fail at setup when a data id or the pad id is outside the vocabulary of the Trainer's model."""
        from lit_seqpack.model.vocab import model_vocab_size  # the model's side of the check, read at setup only

        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        vocab = None if model is None else model_vocab_size(model)
        check_vocab_range(self._scan(), vocab_size=vocab, pad_token_id=self.hparams.pad_token_id)

    def attach_fabric(self, fabric: Any, *, accumulate_grad_batches: int = 1) -> None:
        """Plan for a Lightning Fabric loop: world size, rank (or device mesh) from ``fabric``, and its accumulation.

        Outside a Trainer nothing else tells the DataModule how many microbatches an optimizer step holds; a plan
        made for another accumulation than the loop's would normalise the exact loss over the wrong step. Check
        the loop with :class:`~lit_seqpack.model.fabric.FabricAccumulation` (see ``examples/fabric_loop.py``).

        Args:
            fabric: the launched ``lightning.fabric.Fabric``.
            accumulate_grad_batches: microbatches per rank per optimizer step of the loop.
        """
        self._fabric = (fabric, check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1))

    def setup(self, stage: str | None = None) -> None:
        """Read world size, rank and accumulation from the Trainer; apply the over-long policy; split."""
        fabric, accumulate = self._fabric if self._fabric is not None else (None, 1)
        self._layout, self._cp_rank = read_layout(
            self.trainer, self._parallel, fabric=fabric, accumulate_grad_batches=accumulate
        )
        if self._splits or self._stream is not None:
            return
        hp = self.hparams
        if len(self.dataset) == 0:
            raise ValueError("the dataset is empty: there is nothing to train on")
        lengths, loss_tokens = self._lengths()
        self._check_model_vocab()
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            raise ValueError(
                f"sample {int(empty[0])} of the dataset has no token ({empty.size} such samples): input_ids must "
                "hold at least one token; remove empty samples from the dataset"
            )
        data = self.dataset
        if hp.max_tokens is not None:
            data, lengths, loss_tokens, self.overlong_report = apply_document_budget(
                data,
                lengths,
                loss_tokens,
                max_tokens=hp.max_tokens,
                mode=hp.mode,
                overlong=hp.overlong,
                pad_to_multiple_of=hp.pad_to_multiple_of,
                document_multiple=self.document_multiple,
                token_fields=tuple(self._token_fields),
            )
        lengths, loss_tokens = _int32(lengths), _int32(loss_tokens)
        self._setup_eval_files()
        if hp.val_fraction == 0 and hp.test_fraction == 0:  # everything trains: no index view, no copies
            self._splits["train"] = Split(data, lengths, loss_tokens)
            return
        parts = split_indices(len(data), hp.val_fraction, seed=hp.seed, test_fraction=hp.test_fraction)
        for name, idx in zip(("train", "val", "test"), parts, strict=True):
            if name == "train" or len(idx):
                self._splits[name] = Split(IndexView(data, idx), lengths[idx], loss_tokens[idx])

    def _setup_eval_files(self) -> None:
        """The ``val_path`` / ``test_path`` splits, validated and under the training document budget."""
        from lit_seqpack.model.vocab import model_vocab_size  # the model's side of the check, read at setup only

        hp, model = self.hparams, getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        for name in self._eval_files:
            data, scan = self._eval_file(name)
            split, report = eval_split(
                data,
                scan,
                name=name,
                model_vocab=None if model is None else model_vocab_size(model),
                pad_token_id=hp.pad_token_id,
                max_tokens=hp.max_tokens,
                mode=hp.mode,
                overlong=hp.overlong,
                pad_to_multiple_of=hp.pad_to_multiple_of,
                document_multiple=self.document_multiple,
                token_fields=tuple(self._token_fields),
            )
            self._splits[name] = Split(split.dataset, _int32(split.lengths), _int32(split.loss_tokens))
            self.eval_overlong_reports[name] = report

    @property
    def splits(self) -> dict[str, Split]:
        """``train`` (``val``, ``test`` when held out): each split's dataset view, lengths and loss tokens."""
        if not self._splits:
            self.setup()
        return dict(self._splits)

    # ------------------------------------------------------------------ loaders
    def plan_config(self, *, world_size: int, accumulate_grad_batches: int, train: bool = True) -> PlanConfig:
        """The planner configuration of this DataModule's settings for a layout (``train=False``: no shuffle).

        Args:
            world_size: data-parallel ranks.
            accumulate_grad_batches: microbatches per rank per optimizer step.
            train: plan the training split (shuffled when ``shuffle``) rather than an evaluation split (planned with
                :attr:`eval_max_tokens`).
        """
        hp = self.hparams
        packing = hp.mode == "packing"
        budget = hp.max_tokens if train else self.eval_max_tokens
        return PlanConfig(
            mode=hp.mode,
            max_tokens=budget if hp.mode != "padded" else None,
            algorithm=hp.algorithm if packing else None,
            window=hp.window,
            sequence_length_round=self.row_multiple,
            batch_size=hp.batch_size,
            world_size=world_size,
            accumulate_grad_batches=accumulate_grad_batches,
            seed=hp.seed,
            shuffle=hp.shuffle and train,
            microbatch_order=hp.microbatch_order,
            cost_quadratic=hp.cost_quadratic,
        )

    def _collator(self) -> PackedCollator | PaddedCollator | ContextParallelCollator | TensorParallelCollator:
        hp, tp = self.hparams, self._parallel.tensor_parallel_size
        fields = {
            "token_fields": self._token_fields,
            "sample_fields": self._sample_fields,
            "loss_weight_field": hp.loss_weight_field,
        }
        if hp.mode != "packing":
            padded = PaddedCollator(pad_token_id=hp.pad_token_id, pad_to_multiple_of=self.row_multiple, **fields)
            return padded if tp == 1 else TensorParallelCollator(collator=padded, tensor_parallel_size=tp)
        collator = PackedCollator(
            pad_token_id=hp.pad_token_id,
            pad_to_multiple_of=self.row_multiple,
            pad_document_to_multiple_of=self.document_multiple if self.document_multiple > 1 else None,
            **fields,
        )
        if self._parallel.model_parallel_size == 1:
            return collator
        if self._parallel.context_parallel_size == 1:  # sequence parallelism splits the row, not each document
            return TensorParallelCollator(collator=collator, tensor_parallel_size=tp)
        return ContextParallelCollator(
            collator=collator,
            context_parallel_size=self._parallel.context_parallel_size,
            context_parallel_rank=self._cp_rank,
            tensor_parallel_size=self._parallel.tensor_parallel_size,
        )

    def _loader(self, split: str) -> StatefulDataLoader:
        if not self._splits:
            self.setup("fit")
        if split not in self._splits:
            raise ValueError(
                f"no {split!r} data: set {split}_fraction > 0 to hold out {split} samples, or {split}_path to read them"
            )
        data, lengths, loss_tokens = self._splits[split]
        world, rank, accumulate = self._layout
        train = split == "train"
        config = self.plan_config(world_size=world, accumulate_grad_batches=accumulate if train else 1, train=train)
        planned = planned_lengths(lengths, self.document_multiple) if self.hparams.mode == "packing" else lengths
        count = self.hparams.content_check_samples
        content = functools.partial(content_digest, data, count, self.hparams.seed) if count else None
        sampler = _SAMPLERS[self.hparams.mode].from_config(
            planned, config, rank=rank, loss_tokens=loss_tokens, content_digest=content
        )
        if train:
            self._train_sampler = sampler
            if self.trainer is not None:
                # Lightning builds the iterator (and workers start fetching) before it calls set_epoch, and
                # skips the loader state when resuming from an end-of-epoch checkpoint (Lightning #21938):
                # set the epoch here so the first epoch after a resume is planned for the right epoch.
                sampler.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
            sampler.set_start_source(self._training_start)
        loader = ResumableDataLoader(
            PlannedDataset(data),
            batch_sampler=with_step_loss_weights(sampler, data, self.hparams.loss_weight_field),
            collate_fn=self._collator(),
            num_workers=self.hparams.num_workers,
        )
        if train:
            self._train_loader = loader
            if self._pending_loader_state is not None:  # see load_state_dict
                loader.load_state_dict(self._pending_loader_state)
                self._pending_loader_state = None
        return loader

    def _training_start(self, epoch: int, start: int) -> tuple[int, int]:
        """Where an iteration of the training sampler starts: the Trainer's epoch and batch counter (fit only)."""
        trainer = self.trainer
        if not getattr(trainer, "training", False):  # outside fit (or a stand-in trainer): the sampler's own
            return epoch, start
        loop = trainer.fit_loop
        saved, self._resume_point = self._resume_point, None
        return check_start(
            trainer_epoch=loop.epoch_progress.current.processed,
            trainer_position=loop.epoch_loop.batch_progress.current.ready,
            saved=saved,
            accumulate=self._layout[2],
            rewind=lambda microbatches: rewind_fit_loop(loop, microbatches),
        )

    def train_dataloader(self) -> StatefulDataLoader:
        """The training loader: a stateful DataLoader over this rank's planned microbatches."""
        if self._stream is not None:
            if self.trainer is None:
                self.setup("fit")
            return build_stream_loader(self)
        return self._loader("train")

    def val_dataloader(self) -> StatefulDataLoader | list:
        """The validation loader (same mode, no shuffle, no accumulation, ``eval_max_tokens``), or none without
        ``val_fraction`` / ``val_path``.

        A validation split without a single loss token (every label -100) would log ``val/loss = nan``: it is
        skipped with a warning instead.
        """
        if self._stream is not None:
            return []
        if not self._splits:
            self.setup("validate")
        if "val" not in self._splits:
            return []
        val = self._splits["val"]
        if int(val.loss_tokens.sum()) == 0:
            rank_zero_warn(
                f"lit_seqpack: the validation split ({len(val.lengths)} samples) has no loss token (every label is "
                "-100 after the first token of each sample), so val/loss would be NaN; validation is skipped. Raise "
                "val_fraction (or check the val_path data) or check the labels / loss_mask of the data"
            )
            return []
        return self._loader("val")

    def test_dataloader(self) -> StatefulDataLoader:
        """The test loader (same mode, no shuffle, no accumulation, ``eval_max_tokens``); needs ``test_fraction > 0``
        or ``test_path``."""
        if self._stream is not None:
            raise ValueError(
                "a stream has no test split (test_fraction and test_path are refused with stream=...): test on an "
                "indexed dataset with a second SeqPackDataModule (path=... or dataset=...) passed to trainer.test"
            )
        return self._loader("test")

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What a resume must agree with (the data and the distributed layout), and the training loader's state."""
        if self._stream is not None:
            return {STREAM_STATE: stream_state(self)}
        state = self._layout_state()
        state[PLAN_STATE] = self._plan_settings()
        if self._train_loader is not None:
            state[LOADER_STATE] = self._train_loader.state_dict()
        return state

    def _layout_state(self) -> dict[str, Any]:
        world, _, accumulate = self._layout
        return layout_state(
            num_samples=len(self.dataset),
            train=self._splits.get("train"),
            world_size=world,
            context_parallel_size=self._parallel.context_parallel_size,
            tensor_parallel_size=self._parallel.tensor_parallel_size,
            accumulate_grad_batches=accumulate,
            mode=self.hparams.mode,
            max_tokens=self.hparams.max_tokens,
        )

    def _plan_settings(self) -> dict[str, Any]:
        world, _, accumulate = self._layout
        settings = plan_settings(self.plan_config(world_size=world, accumulate_grad_batches=accumulate))
        return settings | {"pad_to_multiple_of": self.hparams.pad_to_multiple_of}  # the lengths the planner sees

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume on other data, another layout or (mid-epoch) other plan settings; restore the loader.

        Only ``fit`` resumes training; ``validate`` and ``test`` from a checkpoint ignore this state.

        The training loader's state is applied whenever it arrives. DDP restores the DataModule before the loader
        is built, FSDP, ModelParallel and DeepSpeed after it (and Lightning's own copy of the loader state is
        dropped when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``, Lightning #20550). A
        state that arrives first is applied to the next training loader built; one that arrives late is loaded
        into the live loader, whose iterator only starts at its first batch. Either way the first training batch
        starts where the Trainer's loop counter stands, checked against the checkpoint's loader position
        (:func:`~lit_seqpack.data._resume.check_start`).
        """
        trainer = self.trainer
        if trainer is not None and trainer.state.fn is not None and trainer.state.fn != "fit":
            return  # validate / test only read the weights: any data layout may evaluate a checkpoint
        if self._stream is not None:
            load_stream_state(self, state_dict.get(STREAM_STATE))
            return
        loader_state, self._resume_point = check_resume(state_dict, self._layout_state(), self._plan_settings())
        if loader_state is not None and self._train_loader is not None:
            self._train_loader.load_state_dict(loader_state)  # restored after the loader was built
        else:
            self._pending_loader_state = loader_state
