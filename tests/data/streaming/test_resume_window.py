"""A stream checkpoint written inside a gradient-accumulation window (``OnExceptionCheckpoint``) resumes exactly.

The checkpoint holds the weights of the optimizer step's start but not the gradient of its first microbatches, so
the resume goes back to the step's first microbatch and trains it again, as map-style data does
(:func:`~lit_seqpack.data._trainer.check_start`). A cosine schedule reads ``trainer.estimated_stepping_batches``,
which makes Lightning fetch the stream's first batch before it restores the loop counters; a constant one does not.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack import ReferenceLM
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests.reliability import _stream_train_script as script

ACCUMULATE = 2


class FailAt(L.Callback):
    """Raises in the backward of microbatch ``batch_idx`` of epoch 0: Lightning's counters then stand mid-step."""

    def __init__(self, batch_idx: int) -> None:
        self.at, self._batch = batch_idx, -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._batch = batch_idx

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        if self._batch == self.at:
            raise RuntimeError("simulated failure")


def _fit(
    out: Path,
    schedule: str,
    callbacks: list[L.Callback],
    ckpt: Path | None = None,
    *,
    max_epochs: int = 1,
    devices: int = 1,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = ReferenceLM(
        vocab_size=script.VOCAB, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64,
        max_seq_len=script.MAX_TOKENS, lr=3e-3, lr_schedule=schedule, attn_backend="sdpa",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT) if devices > 1 else "auto",
        max_epochs=max_epochs,
        accumulate_grad_batches=ACCUMULATE,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[script.StreamTrainedLog(out), *callbacks],
    )
    trainer.fit(model, datamodule=script.make_datamodule(num_workers=1), ckpt_path=ckpt)


def _records(out: Path, rank: int = 0) -> list[str]:
    return (out / f"rank{rank}.jsonl").read_text().splitlines()


def _batch_idx(record: str) -> int:
    return int(record.split('"batch_idx": ')[1].split(",")[0])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_an_exception_checkpoint_inside_a_window_resumes_from_the_start_of_its_step(
    tmp_path: Path, schedule: str
) -> None:
    _fit(tmp_path / "reference", schedule, [])
    expected = _records(tmp_path / "reference")
    for batch_idx in (6, 7):  # the first microbatch of optimizer step 3, then its second: both resume at 6
        run = tmp_path / str(batch_idx)
        saver = OnExceptionCheckpoint(run)
        with pytest.raises(RuntimeError, match="simulated failure"):
            _fit(run / "failed", schedule, [saver, FailAt(batch_idx)])
        _fit(run / "resumed", schedule, [], ckpt=Path(saver.ckpt_path))
        resumed = _records(run / "resumed")
        assert _batch_idx(resumed[0]) == 6, batch_idx
        assert [r for r in expected if _batch_idx(r) < 6] + resumed == expected, batch_idx


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_checkpoint_written_at_the_end_of_an_epoch_resumes_at_the_next_epochs_start(
    tmp_path: Path, schedule: str
) -> None:
    """``save_last`` writes in the epoch-end hooks, where Lightning's epoch counter is already the next epoch's."""
    _fit(tmp_path / "reference", schedule, [], max_epochs=2)
    expected = [r for r in _records(tmp_path / "reference") if r.startswith('{"epoch": 1,')]
    _fit(tmp_path / "first", schedule, [ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    _fit(tmp_path / "resumed", schedule, [], ckpt=tmp_path / "ckpt" / "last.ckpt", max_epochs=2)
    assert expected and _records(tmp_path / "resumed") == expected


def _ddp_worker(rank: int, port: int, root: str) -> None:
    join_ranks(rank, 2, port)
    run = Path(root)
    _fit(run / "reference", "cosine", [], devices=2)
    saver = OnExceptionCheckpoint(run / "ckpt")
    try:
        _fit(run / "failed", "cosine", [saver, FailAt(7)], devices=2)
    except RuntimeError as err:
        assert "simulated failure" in str(err), err
    _fit(run / "resumed", "cosine", [], ckpt=Path(saver.ckpt_path), devices=2)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_ddp_ranks_resume_an_exception_checkpoint_inside_a_window_from_the_start_of_its_step(
    tmp_path: Path,
) -> None:
    """The cosine schedule fetches each rank's first batch before the restore, as in the streaming crash tests."""
    mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        expected, resumed = _records(tmp_path / "reference", rank), _records(tmp_path / "resumed", rank)
        assert _batch_idx(resumed[0]) == 6, rank
        assert [r for r in expected if _batch_idx(r) < 6] + resumed == expected, rank
