"""PackingMonitor(peak_flops=...): train/tflops and train/mfu from the real documents' training FLOPs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, seed_everything

from lit_seqpack import PackingMonitor
from lit_seqpack.metrics.flops import document_lengths, training_flops
from tests.test_callbacks import FakeClock, read_rows, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
]

SECONDS_PER_MICROBATCH = 0.25
PEAK = 2e9  # FLOP/s: a tiny model on a CPU clock of 0.25 s a microbatch lands well inside (0, 1]


class Recorder(Callback):
    """Advances the monitor's clock by a fixed time per microbatch and keeps each microbatch's document lengths."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.lengths = clock, []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.now += SECONDS_PER_MICROBATCH
        self.lengths.append(document_lengths(batch).tolist())


def _fit(tmp_path: Path, mode: str) -> tuple[Any, Recorder, Any]:
    from lit_seqpack import ReferenceLM, SeqPackDataModule
    from lit_seqpack.data.sources import SyntheticInstructionDataset

    source = SyntheticInstructionDataset(num_samples=48, vocab_size=40, median_length=20, max_length=60)
    data = SeqPackDataModule(source=source, mode=mode, max_tokens=64, seed=0)
    seed_everything(0)
    size = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "n_embd": 16, "intermediate_size": 32, "max_seq_len": 64}
    model = ReferenceLM(vocab_size=40, **size)
    clock = FakeClock()
    recorder, monitor = Recorder(clock), PackingMonitor(clock=clock, peak_flops=PEAK)
    fit = trainer(tmp_path, monitor, max_steps=6, log_every_n_steps=3, callbacks=[recorder, monitor],
                  enable_progress_bar=False, use_distributed_sampler=False)  # fmt: skip
    fit.fit(model, datamodule=data)
    return fit, recorder, model


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_cpu_fit_logs_mfu_of_the_real_documents(tmp_path: Path, mode: str) -> None:
    fit, recorder, model = _fit(tmp_path, mode)
    rows = read_rows(fit, "train/mfu")
    assert len(rows) == 2 and all(0 < row["train/mfu"] <= 1 for row in rows)
    for window, row in zip((recorder.lengths[:3], recorder.lengths[3:6]), rows, strict=True):
        flops = sum(training_flops(model, lengths) for lengths in window)
        rate = flops / (SECONDS_PER_MICROBATCH * len(window))
        assert row["train/tflops"] == pytest.approx(rate / 1e12, rel=1e-6)
        assert row["train/mfu"] == pytest.approx(rate / PEAK, rel=1e-6)


def test_without_peak_flops_nothing_is_counted_and_bad_peaks_are_refused(tmp_path: Path) -> None:
    assert not PackingMonitor()._flops.counting
    for bad in (0, -1.0, float("inf"), "fast", True):
        with pytest.raises(ValueError, match="peak_flops must be 'auto', None or a device's peak FLOP/s"):
            PackingMonitor(peak_flops=bad)  # type: ignore[arg-type]
    monitor = PackingMonitor(peak_flops="auto")
    from lit_seqpack import ReferenceLM

    with pytest.raises(ValueError, match="peak_flops='auto' knows CUDA devices only"):
        trainer(tmp_path, monitor).fit(ReferenceLM(n_layer=1, n_embd=16, n_head=2, n_kv_head=1), train_dataloaders=[])
