"""``IndexedPipeline``: a map-style source under the batching settings, scanned, split, planned and resumable.

The DataModule builds it for an :class:`~lit_seqpack.data.sources.base.IndexedSource` (or any map-style dataset)
and delegates every hook to it:

1. ``prepare``: every sample validated once, lengths and loss tokens computed (cached with ``cache_dir``);
2. ``setup``: the layout read from the Trainer, the over-long policy applied, the held-out splits made;
3. ``train_loader`` / ``eval_loader``: a rank's planned batch sampler in a resumable ``StatefulDataLoader``;
4. ``state_dict`` / ``load_state_dict``: the facts a resume must agree with and the loader's position.

Datasets whose samples change between epochs (``lengths_change_per_epoch = True``): what they need to be re-planned.

Such a dataset (augmentation, a prompt that grows, a file re-tokenised between epochs) is re-scanned at the start of
every epoch (:meth:`~lit_seqpack.data.indexed.pipeline.IndexedPipeline.train_loader`) and planned again on its new
lengths. The new plan has its own number of microbatches, which Lightning only reads from a rebuilt loader, and the
over-long policy must keep every sample, or the samples trained would change from epoch to epoch.

Evaluation data of the DataModule: validation / test files (or ``DatasetDict`` splits) and their token budget.

Validation and test samples come either from the training data (``val_fraction`` / ``test_fraction``, held out by
:func:`~lit_seqpack.data.indexed.splits.split_indices`), from a source of their own (``val_source`` /
``test_source``), or from the training source's own split (a file source's ``val_path`` / ``val_split``). Two ways
for one split at once is an error, and so is evaluating on the very samples that train.

Evaluation has no gradients, so its microbatches may hold more tokens: ``eval_max_tokens`` (default:
``max_tokens``) is the budget the validation and test samplers plan with. Documents keep the training budget
(``max_tokens`` and the over-long policy), so every document evaluated is one the model could have trained on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn

from lit_seqpack._hashing import content_digest
from lit_seqpack.data._trainer import read_layout, training_start
from lit_seqpack.data.batching.loss_weights import with_step_loss_weights
from lit_seqpack.data.batching.overlong import OverlongReport, SplitDataset
from lit_seqpack.data.indexed._loader import ResumableDataLoader
from lit_seqpack.data.indexed._resume import LOADER_STATE, PLAN_STATE, check_resume, layout_state, plan_settings
from lit_seqpack.data.indexed.lengths import cached_scan
from lit_seqpack.data.indexed.planned_sampler import IndexedCollator, PlannedBatchSampler, PlannedDataset
from lit_seqpack.data.indexed.splits import EVAL_SPLITS, IndexView, Split, read_sample, split_indices
from lit_seqpack.data.indexed.validation import DataScan, check_vocab_range, scan_dataset
from lit_seqpack.data.settings import BatchingSettings, apply_document_budget, budget_note, planned_lengths
from lit_seqpack.data.sources.base import (
    IndexedSource,
    declared_counts,
    declared_fingerprint,
    lengths_change_per_epoch,
    source_splits,
)
from lit_seqpack.data.sources.files import FileSource
from lit_seqpack.parallel import DataParallelLayout

__all__ = ["IndexedPipeline", "check_changing_lengths"]


Dataset = Sequence[Mapping[str, Any]]


def _longest(lengths: np.ndarray, settings: BatchingSettings, data: Any = None) -> tuple[int, int, str]:
    """A split's longest sample ``(tokens, index)`` and the over-long summary of its samples past the budget (naming
    the first one's file and line when ``data`` can, through its ``sample_where``)."""
    settings_budget = settings.document_budget
    budget = settings_budget if settings_budget is not None else int(lengths.max())
    over = np.flatnonzero(lengths > budget)
    report = OverlongReport(
        policy=settings.overlong,
        max_tokens=int(settings.max_tokens or budget),
        num_samples=len(lengths),
        num_overlong=len(over),
        indices=tuple(int(i) for i in over[:5]),
        lengths=tuple(int(lengths[i]) for i in over[:5]),
    )
    summary = report.summary()
    where = getattr(data, "sample_where", None)
    if len(over) and callable(where):
        summary += f" ({where(int(over[0]))} is the first)"
    if settings.max_tokens is not None and budget < settings.max_tokens:
        pads = {"pad_to_multiple_of": settings.pad_to_multiple_of, "document_multiple": settings.document_multiple}
        summary += f" ({budget_note(settings.max_tokens, budget, **pads)})"
    return int(lengths.max()), int(lengths.argmax()), summary


