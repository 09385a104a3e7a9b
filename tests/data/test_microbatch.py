from __future__ import annotations

import pickle

import pytest

from lit_seqpack.data.microbatch import Microbatch, MicrobatchMeta, PlannedDataset


def _meta(**kwargs):
    base = {"step": 2, "step_loss_tokens": 17, "world_size": 2, "accumulate_grad_batches": 3, "max_tokens": 64}
    base.update(kwargs)
    return MicrobatchMeta(**base)


def test_microbatch_pickles_with_meta():
    mb = Microbatch([4, 1, 9], meta=_meta())
    clone = pickle.loads(pickle.dumps(mb))
    assert isinstance(clone, Microbatch)
    assert list(clone) == [4, 1, 9]
    assert clone.meta == mb.meta


def test_planned_dataset_forwards_meta_to_samples():
    data = [{"input_ids": [i] * (i + 1)} for i in range(5)]
    planned = PlannedDataset(data)
    samples = planned.__getitems__(Microbatch([3, 0], meta=_meta(step=5)))
    assert [s["input_ids"] for s in samples] == [[3, 3, 3, 3], [0]]
    assert samples.meta.step == 5
    assert planned.__getitems__([1]).meta is None
    assert len(planned) == 5


@pytest.mark.parametrize(
    ("knob", "value"), [("step_loss_tokens", -1), ("world_size", 0), ("accumulate_grad_batches", 0)]
)
def test_meta_rejects_bad_values(knob, value):
    with pytest.raises(ValueError, match=knob):
        _meta(**{knob: value})
