"""What ``SeqPackDataModule(stream=...)`` delegates to: its settings checked, its loader built, its state resumed.

The DataModule keeps the batching mode, the budget, the parallel layout and the collators; this module turns them
into a :class:`~lit_seqpack.data.streaming.loader.StreamingDataLoader` and owns the streaming part of the checkpoint.
A resume must keep every fact the window plans depend on (:func:`stream_facts`); a different one is refused with a
message naming it, since re-planned windows would train other microbatches than the checkpointed run.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from lit_seqpack.data._budget import document_budget
from lit_seqpack.data._resume import check_start, rewind_fit_loop
from lit_seqpack.data.lengths import sample_loss_tokens
from lit_seqpack.data.streaming.buffer import OverlongCounter, stream_windows
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.data.streaming.sources import StreamSource

if TYPE_CHECKING:
    from lit_seqpack.data.datamodule import SeqPackDataModule

__all__ = [
    "STREAM_STATE",
    "build_stream_loader",
    "check_stream_settings",
    "load_stream_state",
    "stream_prefix",
    "stream_prefix_microbatches",
    "stream_state",
]

STREAM_STATE = "stream_loader"


def check_stream_settings(
    stream: Any,
    *,
    buffer_size: Any,
    val_fraction: float,
    test_fraction: float,
    dataset: Any,
    source: str,
    unsupported: Mapping[str, Any] | None = None,
) -> None:
    """Refuse settings that a stream cannot honour, naming the setting and its value.

    Args:
        stream: the stream source.
        buffer_size: ``stream_buffer``.
        val_fraction: must be 0 (a stream has no index to hold samples out of).
        test_fraction: must be 0.
        dataset: must be None (the stream replaces it).
        source: must be the default (the stream replaces it).
        unsupported: other settings, by name, that the streaming path does not honour yet and must be None.

    Raises:
        ValueError: ``stream`` is not a :class:`~lit_seqpack.data.streaming.sources.StreamSource`, ``stream_buffer``
            is not an int >= 1, or a held-out fraction, ``dataset``, a non-default ``source`` or one of
            ``unsupported`` is set with it.
    """
    for name, value in (unsupported or {}).items():
        if value is not None:
            raise ValueError(
                f"{name}={value!r} is not supported with stream yet (streamed batches would silently ignore it): "
                f"set {name}=None, or use an indexed dataset (path/dataset) instead of stream"
            )
    if not isinstance(stream, StreamSource):
        raise ValueError(f"stream must have an open(position) method (a StreamSource), got {type(stream).__name__}")
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"stream_buffer must be an int >= 1 (samples planned together), got {buffer_size!r}")
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if value:
            raise ValueError(
                f"{name}={value} cannot hold samples out of a stream (it has no index); set {name}=0 with stream"
            )
    if dataset is not None or source != "synthetic":
        raise ValueError(f"stream replaces source and dataset: got source={source!r} and a dataset with a stream")


def stream_facts(dm: SeqPackDataModule) -> dict[str, Any]:
    """The facts every window plan depends on: a resume must keep all of them."""
    world, _, accumulate = dm._layout
    hp = dm.hparams
    return {
        "stream_buffer": hp.stream_buffer,
        "world_size": world,
        "accumulate_grad_batches": accumulate,
        "mode": hp.mode,
        "max_tokens": hp.max_tokens,
        "overlong": hp.overlong,
        **dm._plan_settings(),
    }


def build_stream_loader(dm: SeqPackDataModule) -> StreamingDataLoader:
    """The training loader of a stream for ``dm``'s layout, settings and pending resume state."""
    hp = dm.hparams
    world, rank, accumulate = dm._layout
    counter = _counter(dm)
    dataset = StreamingDataset(
        dm._stream,
        config=dm.plan_config(world_size=world, accumulate_grad_batches=accumulate),
        rank=rank,
        buffer_size=hp.stream_buffer,
        collator=dm._collator(),
        overlong=hp.overlong,
        document_budget=None if counter is None else counter.max_tokens,
        document_multiple=dm.document_multiple if hp.mode == "packing" else 1,
        vocab_size=_model_vocab(dm),
        check_samples=hp.content_check_samples,
        seed=hp.seed,
        token_fields=tuple(dm._token_fields),
    )
    loader = StreamingDataLoader(
        dataset,
        num_workers=hp.num_workers,
        start_source=lambda epoch, start, saved: _training_start(dm, epoch, start, saved),
        report_to=lambda report: setattr(dm, "overlong_report", report),
    )
    if dm._pending_loader_state is not None:
        loader.load_state_dict(dm._pending_loader_state)
        dm._pending_loader_state = None
    dm._train_loader = loader
    return loader


