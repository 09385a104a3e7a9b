"""The facts a DataModule checkpoint records, and the refusal to resume with any of them changed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.indexed._resume import LOADER_STATE, check_resume, digest, layout_state
from lit_seqpack.data.indexed.splits import Split


def _state(**changes):
    lengths, loss = np.array([3, 5, 7]), np.array([2, 4, 6])
    kw = {
        "num_samples": 4,
        "train": Split([{}, {}, {}], lengths, loss),
        "world_size": 2,
        "context_parallel_size": 1,
        "tensor_parallel_size": 1,
        "accumulate_grad_batches": 1,
        "mode": "packing",
        "max_tokens": 64,
    }
    return layout_state(**(kw | changes))


def test_digest_tracks_lengths_and_loss_tokens():
    a = digest(np.array([3, 5]), np.array([2, 4]))
    assert a == digest(np.array([3, 5], dtype=np.int32), np.array([2, 4]))
    assert a != digest(np.array([3, 5]), np.array([2, 3]))
    assert a != digest(np.array([5, 3]), np.array([4, 2]))


def test_layout_state_before_setup():
    state = _state(train=None)
    assert state["num_train_samples"] == 0 and state["train_lengths"] is None


def _at(epoch: int, position: int, **changes) -> dict:
    """A checkpoint state whose training loader stands at ``(epoch, position)``."""
    loader = {"_index_sampler_state": {"epoch": epoch, "position": position}, "_num_yielded": position}
    return _state(**changes) | {LOADER_STATE: loader}


def test_check_resume_returns_the_loader_state_and_its_position():
    saved = _at(1, 3)
    assert check_resume(saved, _state()) == (saved[LOADER_STATE], (1, 3), "")
    assert check_resume(_state(), _state()) == (None, None, "")
    assert LOADER_STATE in saved  # the checkpoint's dict is left alone


def test_check_resume_names_every_difference():
    with pytest.raises(ValueError, match="cannot resume") as err:
        check_resume(_at(1, 0), _state(mode="dynamic", max_tokens=128))
    message = str(err.value)
    assert (
        "mode: checkpoint 'packing' vs now 'dynamic'" in message and "max_tokens: checkpoint 64 vs now 128" in message
    )
    assert "world_size:" not in message and "num_samples:" not in message


@pytest.mark.parametrize(
    ("knob", "new"), [("world_size", 1), ("world_size", 4), ("accumulate_grad_batches", 3), ("max_tokens", 128)]
)
def test_an_epoch_boundary_checkpoint_continues_on_another_layout(knob: str, new: int) -> None:
    saved = _at(2, 0)
    restore = check_resume(saved, _state(**{knob: new}))
    assert restore.point == (2, 0) and restore.loader_state == saved[LOADER_STATE]
    assert restore.layout_changes == f"{knob}: checkpoint {saved[knob]!r} vs now {new!r}"


@pytest.mark.parametrize(("knob", "new"), [("world_size", 1), ("accumulate_grad_batches", 4), ("max_tokens", 32)])
def test_a_mid_epoch_checkpoint_on_another_layout_is_refused_naming_the_setting(knob: str, new: int) -> None:
    old = _state()[knob]
    with pytest.raises(ValueError) as err:
        check_resume(_at(1, 3), _state(**{knob: new}))
    message = str(err.value)
    assert (
        f"cannot resume mid-epoch (epoch 1, microbatch 3) on another layout ({knob}: checkpoint {old} vs now {new})"
        in message
    )
    assert "only a checkpoint written at an epoch boundary continues" in message
    with pytest.raises(ValueError, match=rf"without a training loader position on another layout \({knob}:"):
        check_resume(_state(), _state(**{knob: new}))


def test_a_new_max_tokens_may_cut_the_same_samples_but_not_drop_any() -> None:
    truncated = _state(max_tokens=6, train=Split([{}, {}, {}], np.array([3, 5, 6]), np.array([2, 4, 5])))
    assert check_resume(_at(1, 0), truncated).layout_changes == "max_tokens: checkpoint 64 vs now 6"
    dropped = _state(max_tokens=6, train=Split([{}, {}], np.array([3, 5]), np.array([2, 4])))
    with pytest.raises(ValueError, match="num_train_samples: checkpoint 3 vs now 2"):
        check_resume(_at(1, 0), dropped)
    with pytest.raises(ValueError, match="train_lengths: checkpoint"):  # other lengths under the same budget
        check_resume(_at(1, 0), _state(world_size=1, train=truncated_split()))


def truncated_split() -> Split:
    return Split([{}, {}, {}], np.array([3, 5, 6]), np.array([2, 4, 5]))


def _training_trainer(epoch: int, microbatch: int) -> SimpleNamespace:
    """What the pipeline reads from a Trainer in ``fit``: the epoch and the batch counter its loop resumes at."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=microbatch))
    return SimpleNamespace(
        training=True,
        fit_loop=SimpleNamespace(
            epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=epoch)),
            epoch_loop=SimpleNamespace(batch_progress=progress),
        ),
    )


def test_a_trainer_resuming_mid_epoch_on_another_layout_is_refused_at_the_first_batch() -> None:
    """The loader stood at an epoch boundary but the Trainer's loop resumes inside a later epoch (e.g. max_steps)."""
    pipeline = SeqPackDataModule(source="synthetic").pipeline
    pipeline._resume_point, pipeline._layout_changes = (1, 0), "world_size: checkpoint 2 vs now 1"
    pipeline.trainer = _training_trainer(2, 4)
    with pytest.raises(RuntimeError, match=r"on another layout \(world_size: checkpoint 2 vs now 1\) mid-epoch"):
        pipeline._training_start(1, 0)
    pipeline._resume_point, pipeline._layout_changes = (1, 0), "world_size: checkpoint 2 vs now 1"
    pipeline.trainer = _training_trainer(2, 0)
    assert pipeline._training_start(1, 0) == (2, 0)  # the next epoch's start: planned for the new layout
