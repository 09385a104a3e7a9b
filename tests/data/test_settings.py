"""``BatchingSettings``: one frozen object, checked once, naming the setting; what the pipelines derive from it."""

from __future__ import annotations

import dataclasses

import pytest

from lit_seqpack.data import BatchingSettings, PackedCollator, PaddedCollator, SeqPackDataModule
from lit_seqpack.data.batching.context_parallel import ContextParallelCollator, TensorParallelCollator
from lit_seqpack.data.settings import DEFAULT_MAX_TOKENS, DEFAULT_STREAM_WINDOW
from lit_seqpack.parallel import DataParallelLayout


def test_the_settings_are_frozen_and_resolve_auto_once():
    settings = BatchingSettings(mode="dynamic")
    assert settings.max_tokens == DEFAULT_MAX_TOKENS and settings.eval_max_tokens == DEFAULT_MAX_TOKENS
    assert BatchingSettings(mode="padded", batch_size=4).max_tokens is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.mode = "packing"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "packed"}, ValueError, r"mode='packed' must be one of"),
        ({"max_tokens": "lots"}, ValueError, r"max_tokens='lots' must be an int, 'auto' or null"),
        ({"overlong": "skip"}, ValueError, r"overlong='skip' must be one of"),
        ({"shuffle": "no"}, TypeError, r"shuffle='no' must be a bool"),
        ({"num_workers": -1}, ValueError, r"num_workers must be an int >= 0, got -1"),
        ({"content_check_samples": -2}, ValueError, r"content_check_samples must be an int >= 0, got -2"),
        ({"stream_split": "node"}, ValueError, r"stream_split='node' must be one of \('rank', 'replicate'\)"),
        ({"val_fraction": 1.0}, ValueError, r"val_fraction=1.0 must be in \[0, 1\)"),
        ({"test_fraction": "0.1"}, TypeError, r"test_fraction='0.1' must be a number"),
        ({"cache_dir": 3}, TypeError, r"cache_dir=3 must be a str or None"),
        ({"window": 0}, ValueError, r"window must be an int >= 1, got 0"),
        ({"mode": "padded"}, ValueError, r"mode='padded' needs batch_size"),
        ({"mode": "dynamic", "pad_to_multiple_of": 8}, ValueError, r"pad_to_multiple_of=8 .* needs mode='packing'"),
        ({"mode": "dynamic", "context_parallel_size": 2}, ValueError, r"context_parallel_size=2 needs mode='packing'"),
        ({"max_tokens": 100, "tensor_parallel_size": 8}, ValueError, r"max_tokens=100 must be a multiple of 8"),
        ({"max_tokens": 64, "eval_max_tokens": 32}, ValueError, r"eval_max_tokens=32 is below max_tokens=64"),
        ({"token_fields": {"labels": 0}}, ValueError, r"token_fields"),
        ({"loss_weight_field": "w"}, ValueError, r"loss_weight_field='w'"),
        ({"max_tokens": 8, "pad_to_multiple_of": 16}, ValueError, r"pad_to_multiple_of=16"),
    ],
)
def test_a_bad_setting_is_refused_at_construction_naming_it(kwargs, error, message):
    with pytest.raises(error, match=message):
        BatchingSettings(**kwargs)
    with pytest.raises(error, match=message):  # the DataModule checks through the same object, before any data
        SeqPackDataModule(source=[{"input_ids": [1, 2]}], **kwargs)


def test_the_pad_multiples_plan_and_collator_follow_from_the_settings():
    settings = BatchingSettings(max_tokens=64, sequence_length_round=8, context_parallel_size=2)
    assert settings.document_multiple == 4 and settings.row_multiple == 8 and settings.planned_document_multiple == 4
    config = settings.plan_config(DataParallelLayout(world_size=2, rank=1, accumulate_grad_batches=3))
    assert (config.world_size, config.accumulate_grad_batches, config.shuffle, config.max_tokens) == (2, 3, True, 64)
    evaluation = settings.plan_config(DataParallelLayout(2, 1, 3), train=False)
    assert (evaluation.accumulate_grad_batches, evaluation.shuffle) == (1, False)
    assert isinstance(settings.collator(context_parallel_rank=1), ContextParallelCollator)
    assert isinstance(BatchingSettings(tensor_parallel_size=2).collator(), TensorParallelCollator)
    assert isinstance(BatchingSettings().collator(), PackedCollator)
    assert isinstance(BatchingSettings(mode="dynamic").collator(), PaddedCollator)


def test_one_window_setting_for_indexed_epochs_and_streams():
    assert BatchingSettings().window is None and BatchingSettings().stream_window == DEFAULT_STREAM_WINDOW
    assert BatchingSettings(window=64).stream_window == 64
    assert BatchingSettings(window=64).plan_config(DataParallelLayout()).window == 64


def test_the_datamodule_settings_are_the_settings_fields():
    """Every BatchingSettings field is a DataModule setting of the same name and default (one spelling)."""
    import inspect

    parameters = inspect.signature(SeqPackDataModule).parameters
    for field in dataclasses.fields(BatchingSettings):
        if field.init:
            assert parameters[field.name].default == field.default, field.name
    assert set(parameters) - {f.name for f in dataclasses.fields(BatchingSettings)} == {
        "source",
        "val_source",
        "test_source",
        "predict_source",
    }