def _training_start(dm: SeqPackDataModule, epoch: int, start: int, saved: Mapping[str, Any] | None) -> tuple[int, int]:
    """Where the loader starts: the Trainer's epoch and batch counter during fit, else the loader's own position.

    Lightning fetches the first batch of a loader without a length as soon as it builds it, which a schedule
    reading ``trainer.estimated_stepping_batches`` does before the loop counters are restored from the checkpoint.
    The checkpoint's own record of the Trainer's counters (``resume_at``, written by :func:`stream_state`) is then
    the truth; once the counters are restored they are checked against the loader's position as in the map path.
    """
    trainer = dm.trainer
    if not getattr(trainer, "training", False):
        return epoch, start
    loop = trainer.fit_loop
    if saved is not None and not loop.restarting and saved.get("resume_at") is not None:
        epoch, position = saved["resume_at"]
        if position % dm._layout[2]:
            raise RuntimeError(
                f"cannot resume the stream exactly: the checkpoint was written inside a gradient-accumulation window "
                f"(epoch {epoch}, microbatch {position}, accumulate_grad_batches={dm._layout[2]}); resume from a "
                "checkpoint written at an optimizer-step boundary (ModelCheckpoint(every_n_train_steps=...))"
            )
        return int(epoch), int(position)
    return check_start(
        trainer_epoch=loop.epoch_progress.current.processed,
        trainer_position=loop.epoch_loop.batch_progress.current.ready,
        saved=None if saved is None else (saved["epoch"], saved["yielded"]),
        accumulate=dm._layout[2],
        rewind=lambda microbatches: rewind_fit_loop(loop, microbatches),
    )


def stream_state(dm: SeqPackDataModule) -> dict[str, Any]:
    """The streaming part of ``dm``'s checkpoint: the plan facts and the loader's position (no sample)."""
    state: dict[str, Any] = {"facts": stream_facts(dm)}
    if dm._train_loader is not None:
        loader = state["loader"] = dm._train_loader.state_dict()
        trainer = dm.trainer
        if getattr(trainer, "training", False):  # where the Trainer's counters will resume (see _training_start)
            epoch = trainer.fit_loop.epoch_progress.current.processed
            position = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            loader["resume_at"] = [loader["epoch"], 0] if loader["epoch"] > epoch else [epoch, position]
    return state


def load_stream_state(dm: SeqPackDataModule, state: dict[str, Any]) -> None:
    """Check the facts of a checkpoint's stream state and restore (or queue) its loader position.

    Raises:
        ValueError: the checkpoint holds no stream state, or one planned with other facts.
    """
    if not isinstance(state, dict) or "facts" not in state:
        raise ValueError("the checkpoint holds no stream state: it was not written by a run with stream=...")
    saved, current = state["facts"], stream_facts(dm)
    changed = [f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in current if saved.get(k) != current[k]]
    if changed:
        raise ValueError(
            "cannot resume the stream exactly: the checkpoint's windows were planned with other settings "
            f"({'; '.join(changed)}); resume with the checkpoint's settings"
        )
    loader_state = state.get("loader")
    if loader_state and dm._train_loader is not None:
        dm._train_loader.load_state_dict(loader_state)
    else:
        dm._pending_loader_state = loader_state


def stream_prefix(dm: SeqPackDataModule, max_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and loss tokens of the stream's first ``max_samples`` samples under the over-long policy.

    ``lit-seqpack inspect`` plans this prefix offline; ``dm.overlong_report`` counts the policy over it.

    Raises:
        ValueError: ``max_samples`` is not an int >= 1, or the prefix holds no sample.
    """
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
        raise ValueError(f"max_samples must be an int >= 1 (the stream prefix to inspect), got {max_samples!r}")
    counter = _counter(dm)
    lengths, loss = [], []
    for number, sample in enumerate(itertools.islice(dm._stream.open(), max_samples)):
        kept = sample if counter is None else counter.admit(number, sample)
        if kept is not None:
            lengths.append(len(kept["input_ids"]))
            loss.append(sample_loss_tokens(kept))
    if not lengths:
        raise ValueError(f"the stream's first {max_samples} samples hold no sample to plan")
    if counter is not None:
        dm.overlong_report = counter.report()
    return np.array(lengths, dtype=np.int64), np.array(loss, dtype=np.int64)


def stream_prefix_microbatches(dm: SeqPackDataModule, max_samples: int, *, world_size: int, accumulate: int) -> int:
    """Microbatches per rank that the streaming loader trains the prefix in (windows of ``stream_buffer``)."""
    config = dm.plan_config(world_size=world_size, accumulate_grad_batches=accumulate)
    windows = stream_windows(
        itertools.islice(dm._stream.open(), max_samples),
        config=config,
        buffer_size=dm.hparams.stream_buffer,
        epoch=0,
        counter=_counter(dm),
        document_multiple=dm.document_multiple if dm.hparams.mode == "packing" else 1,
    )
    return sum(window.plan.microbatches_per_rank for window in windows)


def _model_vocab(dm: SeqPackDataModule) -> int | None:
    """The vocabulary of the Trainer's model (``None`` without one), after checking that it embeds the pad id."""
    from lit_seqpack.model.vocab import model_vocab_size  # the model's side of the check, read at setup only

    model = getattr(dm.trainer, "lightning_module", None) if dm.trainer is not None else None
    vocab = None if model is None else model_vocab_size(model)
    if vocab is not None and dm.hparams.pad_token_id >= vocab:
        raise ValueError(f"pad_token_id={dm.hparams.pad_token_id} is outside the model's vocab_size={vocab}")
    return vocab


def _counter(dm: SeqPackDataModule) -> OverlongCounter | None:
    hp = dm.hparams
    if hp.max_tokens is None:
        return None
    pads = {"pad_to_multiple_of": hp.pad_to_multiple_of, "document_multiple": dm.document_multiple}
    budget = document_budget(hp.max_tokens, mode=hp.mode, **pads)
    return OverlongCounter(policy=hp.overlong, max_tokens=budget, token_fields=tuple(dm._token_fields))
