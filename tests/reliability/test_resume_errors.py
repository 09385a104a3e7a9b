"""Resumes that would not be exact fail at restore time naming the cause; exception checkpoints resume exactly.

One uninterrupted single-process reference run (``_resume_harness``) writes a mid-epoch step-boundary checkpoint and
an end-of-epoch one; the tests resume from them with a changed plan setting, and from ``OnExceptionCheckpoint``
checkpoints written when a training step raised.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from tests.reliability import _resume_harness as harness
from tests.reliability import _train_script as script

STEP, EPOCH_END = (1, 5), (0, harness.epoch_length("packing") - 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    harness.fit(run / "reference", save={STEP: run / "step.ckpt", EPOCH_END: run / "epoch_end.ckpt"})
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("knob", "old", "new"),
    [("seed", 0, 1), ("algorithm", "first_fit_decreasing", "best_fit_decreasing"), ("window", None, 32),
     ("shuffle", True, False)],
)  # fmt: skip
@pytest.mark.parametrize("strategy", ["single", "late"])
def test_a_changed_plan_setting_is_refused_at_restore_naming_it(
    reference: Path, tmp_path: Path, strategy: str, knob: str, old: object, new: object
) -> None:
    with pytest.raises(ValueError, match=rf"cannot resume mid-epoch .*{knob}: checkpoint {old!r} vs now {new!r}"):
        harness.fit(tmp_path, strategy=strategy, ckpt_path=reference / "step.ckpt", data={knob: new})
    assert harness.records(tmp_path) == []  # refused before the first batch


@pytest.mark.slow
def test_a_changed_seed_at_an_end_of_epoch_checkpoint_plans_the_next_epoch_afresh(
    reference: Path, tmp_path: Path
) -> None:
    harness.fit(tmp_path, strategy="late", ckpt_path=reference / "epoch_end.ckpt", data={"seed": 1})
    resumed = harness.records(tmp_path)
    assert {r["epoch"] for r in resumed} == {1}
    assert Counter(i for r in resumed for i in r["indices"]) == Counter(range(script.NUM_SAMPLES))
    assert [r["indices"] for r in resumed] != [
        r["indices"] for r in harness.after(harness.records(reference / "reference"), EPOCH_END)
    ]


class FailAt(L.Callback):
    """Raises in the backward of microbatch ``(epoch, batch_idx)``: Lightning's counters then stand mid-step."""

    def __init__(self, epoch: int, batch_idx: int) -> None:
        self.at, self._batch = (epoch, batch_idx), -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._batch = batch_idx

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        if (trainer.current_epoch, self._batch) == self.at:
            raise RuntimeError("simulated failure")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "late"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_exception_checkpoint_resumes_exactly_at_a_step_start_and_is_refused_inside_a_window(
    reference: Path, tmp_path: Path, strategy: str, num_workers: int
) -> None:
    expected = harness.records(reference / "reference")
    for batch_idx in (6, 7):  # the first microbatch of optimizer step 3 of epoch 1, then its second
        run = tmp_path / str(batch_idx)
        saver = OnExceptionCheckpoint(run)
        with pytest.raises(RuntimeError, match="simulated failure"):
            harness.fit(run / "failed", num_workers=num_workers, callbacks=[saver, FailAt(1, batch_idx)])
        resume = {"strategy": strategy, "num_workers": num_workers, "ckpt_path": Path(saver.ckpt_path)}
        if batch_idx % harness.ACCUMULATE:  # microbatch 6 trained, its gradient lost with the process
            with pytest.raises(RuntimeError, match="inside a gradient-accumulation window"):
                harness.fit(run / "resumed", **resume)
            assert harness.records(run / "resumed") == []
        else:  # microbatch 6 was drawn from the loader but never trained: Lightning's counter says so
            harness.fit(run / "resumed", **resume)
            assert harness.compare(harness.records(run / "resumed"), harness.after(expected, (1, 5))) is None


@pytest.mark.slow
def test_validation_checkpoints_resume_exactly_at_a_step_boundary_and_are_refused_inside_a_window(
    tmp_path: Path,
) -> None:
    """``val_check_interval=3`` with accumulation 2: ``ModelCheckpoint`` itself writes inside accumulation windows."""
    run = {"data": {"val_fraction": 0.1}, "trainer": {"val_check_interval": 3}}
    saver = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_top_k=-1, filename="{step}")
    harness.fit(tmp_path / "reference", callbacks=[saver], **run)
    expected = harness.records(tmp_path / "reference")
    # after microbatches 3 (inside optimizer step 1) and 6 (the end of step 2) of epoch 0
    with pytest.raises(RuntimeError, match="inside a gradient-accumulation window"):
        harness.fit(tmp_path / "window", strategy="late", ckpt_path=tmp_path / "checkpoints" / "step=1.ckpt", **run)
    harness.fit(tmp_path / "step", strategy="late", ckpt_path=tmp_path / "checkpoints" / "step=3.ckpt", **run)
    assert harness.compare(harness.records(tmp_path / "step"), harness.after(expected, (0, 5))) is None
