"""``SeqPackDataModule``: packed, dynamic or padded batches for one or many ranks, resumable mid-epoch.

A thin face over ONE pipeline: the sources say where samples come from
(:mod:`lit_seqpack.data.sources`), :class:`~lit_seqpack.data.settings.BatchingSettings` says how they become
microbatches, and the pipeline built for the source (:class:`~lit_seqpack.data.indexed.pipeline.IndexedPipeline`
for map-style data, :class:`~lit_seqpack.data.streaming.pipeline.StreamPipeline` for a stream) does the work every
Lightning hook delegates to it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset

from lit_seqpack._checks import check_int
from lit_seqpack.data.batching.overlong import OverlongReport, SplitDataset
from lit_seqpack.data.indexed.pipeline import IndexedPipeline
from lit_seqpack.data.indexed.splits import HeldOut, IndexView, Split, trained_in
from lit_seqpack.data.settings import BatchingSettings, Mode, StreamSplit
from lit_seqpack.data.sources.base import IndexedSource, resolve_source
from lit_seqpack.data.sources.streams import StreamSource
from lit_seqpack.data.streaming.pipeline import StreamPipeline
from lit_seqpack.parallel import DataParallelLayout
from lit_seqpack.planning.algorithms import DEFAULT_ALGORITHM
from lit_seqpack.planning.config import PlanConfig

__all__ = ["HELD_OUT_STATE", "TOKENIZER_STATE", "SeqPackDataModule", "Source"]

HELD_OUT_STATE = "held_out"
"""The key of the held-out split settings (:class:`~lit_seqpack.data.indexed.splits.HeldOut`) in the checkpoint state:
``validate`` and ``test`` refuse a split that holds samples the checkpoint trained on."""

TOKENIZER_STATE = "source_tokenizer"
"""The key of the source's tokenizer folder (absolute) in the DataModule's checkpoint state, when it has one."""

Source = str | IndexedSource | StreamSource | Dataset
"""What ``source=`` takes: a source object, a map-style dataset, or ``"synthetic"``. Any map-style dataset works at
run time (a list of dicts too); the hint names the classes that YAML's ``class_path`` picks from (a list there would
let jsonargparse read a misspelt ``init_args`` as inline data)."""


_PREDICT_SAMPLER_WARNING = r"You are using a custom batch sampler `PlannedBatchSampler` for prediction"
"""The start of Lightning's warning about a custom batch sampler in ``trainer.predict`` (a regex)."""


