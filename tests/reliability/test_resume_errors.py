"""Resumes that would not be exact fail at restore time naming the cause; exception and validation checkpoints
resume exactly, also from inside a gradient-accumulation window (from the start of its optimizer step).

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
     ("shuffle", True, False), ("pad_to_multiple_of", 1, 8)],
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
def test_an_exception_checkpoint_resumes_exactly_from_the_start_of_its_optimizer_step(
    reference: Path, tmp_path: Path, strategy: str, num_workers: int
) -> None:
    expected = harness.records(reference / "reference")
    for batch_idx in (6, 7):  # the first microbatch of optimizer step 3 of epoch 1, then its second
        run = tmp_path / str(batch_idx)
        saver = OnExceptionCheckpoint(run)
        with pytest.raises(RuntimeError, match="simulated failure"):
            harness.fit(run / "failed", num_workers=num_workers, callbacks=[saver, FailAt(1, batch_idx)])
        # at 6, microbatch 6 was drawn from the loader but never trained (Lightning's counter says so); at 7,
        # microbatch 6 was trained but its gradient died with the process: both resume at microbatch 6
        harness.fit(run / "resumed", strategy=strategy, num_workers=num_workers, ckpt_path=Path(saver.ckpt_path))
        assert harness.compare(harness.records(run / "resumed"), harness.after(expected, (1, 5))) is None


@pytest.mark.slow
def test_validation_checkpoints_resume_exactly_at_a_step_boundary_and_inside_a_window(
    tmp_path: Path,
) -> None:
    """``val_check_interval=3`` with accumulation 2: ``ModelCheckpoint`` itself writes inside accumulation windows."""
    run = {"data": {"val_fraction": 0.1}, "trainer": {"val_check_interval": 3}}
    saver = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_top_k=-1, filename="{step}")
    harness.fit(tmp_path / "reference", callbacks=[saver], **run)
    expected = harness.records(tmp_path / "reference")
    # after microbatches 3 (inside optimizer step 1, which restarts at microbatch 2) and 6 (the end of step 2)
    for name, last_kept in (("step=1", (0, 1)), ("step=3", (0, 5))):
        harness.fit(tmp_path / name, strategy="late", ckpt_path=tmp_path / "checkpoints" / f"{name}.ckpt", **run)
        assert harness.compare(harness.records(tmp_path / name), harness.after(expected, last_kept)) is None, name
