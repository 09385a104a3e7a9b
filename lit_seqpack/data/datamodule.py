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

from lit_seqpack.data._budget import apply_document_budget, document_budget, planned_lengths
from lit_seqpack.data._hashing import content_digest
from lit_seqpack.data._knobs import check_knobs, check_parallel_knobs, check_setting_types
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
from lit_seqpack.data.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.context_parallel import ContextParallelCollator, ParallelLayout, TensorParallelCollator
from lit_seqpack.data.fields import check_fields
from lit_seqpack.data.lengths import cached_scan
from lit_seqpack.data.microbatch import PlannedDataset
from lit_seqpack.data.overlong import OVERLONG_POLICIES, OverlongReport
from lit_seqpack.data.samplers import DynamicBatchSampler, PackedBatchSampler, PaddedBatchSampler
from lit_seqpack.data.sources import TokenizedDataset
from lit_seqpack.data.sources_factory import SOURCES, build_dataset
from lit_seqpack.data.splits import IndexView, Split, split_indices
from lit_seqpack.data.synthetic import SyntheticInstructionDataset
from lit_seqpack.data.validation import DataScan, check_vocab_range, model_vocab_size, scan_dataset
from lit_seqpack.planning.plan import PlanConfig

if TYPE_CHECKING:
    from lit_seqpack.data._planned_sampler import PlannedBatchSampler

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
            ``"parquet"``, ``"hf_disk"`` (pre-tokenised) or ``"text"`` (raw text + local tokenizer).
        path: the file or folder of an on-disk source.
        synthetic: keyword arguments of :class:`~lit_seqpack.data.synthetic.SyntheticInstructionDataset`.
        tokenizer: path of a local Hugging Face tokenizer (``source="text"``).
        text_field: the JSONL field holding raw text (``source="text"``).
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
            datasets whose samples change between reads).
        token_fields: extra per-token fields of the samples to carry in every batch, each name mapped to its pad
            value (e.g. ``{"advantages": 0.0}``): concatenated or padded like ``input_ids``, truncated with the
            sample by ``overlong="truncate"``, sharded with the tokens under context parallelism (see
            :mod:`lit_seqpack.data.fields`).
        sample_fields: extra per-sample fields to carry (e.g. ``["reward"]``), one value a document.
    """

    def __init__(
        self,
        *,
        source: str = "synthetic",
        path: str | None = None,
        synthetic: dict[str, Any] | None = None,
        tokenizer: str | None = None,
        text_field: str = "text",
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
    ) -> None:
        super().__init__()
        if (
            isinstance(content_check_samples, bool)
            or not isinstance(content_check_samples, int)
            or content_check_samples < 0
        ):
            raise ValueError(f"content_check_samples must be an int >= 0, got {content_check_samples!r}")
        self.save_hyperparameters(ignore=["dataset"])
        if isinstance(max_tokens, str) and max_tokens == "auto":
            max_tokens = self.hparams.max_tokens = None if mode == "padded" else DEFAULT_MAX_TOKENS
        check_setting_types(
            source=source,
            sources=SOURCES,
            overlong=overlong,
            policies=OVERLONG_POLICIES,
            shuffle=shuffle,
            pad_token_id=pad_token_id,
            strings={"path?": path, "tokenizer?": tokenizer, "text_field": text_field, "cache_dir?": cache_dir},
            fractions={"val_fraction": val_fraction, "test_fraction": test_fraction},
        )
        check_knobs(
            mode=mode,
            modes=_SAMPLERS,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            num_workers=num_workers,
            pad_to_multiple_of=pad_to_multiple_of,
        )
        self._token_fields, self._sample_fields = check_fields(token_fields, sample_fields)
        self._parallel = ParallelLayout(
            context_parallel_size=context_parallel_size, tensor_parallel_size=tensor_parallel_size
        )
        check_parallel_knobs(self._parallel, mode, max_tokens, self.row_multiple)
        # Validate the plan knobs now (world size and accumulation are read from the Trainer in setup).
        self.plan_config(world_size=1, accumulate_grad_batches=1)
        if max_tokens is not None:
            document_budget(
                max_tokens, mode=mode, pad_to_multiple_of=pad_to_multiple_of, document_multiple=self.document_multiple
            )
        self._dataset = dataset
        self._data_scan: DataScan | None = None
        self.overlong_report: OverlongReport | None = None
        self._splits: dict[str, Split] = {}
        self._layout: tuple[int, int, int] = (1, 0, 1)  # data-parallel world size and rank, accumulation
        self._cp_rank = 0
        self._train_sampler: PlannedBatchSampler | None = None
        self._train_loader: StatefulDataLoader | None = None
        self._pending_loader_state: dict[str, Any] | None = None
        self._fabric: tuple[Any, int] | None = None
        self._resume_point: tuple[int, int] | None = None  # (epoch, microbatch) of the restored loader state

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
            self._dataset = build_dataset(
                hp.source, path=hp.path, synthetic=hp.synthetic, tokenizer=hp.tokenizer, text_field=hp.text_field
            )
        return self._dataset

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the data needs, ``pad_token_id`` included (linked to the model's by the CLI)."""
        data = self.dataset
        for owner in (data, getattr(data, "config", None)):
            value = getattr(owner, "vocab_size", None)
            if isinstance(value, int) and not isinstance(value, bool):
                return max(value, self.hparams.pad_token_id + 1)
        return max(self._scan().max_id, self.hparams.pad_token_id) + 1

    def prepare_data(self) -> None:
        """Validate the samples and compute (and cache, with ``cache_dir``) the lengths once per process."""
        self._scan()

    def _scan(self) -> DataScan:
        """Every sample validated once (:mod:`~lit_seqpack.data.validation`), with its lengths and loss tokens."""
        if self._data_scan is None:
            data, cache_dir = self.dataset, self.hparams.cache_dir
            exact = isinstance(data, (TokenizedDataset, SyntheticInstructionDataset))  # lengths free, never cached
            scan = scan_dataset(data) if cache_dir is None or exact else cached_scan(data, cache_dir)
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
        if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
            raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
        self._fabric = (fabric, accumulate_grad_batches)

    def setup(self, stage: str | None = None) -> None:
        """Read world size, rank and accumulation from the Trainer; apply the over-long policy; split."""
        fabric, accumulate = self._fabric if self._fabric is not None else (None, 1)
        self._layout, self._cp_rank = read_layout(
            self.trainer, self._parallel, fabric=fabric, accumulate_grad_batches=accumulate
        )
        if self._splits:
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
        if hp.val_fraction == 0 and hp.test_fraction == 0:  # everything trains: no index view, no copies
            self._splits["train"] = Split(data, lengths, loss_tokens)
            return
        parts = split_indices(len(data), hp.val_fraction, seed=hp.seed, test_fraction=hp.test_fraction)
        for name, idx in zip(("train", "val", "test"), parts, strict=True):
            if name == "train" or len(idx):
                self._splits[name] = Split(IndexView(data, idx), lengths[idx], loss_tokens[idx])

    @property
    def splits(self) -> dict[str, Split]:
        """``train`` (``val``, ``test`` when held out): each split's dataset view, lengths and loss tokens."""
        if not self._splits:
            self.setup()
        return dict(self._splits)

    # ------------------------------------------------------------------ loaders
    def plan_config(self, *, world_size: int, accumulate_grad_batches: int, train: bool = True) -> PlanConfig:
        """The planner configuration of this DataModule's knobs for a layout (``train=False``: no shuffle).

        Args:
            world_size: data-parallel ranks.
            accumulate_grad_batches: microbatches per rank per optimizer step.
            train: plan the training split (shuffled when ``shuffle``) rather than an evaluation split.
        """
        hp = self.hparams
        packing = hp.mode == "packing"
        return PlanConfig(
            mode=hp.mode,
            max_tokens=hp.max_tokens if hp.mode != "padded" else None,
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
        fields = {"token_fields": self._token_fields, "sample_fields": self._sample_fields}
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
            raise ValueError(f"no {split!r} data: set {split}_fraction > 0 to hold out {split} samples")
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
            batch_sampler=sampler,
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
        return self._loader("train")

    def val_dataloader(self) -> StatefulDataLoader | list:
        """The validation loader (same mode, no shuffle, no accumulation), or none without ``val_fraction``.

        A validation split without a single loss token (every label -100) would log ``val/loss = nan``: it is
        skipped with a warning instead.
        """
        if not self._splits:
            self.setup("validate")
        if "val" not in self._splits:
            return []
        val = self._splits["val"]
        if int(val.loss_tokens.sum()) == 0:
            rank_zero_warn(
                f"lit_seqpack: the validation split ({len(val.lengths)} samples) has no loss token (every label is "
                "-100 after the first token of each sample), so val/loss would be NaN; validation is skipped. Raise "
                "val_fraction or check the labels / loss_mask of the data"
            )
            return []
        return self._loader("val")

    def test_dataloader(self) -> StatefulDataLoader:
        """The test loader (same mode, no shuffle, no accumulation); needs ``test_fraction > 0``."""
        return self._loader("test")

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What a resume must agree with (the data and the distributed layout), and the training loader's state."""
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
        loader_state, self._resume_point = check_resume(state_dict, self._layout_state(), self._plan_settings())
        if loader_state is not None and self._train_loader is not None:
            self._train_loader.load_state_dict(loader_state)  # restored after the loader was built
        else:
            self._pending_loader_state = loader_state
