"""Runs for the resume tests: one uninterrupted run that writes checkpoints at chosen microbatches, and resumes.

The uninterrupted run is the reference: every trained microbatch is logged (``TrainedLog`` of ``_train_script``:
epoch, step, batch index, dataset indices, loss) and ``SaveAt`` writes a checkpoint after chosen microbatches (a
step boundary mid-epoch, inside an accumulation window, the end of an epoch). Up to a checkpoint the reference *is*
the run that wrote it, so a resume from it must log exactly the reference's records after that point.

Strategies (``strategy_for``):

- ``"ddp"`` / ``"single"``: the DataModule's state is restored before the train loader is built;
- ``"late"``: one process whose strategy restores the checkpoint after the loader is built, as FSDP,
  ModelParallel and DeepSpeed do;
- ``"fsdp2"``: ``ModelParallelStrategy`` (data-parallel 2, tensor-parallel 1; ``FSDP2Model`` shards itself);
- ``"fsdp1"``: ``CPUFSDPStrategy``, ``FSDPStrategy`` on CPU (a test helper, not a supported configuration).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy

from lit_seqpack import ReferenceLM
from lit_seqpack.planning.plan import build_plan
from tests._limits import SUBPROCESS_TIMEOUT_S
from tests._ranks import free_port
from tests.reliability import _train_script as script

ACCUMULATE = 2
EPOCHS = 2


class LateRestoreStrategy(SingleDeviceStrategy):
    """One CPU process that restores the checkpoint after the train loader is built (as FSDP does)."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on CPU/gloo: Lightning refuses FSDP without a GPU unless the strategy is a subclass, and
    FSDP1 needs ``device_id=torch.device("cpu")`` (Lightning passes ``root_device.index``, ``None`` on CPU)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs
        )


class FSDP2Model(ReferenceLM):
    """``ReferenceLM`` that shards itself with FSDP2 over ``ModelParallelStrategy``'s data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def strategy_for(name: str) -> tuple[Strategy | str, int]:
    """The strategy and device count of a strategy name (see the module docstring)."""
    if name == "single":
        return "auto", 1
    if name == "late":
        return LateRestoreStrategy(device=torch.device("cpu")), 1
    if name == "ddp":
        return "ddp", 2
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2
    if name == "fsdp1":
        return CPUFSDPStrategy(state_dict_type="sharded"), 2
    raise ValueError(f"unknown strategy {name!r}")


class SaveAt(Callback):
    """Writes ``trainer.save_checkpoint(path)`` after the microbatch ``(epoch, batch_idx)`` of each point."""

    def __init__(self, points: dict[tuple[int, int], Path]) -> None:
        self.points = points

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        path = self.points.get((trainer.current_epoch, batch_idx))
        if path is not None:
            trainer.save_checkpoint(path)


def epoch_length(mode: str, world_size: int = 1) -> int:
    """Microbatches per rank in an epoch of the run."""
    datamodule = make_datamodule(mode, 0)
    _, lengths, loss_tokens = datamodule.splits["train"]
    config = datamodule.plan_config(world_size=world_size, accumulate_grad_batches=ACCUMULATE)
    return build_plan(lengths, config, epoch=0, loss_tokens=loss_tokens).microbatches_per_rank


def epoch_checkpoints(out: Path, steps_per_epoch: int) -> list[Callback]:
    """``ModelCheckpoint`` at every epoch's end (``out/epochs/epoch=E.ckpt``, written in ``on_train_epoch_end``)
    and every ``steps_per_epoch`` optimizer steps (``out/steps/step=S.ckpt``: after the epoch's last microbatch)."""
    return [
        ModelCheckpoint(dirpath=out / "epochs", filename="{epoch}", save_top_k=-1),
        ModelCheckpoint(dirpath=out / "steps", filename="{step}", every_n_train_steps=steps_per_epoch, save_top_k=-1),
    ]


def make_datamodule(mode: str, num_workers: int, **overrides: Any) -> script.RecordingDataModule:
    """The run's DataModule: ``IndexedSamples`` batched in ``mode`` (``overrides``: other DataModule knobs)."""
    budget = {"max_tokens": None, "batch_size": 6} if mode == "padded" else {"max_tokens": script.MAX_TOKENS}
    return script.RecordingDataModule(
        source=script.IndexedSamples(), mode=mode, num_workers=num_workers, **(budget | overrides)
    )


def fit(
    out: Path,
    *,
    strategy: str = "single",
    mode: str = "packing",
    num_workers: int = 0,
    ckpt_path: Path | None = None,
    save: dict[tuple[int, int], Path] | None = None,
    callbacks: list[Callback] | None = None,
    data: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
) -> None:
    """One run of ``EPOCHS`` epochs (accumulation ``ACCUMULATE``, a cosine schedule reading
    ``estimated_stepping_batches``), logging every trained microbatch to ``out/rank{r}.jsonl``.

    Args:
        out: where the records go.
        strategy: see :func:`strategy_for`.
        mode: the batching mode.
        num_workers: DataLoader workers.
        ckpt_path: resume from this checkpoint.
        save: checkpoints to write, by ``(epoch, batch_idx)``.
        callbacks: more callbacks.
        data: other DataModule knobs.
        trainer: other Trainer arguments (``accumulate_grad_batches`` and ``max_epochs`` included).
    """
    out.mkdir(parents=True, exist_ok=True)
    engine, devices = strategy_for(strategy)
    options = {"max_epochs": EPOCHS, "accumulate_grad_batches": ACCUMULATE} | (trainer or {})
    runner = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=engine,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks or []),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        callbacks=[script.TrainedLog(out), SaveAt(save or {}), *(callbacks or [])],
        **options,
    )
    model = script.make_model()  # seeded: the same initial weights in every run
    if strategy == "fsdp2":
        L.seed_everything(0, verbose=False)
        model = FSDP2Model(**model.hparams)
    runner.fit(model, datamodule=make_datamodule(mode, num_workers, **(data or {})), ckpt_path=ckpt_path)


