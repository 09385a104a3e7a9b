"""Loss weights through SeqPackDataModule: a weighted ``loss_mask`` (``loss_weight_field="loss_mask"``) passes the
data scan and gives, like a weight field read from a JSONL file, the exact gradient of one big padded batch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lit_seqpack.data.batching.loss_weights import sample_loss_weight
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.indexed.lengths import cached_scan
from lit_seqpack.data.indexed.validation import scan_dataset
from lit_seqpack.data.sources import TokenizedSource
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match, make_module, one_step_trainer
from tests.model.test_exact_weighted_loss import reference_weighted_gradients, weighted_samples

MASKED = [
    {"input_ids": [5, 6, 7, 8], "loss_mask": [1.0, 0.5, 0.0, 0.25]},
    {"input_ids": [9, 10], "labels": [-100, 10]},
    {"input_ids": [11, 12, 13], "loss_mask": [0, 1, 1]},
]


class FingerprintedList(list):
    """A list of samples with a content identity, so the lengths cache applies (no ``lengths`` attribute)."""

    fingerprint = "masked-samples-v1"


def test_the_scan_reads_loss_mask_weights_only_under_loss_weight_field_loss_mask():
    with pytest.raises(ValueError, match=r"dataset\[0\]: 'loss_mask' must hold only 0 and 1"):
        scan_dataset(MASKED)
    scan = scan_dataset(MASKED, weighted_mask=True)
    assert scan.lengths.tolist() == [4, 2, 3]
    assert scan.loss_tokens.tolist() == [2, 1, 2]  # the non-zero weights after each document's first token
    for bad in (1.5, -0.5, float("nan")):
        data = [MASKED[1], {"input_ids": [1, 2], "loss_mask": [1.0, bad]}]
        with pytest.raises(ValueError, match=r"dataset\[1\]: 'loss_mask' has .* at position 1; .*weights in \[0, 1\]"):
            scan_dataset(data, weighted_mask=True)


def test_the_lengths_cache_keeps_the_scans_with_and_without_mask_weights_apart(tmp_path):
    data = FingerprintedList(MASKED)
    assert cached_scan(data, tmp_path, weighted_mask=True).loss_tokens.tolist() == [2, 1, 2]
    with pytest.raises(ValueError, match="'loss_mask' must hold only 0 and 1"):  # not the cached weighted scan
        cached_scan(data, tmp_path)
    assert len(list(tmp_path.glob("lengths-*.npz"))) == 1


def test_loss_mask_weights_from_a_file_source_are_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="loss_weight_field='loss_mask' is not supported with TokenizedSource"):
        SeqPackDataModule(
            source=TokenizedSource(str(tmp_path / "x.jsonl"), format="jsonl"), loss_weight_field="loss_mask"
        )


def _datamodule(field: str, mode: str, samples: list[dict], tmp_path) -> SeqPackDataModule:
    budget = {"batch_size": 3, "max_tokens": None} if mode == "padded" else {"max_tokens": 40}
    if field == "loss_mask":
        return SeqPackDataModule(source=samples, **budget, mode=mode, loss_weight_field="loss_mask", seed=3)
    path = tmp_path / "weighted.jsonl"  # the weights as a declared token field of a file
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return SeqPackDataModule(
        source=TokenizedSource(str(path), format="jsonl"),
        **budget,
        mode=mode,
        token_fields={field: 0.0},
        loss_weight_field=field,
        seed=3,
    )


@pytest.mark.parametrize("field", ["loss_mask", "weights"])
@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_a_weighted_step_through_the_datamodule_has_the_big_padded_batch_gradient(field, mode, tmp_path):
    samples = weighted_samples(field)
    module = make_module("reference")
    expected = reference_weighted_gradients(module, samples, field)
    dm = _datamodule(field, mode, samples, tmp_path)
    batches = list(dm.train_dataloader())  # without a Trainer: one microbatch an optimizer step
    assert len(batches) > 1  # several microbatches, accumulated into the one optimizer step below
    assert all(math.isclose(b["step_loss_weight"], b["num_loss_weight"], rel_tol=1e-12) for b in batches)
    total = math.fsum(sample_loss_weight(s, field) for s in samples)
    assert math.isclose(math.fsum(b["step_loss_weight"] for b in batches), total, rel_tol=1e-12)
    targets = [np.asarray(s[field])[1:] for s in samples]
    if field == "weights":  # the labels mask the prompts; the weights scale what is left
        targets = [np.where(np.asarray(s["labels"][1:]) != -100, 1, 0) for s in samples]
    assert sum(b["step_loss_tokens"] for b in batches) == int(sum((t != 0).sum() for t in targets))
    capture = GradientCapture()
    trainer = one_step_trainer(len(batches), capture)
    trainer.fit(module, datamodule=_datamodule(field, mode, samples, tmp_path))
    assert capture.grads is not None
    assert_gradients_match(capture.grads, expected, rtol=1e-6)