def _overfits(trainer: Any) -> bool:
    """Whether the Trainer runs with ``overfit_batches`` (it then trains the same first microbatches every epoch)."""
    value = getattr(trainer, "overfit_batches", 0)
    return isinstance(value, (int, float)) and value > 0


def _int32(counts: np.ndarray) -> np.ndarray:
    """Token counts in 4 bytes a sample when they fit (they always do below 2^31 tokens a sample)."""
    fits = counts.size == 0 or int(counts.max()) < 1 << 31
    return counts.astype(np.int32, copy=False) if fits else counts


def _split_samples(data: Any) -> int:
    """The samples of a training split under ``overlong="split"`` (its pieces' samples counted once)."""
    view = data.dataset if isinstance(data, IndexView) else data
    if not isinstance(view, SplitDataset):
        return len(data)
    pieces = view.piece_indices if not isinstance(data, IndexView) else view.piece_indices[data.indices]
    return int(np.count_nonzero(pieces == 0))


class IndexedPipeline:
    """Map-style data planned for every rank: the training split and the validation and test splits.

    Args:
        settings: the batching settings.
        source: the training source (its ``"val"`` / ``"test"`` splits too, when it holds them).
        val_source: a source whose samples validate (instead of ``val_fraction`` or the source's own val split).
        test_source: a source whose samples test.
        predict_source: a source whose samples ``trainer.predict`` scores (default: every training sample).

    Raises:
        ValueError: two settings choose the same evaluation split, or ``loss_weight_field="loss_mask"`` with a file
            source (its reader turns ``loss_mask`` into labels).
    """

    def __init__(
        self,
        settings: BatchingSettings,
        source: IndexedSource,
        *,
        val_source: IndexedSource | None = None,
        test_source: IndexedSource | None = None,
        predict_source: IndexedSource | None = None,
    ) -> None:
        if settings.loss_weight_field == "loss_mask" and isinstance(source, FileSource):
            raise ValueError(
                f"loss_weight_field='loss_mask' is not supported with {type(source).__name__}: the file reader turns "
                "loss_mask into labels when it loads the data, so its weights would be lost. Store the weights in a "
                "field of their own and declare it (token_fields={'weights': 0.0}, loss_weight_field='weights')"
            )
        fractions = {"val": settings.val_fraction, "test": settings.test_fraction}
        self.eval_sources = eval_sources(source, {"val": val_source, "test": test_source}, fractions)
        self.settings, self.source, self.predict_source = settings, source, predict_source
        self._predict: Split | None = None
        self.layout, self.context_parallel_rank = DataParallelLayout(), 0
        self.trainer: Any = None
        self.is_set_up = False
        self.overlong_report: OverlongReport | None = None
        self.eval_overlong_reports: dict[str, OverlongReport | None] = {}
        self.splits: dict[str, Split] = {}
        self._dataset: Dataset | None = None
        self._scan: DataScan | None = None
        self._eval_data: dict[str, tuple[Dataset, DataScan]] = {}
        self.train_sampler: PlannedBatchSampler | None = None
        self._train_loader: ResumableDataLoader | None = None
        self._pending_state: dict[str, Any] | None = None
        self._resume_point: tuple[int, int] | None = None  # (epoch, microbatch) of the restored loader state
        self._scanned_epoch = 0  # the epoch whose samples the splits were made from (see lengths_change_per_epoch)
        self._layout_changes = ""  # the layout settings a checkpoint restored at an epoch boundary had otherwise

    # ------------------------------------------------------------------ data
    def _load(self, source: IndexedSource, split: str) -> Dataset:
        fields = {"token_fields": tuple(self.settings.token_fields), "sample_fields": self.settings.sample_fields}
        data = source.load(split, **fields)
        if data is None:
            raise ValueError(f"{type(source).__name__} holds no {split!r} split")
        return data

    @property
    def dataset(self) -> Dataset:
        """The whole training dataset (before the over-long policy and the held-out split)."""
        if self._dataset is None:
            self._dataset = self._load(self.source, "train")
        return self._dataset

    def scan(self) -> DataScan:
        """Every training sample validated once (:mod:`~lit_seqpack.data.indexed.validation`), with its counts."""
        if self._scan is None:
            scan = self._scan_data(self.dataset)
            # kept for the pipeline's lifetime: 4 bytes a sample for each array, not 8
            self._scan = dataclasses.replace(scan, lengths=_int32(scan.lengths), loss_tokens=_int32(scan.loss_tokens))
        return self._scan

    def _scan_data(self, data: Dataset) -> DataScan:
        cache_dir, weighted = self.settings.cache_dir, {"weighted_mask": self.settings.loss_weight_field == "loss_mask"}
        exact = declared_counts(data, "lengths") is not None and declared_counts(data, "loss_tokens") is not None
        # declared counts are free, and samples that change per epoch would make any cache stale: never cached
        if cache_dir is None or exact or lengths_change_per_epoch(data):
            return scan_dataset(data, **weighted)
        if declared_fingerprint(data) is None:
            raise ValueError(
                f"cache_dir={cache_dir!r} caches the lengths of a dataset under its content identity, but "
                f"{type(data).__name__} declares no 'fingerprint': give the dataset a fingerprint attribute (a str "
                "that changes whenever its samples change, e.g. a hash of its files and preprocessing version), or "
                "leave cache_dir unset (the lengths are then computed at every setup)"
            )
        return cached_scan(data, cache_dir, **weighted)

    def eval_data(self, name: str) -> tuple[Dataset, DataScan]:
        """The dataset of evaluation split ``name`` read from its own source, and its validation pass (once)."""
        if name not in self._eval_data:
            source, split = self.eval_sources[name]
            data = self._load(source, split)
            self._eval_data[name] = (data, self._scan_data(data))
        return self._eval_data[name]

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the data needs, ``pad_token_id`` included: declared by the dataset, else scanned."""
        pad = self.settings.pad_token_id
        data = self.dataset
        for owner in (data, getattr(data, "config", None)):
            value = getattr(owner, "vocab_size", None)
            if isinstance(value, int) and not isinstance(value, bool):
                return max(value, pad + 1)
        top = max([self.scan().max_id] + [self.eval_data(name)[1].max_id for name in self.eval_sources])
        return max(top, pad) + 1

    def prepare(self) -> None:
        """Validate the samples and compute (and cache, with ``cache_dir``) the lengths once per process."""
        self.scan()
        for name in self.eval_sources:
            self.eval_data(name)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Any, *, fabric: Any = None, accumulate_grad_batches: int = 1) -> None:
        """Read the layout from the Trainer (or Fabric); apply the over-long policy; make the splits (once)."""
        self.trainer = trainer
        self.layout, self.context_parallel_rank = read_layout(
            trainer, self.settings.parallel, fabric=fabric, accumulate_grad_batches=accumulate_grad_batches
        )
        if not self.splits:
            check_changing_lengths(self.dataset, overlong=self.settings.overlong, trainer=trainer)
            self._make_splits()
            self._check_trainable()
        self.is_set_up = True

    def _rescan(self, epoch: int) -> None:
        """Re-scan a dataset that declares ``lengths_change_per_epoch`` for ``epoch`` and make its splits again."""
        if not lengths_change_per_epoch(self.dataset) or epoch == self._scanned_epoch:
            return
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._scan, self.splits = None, {}
        self._make_splits()
        self._check_trainable()
        self._scanned_epoch = epoch

    def _check_trainable(self) -> None:
        """Refuse a training split without a single loss token: it would train at loss 0 while weight decay moves."""
        train = self.splits["train"]
        if len(train.lengths) and int(train.loss_tokens.sum()) == 0:
            raise ValueError(
                f"the training split ({len(train.lengths)} samples of {type(self.source).__name__}) has no loss "
                "token: every label is -100 (or every loss_mask 0) after the first token of each sample, so training "
                "would run at loss 0 while weight decay still moves the weights. Check the labels / loss_mask of the "
                "data (a chat template whose assistant turns were not found, a prompt mask that covers everything)"
            )

    def _make_splits(self) -> None:
        """Validate the training data, apply the over-long policy and hold out the evaluation splits."""
        settings = self.settings
        if len(self.dataset) == 0:
            raise ValueError("the dataset is empty: there is nothing to train on")
        scan = self.scan()
        check_vocab_range(scan, vocab_size=self._model_vocab(), pad_token_id=settings.pad_token_id)
        lengths, loss_tokens = scan.lengths, scan.loss_tokens
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            raise ValueError(
                f"sample {int(empty[0])} of the dataset has no token ({empty.size} such samples): input_ids must "
                "hold at least one token; remove empty samples from the dataset"
            )
        self._check_lengths(lengths)
        data = self.dataset
        if settings.max_tokens is not None:
            data, lengths, loss_tokens, self.overlong_report = apply_document_budget(
                data, lengths, loss_tokens, **self._budget()
            )
        lengths, loss_tokens = _int32(lengths), _int32(loss_tokens)
        self._setup_eval_data()
        if settings.val_fraction == 0 and settings.test_fraction == 0:  # everything trains: no index view
            self.splits["train"] = Split(data, lengths, loss_tokens)
            return
        parts = split_indices(
            len(self.dataset) if isinstance(data, SplitDataset) else len(data),
            settings.val_fraction,
            seed=settings.seed,
            test_fraction=settings.test_fraction,
        )
        if isinstance(data, SplitDataset):  # held out by sample: every piece of a sample in the same split
            parts = tuple(np.flatnonzero(np.isin(data.original_indices, idx)) for idx in parts)
        for name, idx in zip(("train", "val", "test"), parts, strict=True):
            if name == "train" or len(idx):
                self.splits[name] = Split(IndexView(data, idx), lengths[idx], loss_tokens[idx])

    def _check_lengths(self, lengths: np.ndarray) -> None:
        """One error for every length setting at once (budgets, over-long policy, the model's ``max_seq_len``),
        from the lengths already scanned, before any split applies a budget of its own."""
        splits = {"train": (self.dataset, lengths)}
        splits.update({name: (self.eval_data(name)[0], self.eval_data(name)[1].lengths) for name in self.eval_sources})
        longest = {name: _longest(v, self.settings, data) for name, (data, v) in splits.items() if len(v)}
        from lit_seqpack.model.hf_load import model_max_seq_len  # the model's side, read at setup only

        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        message = self.settings.length_conflict(longest, None if model is None else model_max_seq_len(model))
        if message is not None:
            raise ValueError(message)

    def _budget(self) -> dict[str, Any]:
        """The settings of the over-long policy at the document budget."""
        settings = self.settings
        return {
            "max_tokens": settings.max_tokens,
            "mode": settings.mode,
            "overlong": settings.overlong,
            "pad_to_multiple_of": settings.pad_to_multiple_of,
            "document_multiple": settings.document_multiple,
            "token_fields": tuple(settings.token_fields),
            "truncation_side": settings.truncation_side,
        }

    def _setup_eval_data(self) -> None:
        """The splits read from their own sources, validated and under the training document budget."""
        for name in self.eval_sources:
            data, scan = self.eval_data(name)
            budget = self._budget() if self.settings.max_tokens is not None else {"max_tokens": None}
            split, report = eval_split(
                data,
                scan,
                name=name,
                model_vocab=self._model_vocab(),
                pad_token_id=self.settings.pad_token_id,
                **budget,
            )
            self.splits[name] = Split(split.dataset, _int32(split.lengths), _int32(split.loss_tokens))
            self.eval_overlong_reports[name] = report

    def _model_vocab(self) -> int | None:
        from lit_seqpack.model.hf_load import model_vocab_size  # the model's side of the check, read at setup only

        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return None if model is None else model_vocab_size(model)

    # ------------------------------------------------------------------ loaders
    def train_loader(self) -> ResumableDataLoader:
        """The training loader: a stateful DataLoader over this rank's planned microbatches.

        A dataset that declares ``lengths_change_per_epoch`` is re-scanned first when the epoch changed.
        """
        if self.trainer is not None:
            self._rescan(self.trainer.fit_loop.epoch_progress.current.processed)
        return self._loader("train")

    def eval_loader(self, split: str) -> ResumableDataLoader | list:
        """The validation or test loader (no shuffle, no accumulation, ``eval_max_tokens``).

        Without validation data there is no validation loader (``[]``); a validation split without a single loss
        token (``val/loss`` would be NaN) is skipped with a warning.
        """
        if split == "val":
            if "val" not in self.splits:
                return []
            val = self.splits["val"]
            if int(val.loss_tokens.sum()) == 0:
                rank_zero_warn(
                    f"lit_seqpack: the validation split ({len(val.lengths)} samples) has no loss token (every label "
                    "is -100 after the first token of each sample), so val/loss would be NaN; validation is skipped. "
                    "Raise val_fraction (or check the val_source data) or check the labels / loss_mask of the data"
                )
                return []
        return self._loader(split)

    def predict_loader(self) -> ResumableDataLoader:
        """The predict loader: every predict sample once over the ranks, planned like evaluation, and each batch's
        ``sample_index`` (:class:`~lit_seqpack.data.indexed.planned_sampler.IndexedCollator`).

        Raises:
            ValueError: context or tensor parallelism (every rank of a group would score the same samples).
        """
        settings = self.settings
        if settings.parallel.model_parallel_size > 1:
            raise ValueError(
                f"trainer.predict supports data parallelism only, got context_parallel_size="
                f"{settings.context_parallel_size}, tensor_parallel_size={settings.tensor_parallel_size}: predict "
                "with both at 1 (each rank scores its own share of the samples)"
            )
        self._predict_split()
        return self._loader("predict")

    def _predict_split(self) -> Split:
        """The predict samples under the training over-long policy (once): the predict source's, or the whole
        training dataset (held-out samples included), with the report of what the policy did."""
        if self._predict is None:
            if self.predict_source is None:
                data, scan = self.dataset, self.scan()
            else:
                data = self._load(self.predict_source, "train")
                scan = self._scan_data(data)
            budget = self._budget() if self.settings.max_tokens is not None else {"max_tokens": None}
            split, report = eval_split(
                data,
                scan,
                name="predict",
                model_vocab=self._model_vocab(),
                pad_token_id=self.settings.pad_token_id,
                **budget,
            )
            self._predict = Split(split.dataset, _int32(split.lengths), _int32(split.loss_tokens))
            self.eval_overlong_reports["predict"] = report
            if report is not None and report.num_dropped:
                rank_zero_warn(
                    f"lit_seqpack: predict: {report.summary()}; those samples get no prediction (their indices are "
                    "missing from the output): use overlong='truncate' to score their first max_tokens tokens"
                )
        return self._predict

    def _loader(self, split: str) -> ResumableDataLoader:
        if split != "predict" and split not in self.splits:
            raise ValueError(
                f"no {split!r} data: set {split}_fraction > 0 to hold out {split} samples, or {split}_source to read "
                "them"
            )
        settings = self.settings
        data, lengths, loss_tokens = self._predict_split() if split == "predict" else self.splits[split]
        train = split == "train"
        config = settings.plan_config(self.layout, train=train)
        overfit = train and _overfits(self.trainer)
        if overfit:  # the same microbatches every epoch: epoch 0's, unshuffled
            config = dataclasses.replace(config, shuffle=False)
        planned = planned_lengths(lengths, settings.document_multiple) if settings.mode == "packing" else lengths
        count = settings.content_check_samples
        content = functools.partial(content_digest, data, count, settings.seed, read=read_sample) if count else None
        sampler = PlannedBatchSampler(
            planned, config, rank=self.layout.rank, loss_tokens=loss_tokens, content_digest=content
        )
        if train:
            self.train_sampler = sampler
            if self.trainer is not None:
                # Lightning builds the iterator (and workers start fetching) before it calls set_epoch, and
                # skips the loader state when resuming from an end-of-epoch checkpoint (Lightning #21938):
                # set the epoch here so the first epoch after a resume is planned for the right epoch.
                sampler.set_epoch(0 if overfit else self.trainer.fit_loop.epoch_progress.current.processed)
            sampler.set_start_source(self._overfit_start if overfit else self._training_start)
        collate = settings.collator(self.context_parallel_rank)
        loader = ResumableDataLoader(
            PlannedDataset(data),
            batch_sampler=with_step_loss_weights(sampler, data, settings.loss_weight_field),
            collate_fn=IndexedCollator(collate) if split == "predict" else collate,
            num_workers=settings.num_workers,
            name=split,
            loader_timeout=settings.loader_timeout,
        )
        if train:
            self._train_loader = loader
            if self._pending_state is not None:  # see load_state_dict
                loader.load_state_dict(self._pending_state)
                self._pending_state = None
        return loader

    def _overfit_start(self, epoch: int, start: int) -> tuple[int, int]:
        """Under ``Trainer(overfit_batches=N)``: every epoch plays epoch 0's plan from the Trainer's position."""
        return 0, self._training_start(epoch, start)[1]

    def _training_start(self, epoch: int, start: int) -> tuple[int, int]:
        """Where an iteration of the training sampler starts: the Trainer's epoch and batch counter (fit only)."""
        saved, self._resume_point = self._resume_point, None
        changes, self._layout_changes = self._layout_changes, ""
        epoch, start = training_start(self.trainer, epoch, start, saved, self.layout.accumulate_grad_batches)
        if changes and start:
            raise RuntimeError(
                f"cannot resume on another layout ({changes}) mid-epoch: the Trainer's loop resumes at epoch {epoch}, "
                f"microbatch {start}, and the rest of that epoch was planned for the checkpoint's layout. Resume with "
                "the checkpoint's values, or from a checkpoint written at an epoch boundary"
            )
        return epoch, start

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What a resume must agree with (the data and the distributed layout), and the training loader's state."""
        state = self._layout_state()
        state[PLAN_STATE] = self._plan_settings()
        if self._train_loader is not None:
            state[LOADER_STATE] = self._train_loader.state_dict()
        return state

    def _layout_state(self) -> dict[str, Any]:
        settings = self.settings
        state = layout_state(
            num_samples=len(self.dataset),
            train=self.splits.get("train"),
            world_size=self.layout.world_size,
            context_parallel_size=settings.context_parallel_size,
            tensor_parallel_size=settings.tensor_parallel_size,
            accumulate_grad_batches=self.layout.accumulate_grad_batches,
            mode=settings.mode,
            max_tokens=settings.max_tokens,
        )
        if lengths_change_per_epoch(self.dataset):  # re-scanned every epoch; each microbatch checks its lengths
            state["train_lengths"] = "re-scanned every epoch"
        train = self.splits.get("train")
        if train is not None and self.settings.overlong == "split":  # samples, not pieces: max_tokens may change
            state["num_train_samples"] = _split_samples(train.dataset)
        return state

    def _plan_settings(self) -> dict[str, Any]:
        settings = plan_settings(self.settings.plan_config(self.layout))
        settings["pad_to_multiple_of"] = self.settings.pad_to_multiple_of  # the lengths the planner sees
        if self.settings.truncation_side != "right":  # the tokens kept (older checkpoints hold no side)
            settings["truncation_side"] = self.settings.truncation_side
        return settings

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume on other data, or mid-epoch on another layout or other settings; restore the loader.

        At an epoch boundary the world size, ``accumulate_grad_batches`` and ``max_tokens`` may change: the next
        epoch is planned for the new layout (:func:`~lit_seqpack.data.indexed._resume.check_resume`).

        The training loader's state is applied whenever it arrives. DDP restores the DataModule before the loader
        is built, FSDP, ModelParallel and DeepSpeed after it. A state that arrives first is applied to the next
        training loader built; one that arrives late is loaded into the live loader, whose iterator only starts at
        its first batch. Either way the first training batch starts where the Trainer's loop counter stands,
        checked against the checkpoint's loader position (:func:`~lit_seqpack.data._trainer.check_start`).
        """
        loader_state, self._resume_point, self._layout_changes = check_resume(
            state_dict, self._layout_state(), self._plan_settings()
        )
        if loader_state is not None and self._train_loader is not None:
            self._train_loader.load_state_dict(loader_state)  # restored after the loader was built
        else:
            self._pending_state = loader_state


def check_changing_lengths(dataset: Any, *, overlong: str, trainer: Any) -> None:
    """Refuse the settings a dataset that declares ``lengths_change_per_epoch`` cannot be re-planned under.

    Args:
        dataset: the training dataset.
        overlong: the over-long policy (``"drop"`` is refused).
        trainer: the Lightning Trainer (``None``: not checked); its ``reload_dataloaders_every_n_epochs`` must be 1.

    Raises:
        ValueError: naming the setting and the value to use.
    """
    if not lengths_change_per_epoch(dataset):
        return
    name = type(dataset).__name__
    if overlong == "drop":
        raise ValueError(
            f"overlong='drop' cannot be used with {name}, which declares lengths_change_per_epoch=True: the samples "
            "dropped would change from epoch to epoch; use overlong='truncate' or 'error'"
        )
    reload = getattr(trainer, "reload_dataloaders_every_n_epochs", 1)
    if trainer is not None and reload != 1:
        raise ValueError(
            f"{name} declares lengths_change_per_epoch=True, so every epoch is re-planned with its own number of "
            "microbatches, which Lightning only reads from a rebuilt loader: set the Trainer's "
            f"reload_dataloaders_every_n_epochs=1 (got {reload})"
        )


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
        **budget_kwargs: the settings of :func:`~lit_seqpack.data.settings.apply_document_budget`
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