class SeqPackDataModule(LightningDataModule):
    """Token sequences batched by the lit_seqpack planner, for a ``Trainer`` with one or many ranks.

    The plan of every epoch is computed identically on every rank (no communication); each rank's batch sampler
    yields its own microbatches, the same number on every rank and per optimizer step, and carries the optimizer
    step's loss-token total so the model side normalises the loss exactly. The Trainer must run with
    ``use_distributed_sampler=False`` (the ``lit-seqpack`` CLI sets it).

    Args:
        source: where the training samples come from: ``"synthetic"`` (the embedded task), a source object
            (:class:`~lit_seqpack.data.sources.TokenizedSource`, :class:`~lit_seqpack.data.sources.TextSource`,
            :class:`~lit_seqpack.data.sources.ChatSource`, a stream such as
            :class:`~lit_seqpack.data.sources.JsonlStream`), or any map-style dataset whose items are dicts with
            ``input_ids`` (in YAML: ``class_path`` of your own ``torch.utils.data.Dataset``).
        val_source: a source whose samples validate (instead of ``val_fraction`` or the source's own val files).
        test_source: a source whose samples test (``lit-seqpack test`` / ``trainer.test``).
        predict_source: a source whose samples ``trainer.predict`` scores (``lit-seqpack predict``); default: every
            sample of ``source`` (held-out splits included) under the training over-long policy. Indexed only.
        **settings: the batching settings, each documented once on
            :class:`~lit_seqpack.data.settings.BatchingSettings` (``mode``, ``max_tokens``, ``window``, ...).

    Example:
        >>> data = SeqPackDataModule(mode="packing", max_tokens=512, val_fraction=0.1)
        >>> data.settings.max_tokens, data.settings.mode
        (512, 'packing')
    """

    def __init__(
        self,
        *,
        source: Source = "synthetic",
        val_source: Source | None = None,
        test_source: Source | None = None,
        predict_source: Source | None = None,
        mode: Mode = "packing",
        max_tokens: int | Literal["auto"] | None = "auto",
        eval_max_tokens: int | None = None,
        algorithm: str = DEFAULT_ALGORITHM,
        window: int | None = None,
        sequence_length_round: int = 1,
        pad_to_multiple_of: int = 1,
        microbatch_order: Literal["largest_first", "packer"] = "largest_first",
        cost_quadratic: float | Literal["auto"] = "auto",
        overlong: Literal["error", "truncate", "drop", "split"] = "error",
        truncation_side: Literal["right", "left"] = "right",
        batch_size: int | None = None,
        val_fraction: float = 0.0,
        test_fraction: float = 0.0,
        num_workers: int = 0,
        loader_timeout: float = 600.0,
        pad_token_id: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        cache_dir: str | None = None,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        content_check_samples: int = 8,
        stream_split: StreamSplit = "rank",
        token_fields: dict[str, int | float] | None = None,
        sample_fields: list[str] | None = None,
        loss_weight_field: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["source", "val_source", "test_source", "predict_source"])
        self.settings = BatchingSettings(
            **{f.name: self.hparams[f.name] for f in dataclasses.fields(BatchingSettings) if f.init}
        )
        self.hparams.max_tokens = self.settings.max_tokens  # "auto" resolved
        self.source = resolve_source(source)
        evaluation = {
            "val_source": None if val_source is None else resolve_source(val_source, "val_source"),
            "test_source": None if test_source is None else resolve_source(test_source, "test_source"),
        }
        predict = None if predict_source is None else resolve_source(predict_source, "predict_source")
        if isinstance(predict, StreamSource):
            raise ValueError(f"predict_source must be an indexed source or dataset, got the stream {predict!r:.80}")
        if isinstance(self.source, StreamSource):
            if any(value is not None for value in evaluation.values()):
                raise ValueError(
                    "val_source / test_source are not supported with a stream source yet: validate and test on a "
                    "second SeqPackDataModule passed to trainer.validate / trainer.test"
                )
            if predict is not None:
                raise ValueError(
                    "predict_source is not supported with a stream source yet: predict on a second SeqPackDataModule "
                    "whose source is the indexed predict data"
                )
            self.pipeline: IndexedPipeline | StreamPipeline = StreamPipeline(self.settings, self.source)
        else:
            for name, value in evaluation.items():
                if isinstance(value, StreamSource):
                    raise ValueError(f"{name} must be an indexed source or dataset, got the stream {value!r:.80}")
            self.pipeline = IndexedPipeline(self.settings, self.source, predict_source=predict, **evaluation)
        self._fabric: tuple[Any, int] | None = None

    # ------------------------------------------------------------------ what the pipeline knows
    @property
    def vocab_size(self) -> int:
        """Vocabulary size the data needs, ``pad_token_id`` included (linked to the model's by the CLI)."""
        return self.pipeline.vocab_size

    @property
    def overlong_report(self) -> OverlongReport | None:
        """What the over-long policy dropped, truncated or split in the training data (``None`` before setup)."""
        return self.pipeline.overlong_report

    @property
    def eval_overlong_reports(self) -> dict[str, OverlongReport | None]:
        """The over-long policy's reports of the validation and test data read from their own sources."""
        return self.pipeline.eval_overlong_reports

    @property
    def layout(self) -> DataParallelLayout:
        """The data-parallel world size, rank and accumulation the plans are made for (read at setup)."""
        return self.pipeline.layout

    @property
    def dataset(self) -> Sequence[Mapping[str, Any]]:
        """The whole training dataset (before the over-long policy and the held-out split); indexed sources only."""
        return self._indexed("dataset").dataset

    @property
    def splits(self) -> dict[str, Split]:
        """``train`` (``val``, ``test`` when held out): each split's dataset view, lengths and loss tokens."""
        pipeline = self._indexed("splits")
        if not pipeline.splits:
            self.setup()
        return dict(pipeline.splits)

    def plan_config(self, *, world_size: int, accumulate_grad_batches: int, train: bool = True) -> PlanConfig:
        """The planner configuration of these settings for a layout (``train=False``: an evaluation split)."""
        layout = DataParallelLayout(world_size, 0, accumulate_grad_batches)
        return self.settings.plan_config(layout, train=train)

    def _indexed(self, what: str) -> IndexedPipeline:
        if not isinstance(self.pipeline, IndexedPipeline):
            raise ValueError(f"a stream source has no {what} (it is never indexed)")
        return self.pipeline

    # ------------------------------------------------------------------ Lightning hooks
    def attach_fabric(self, fabric: Any, *, accumulate_grad_batches: int = 1) -> None:
        """Plan for a Lightning Fabric loop: world size, rank (or device mesh) from ``fabric``, and its accumulation.

        Outside a Trainer nothing else tells the DataModule how many microbatches an optimizer step holds; a plan
        made for another accumulation than the loop's would normalise the exact loss over the wrong step. Check
        the loop with :class:`~lit_seqpack.model.mixin.FabricAccumulation` (see ``examples/fabric_loop.py``).

        Args:
            fabric: the launched ``lightning.fabric.Fabric``.
            accumulate_grad_batches: microbatches per rank per optimizer step of the loop.
        """
        self._fabric = (fabric, check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1))

    def prepare_data(self) -> None:
        """Validate the samples and compute (and cache, with ``cache_dir``) the lengths once per process."""
        self.pipeline.prepare()

    def setup(self, stage: str | None = None) -> None:
        """Read world size, rank and accumulation from the Trainer; apply the over-long policy; split."""
        fabric, accumulate = self._fabric if self._fabric is not None else (None, 1)
        self.pipeline.setup(self.trainer, fabric=fabric, accumulate_grad_batches=accumulate)

    def _ready(self) -> None:
        """Set up on first use outside a Trainer (a loader asked for before ``setup``)."""
        if not self.pipeline.is_set_up or self.pipeline.trainer is not self.trainer:
            self.setup("fit")

    def train_dataloader(self) -> Any:
        """The training loader: a stateful DataLoader over this rank's planned microbatches.

        Under ``Trainer(overfit_batches=N)`` every epoch trains the same first ``N`` microbatches (epoch 0's plan,
        unshuffled; Lightning validates on the first ``N`` validation microbatches); a stream source refuses it.
        """
        overfit = getattr(self.trainer, "overfit_batches", 0) if self.trainer is not None else 0
        if overfit and isinstance(self.pipeline, StreamPipeline):
            raise ValueError(
                f"Trainer(overfit_batches={overfit}) is not supported with a stream source "
                f"({type(self.source).__name__}): the stream is read on, so its first microbatches differ between "
                "epochs. Overfit on an indexed source (TokenizedSource, ...) or set overfit_batches=0"
            )
        self._ready()
        return self.pipeline.train_loader()

    def val_dataloader(self) -> Any:
        """The validation loader (same mode, no shuffle, no accumulation, ``eval_max_tokens``), or none."""
        self._ready()
        return self.pipeline.eval_loader("val")

    def test_dataloader(self) -> Any:
        """The test loader (same mode, no shuffle, no accumulation, ``eval_max_tokens``)."""
        self._ready()
        return self.pipeline.eval_loader("test")

    def predict_dataloader(self) -> Any:
        """The predict loader: every sample of ``predict_source`` (default: the training source) once over the ranks.

        Planned like evaluation (same mode, no shuffle, ``eval_max_tokens``, the training over-long policy); each
        batch carries ``sample_index``, the index of each document (row) in the predict source, which the mixin's
        ``predict_step`` returns with its per-sample log-probabilities.
        """
        if not isinstance(self.pipeline, IndexedPipeline):
            raise ValueError(
                f"trainer.predict needs indexed data, but source={type(self.source).__name__} is a stream (it is never "
                "indexed, so its predictions could not name their samples): predict on a SeqPackDataModule whose "
                "source is the same data as an indexed source (TokenizedSource, ...)"
            )
        self._ready()
        # Lightning warns that a custom batch sampler may drop indices in predict; this one returns every index
        # once (tests/test_prediction.py): the warning is silenced for PlannedBatchSampler only
        warnings.filterwarnings("ignore", message=_PREDICT_SAMPLER_WARNING)
        return self.pipeline.predict_loader()

    def state_dict(self) -> dict[str, Any]:
        """What a resume must agree with (the data and the distributed layout), the training loader's state, and the
        source's tokenizer folder if it has one (``lit-seqpack generate`` decodes with it)."""
        state = self.pipeline.state_dict()
        tokenizer = getattr(self.source, "tokenizer", None)
        if isinstance(tokenizer, (str, Path)):
            state[TOKENIZER_STATE] = str(Path(tokenizer).expanduser().resolve())
        held_out = self._held_out()
        if held_out is not None:
            state[HELD_OUT_STATE] = held_out._asdict()
        return state

    def _held_out(self) -> HeldOut | None:
        """The settings of the held-out splits (``None`` for a stream, or before ``setup``)."""
        if not isinstance(self.pipeline, IndexedPipeline) or "train" not in self.pipeline.splits:
            return None
        splits = self.pipeline.splits
        train = splits["train"].dataset
        view = train.dataset if isinstance(train, IndexView) else train
        size = len(view.dataset) if isinstance(view, SplitDataset) else len(view)  # held out by sample, not piece
        settings = self.settings
        return HeldOut(size, settings.val_fraction, settings.test_fraction, settings.seed)

    def _check_held_out(self, state_dict: Mapping[str, Any], split: str) -> None:
        """Refuse to evaluate ``split`` on samples the checkpoint trained on (its held-out settings differ)."""
        saved, current = state_dict.get(HELD_OUT_STATE), self._held_out()
        if saved is None or current is None or split not in self.pipeline.splits:
            return
        trained = HeldOut(**saved)
        if not isinstance(self.pipeline.splits[split].dataset, IndexView):
            return  # read from its own source
        shared, size = trained_in(trained, current, split)
        if shared:
            fraction = getattr(current, f"{split}_fraction")
            raise ValueError(
                f"{shared} of the {size} {split} samples (data.{split}_fraction={fraction}, "
                f"data.seed={current.seed}) are samples this checkpoint trained on: it held out "
                f"data.val_fraction={trained.val_fraction}, data.test_fraction={trained.test_fraction} with "
                f"data.seed={trained.seed}. Evaluate with those settings, on a separate file (the source's "
                f"{split}_path, or data.{split}_source), or train with data.{split}_fraction > 0 to hold {split} "
                "samples out"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume on other data, or mid-epoch on another layout or other settings; restore the loader.

        A checkpoint written at an epoch boundary continues on another world size, ``accumulate_grad_batches`` or
        ``max_tokens``: the next epoch is planned for the new layout. Only ``fit`` resumes training; ``validate`` and
        ``test`` from a checkpoint evaluate any data layout, but refuse a held-out split that holds samples the
        checkpoint trained on (other fractions or seed than its run's).
        """
        trainer = self.trainer
        if trainer is not None and trainer.state.fn is not None and trainer.state.fn != "fit":
            if trainer.state.fn in ("validate", "test"):
                self._check_held_out(state_dict, "val" if trainer.state.fn == "validate" else "test")
            return
        self.pipeline.load_state_dict(
            {key: value for key, value in state_dict.items() if key not in (TOKENIZER_STATE, HELD_OUT_STATE)}
        )
