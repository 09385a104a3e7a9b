"""The facts a DataModule checkpoint records, and the refusal to resume with any of them changed."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_check_resume_returns_the_loader_state_and_its_position():
    loader = {"_index_sampler_state": {"epoch": 1, "position": 3}, "_num_yielded": 3}
    saved = _state() | {LOADER_STATE: loader}
    assert check_resume(saved, _state()) == (loader, (1, 3))
    assert check_resume(_state(), _state()) == (None, None)
    assert LOADER_STATE in saved  # the checkpoint's dict is left alone


def test_check_resume_names_every_difference():
    with pytest.raises(ValueError, match="cannot resume") as err:
        check_resume(_state(), _state(world_size=4, max_tokens=128))
    message = str(err.value)
    assert "world_size: checkpoint 2 vs now 4" in message and "max_tokens: checkpoint 64 vs now 128" in message
    assert "mode:" not in message and "num_samples:" not in message