def records(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    """The microbatches a run trained on ``rank``, in order."""
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def after(reference: list[dict[str, Any]], point: tuple[int, int]) -> list[dict[str, Any]]:
    """The reference's records after the microbatch ``point = (epoch, batch_idx)``: what a resume must train."""
    return [r for r in reference if (r["epoch"], r["batch_idx"]) > point]


def compare(resumed: list[dict[str, Any]], expected: list[dict[str, Any]], *, losses: bool = True) -> str | None:
    """``None`` when the resumed run trained the expected microbatches (and losses); else the first difference."""
    fields = ("epoch", "step", "batch_idx", "indices", "loss") if losses else ("epoch", "step", "batch_idx", "indices")
    if len(resumed) != len(expected):
        return f"{len(resumed)} microbatches trained, expected {len(expected)}"
    for got, want in zip(resumed, expected, strict=True):
        diff = {k: (got[k], want[k]) for k in fields if got[k] != want[k]}
        if diff:
            return f"at epoch {want['epoch']} microbatch {want['batch_idx']}: {diff}"
    return None


def run_ranks(command: list[str], logs: Path, what: str) -> None:
    """Run ``command`` once per rank of ``script.WORLD`` gloo ranks (one process group), each writing its output to
    ``logs/stdout<rank>.txt``; fail naming ``what`` if any rank fails, and kill every rank if they hang."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env |= {"WORLD_SIZE": str(script.WORLD), "NODE_RANK": "0"}
    root = Path(__file__).resolve().parents[2]
    processes = []
    for rank in range(script.WORLD):
        log = (logs / f"stdout{rank}.txt").open("w")
        processes.append(
            subprocess.Popen(
                command,
                cwd=root,
                env=env | {"LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        codes = [process.wait(timeout=SUBPROCESS_TIMEOUT_S) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"{what} hung:\n{(logs / 'stdout0.txt').read_text()[-4000:]}")
    outputs = "".join((logs / f"stdout{rank}.txt").read_text()[-4000:] for rank in range(script.WORLD))
    assert codes == [0] * script.WORLD, outputs
