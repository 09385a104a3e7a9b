"""SIGKILL a 2-process DDP CPU run mid-epoch, resume it from its last checkpoint, and prove nothing was lost.

Three runs of ``_train_script.py`` (Lightning starts the second rank itself): an uninterrupted reference and a
run killed (SIGKILL to its whole process group) after optimizer step ``KILL_AT`` run side by side, then the killed
run is resumed from its ``last.ckpt``. Every rank logs each trained microbatch's dataset indices (carried in the
batch) and its loss. The microbatches the killed run trained after its last checkpoint are lost with it; the rule
is that the checkpointed prefix plus the resumed run train every sample exactly once per epoch, in the same
microbatches, with the same losses and the same final weights as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_seqpack import PlannedBatchSampler
from lit_seqpack.planning.config import PlanConfig
from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S, stages_timeout
from tests._ranks import free_port
from tests.reliability import _train_script as script

SCRIPT = Path(script.__file__)
ROOT = SCRIPT.parents[2]
KILL_AT = 10  # optimizer steps; checkpoints every 4 steps, so the last one before the kill is step 8 (epoch 1)


def _start(script: Path, out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
        env.pop(key, None)
    out.mkdir(parents=True)
    log = (out / "stdout.txt").open("w")
    command = [sys.executable, str(script), "--out", str(out), *args]
    # its own session: the SIGKILL of the process group reaches both ranks and the workers, not pytest
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(process: subprocess.Popen, out: Path) -> int:
    try:
        return process.wait(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # never leave a hung run behind
        process.wait()
        pytest.fail(f"{out.name} run hung for {SUBPROCESS_TIMEOUT_S} s:\n{(out / 'stdout.txt').read_text()[-4000:]}")


def _records(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def run_killed_and_resumed(script: Path, root: Path, kill_at: int, *args: str) -> dict[str, Path]:
    """Run ``script`` uninterrupted (``reference``) and SIGKILLed after step ``kill_at`` (``killed``) side by side,
    then resume the killed run from its last checkpoint (``resumed``); return the three output folders. ``args``
    go to all three runs."""
    return run_variants_killed_and_resumed(script, root, kill_at, {"": list(args)})[""]


def run_variants_killed_and_resumed(
    script: Path, root: Path, kill_at: int, variants: dict[str, list[str]]
) -> dict[str, dict[str, Path]]:
    """:func:`run_killed_and_resumed` for several variants of a run (``variants``: name -> the arguments of its runs),
    each with its own reference run: the references and the killed runs side by side, then the resumes side by side.
    Return each variant's ``reference``, ``killed`` and ``resumed`` folders (the variant's name is their suffix, if
    any)."""
    dirs = {
        name: {run: root / "_".join(filter(None, (run, name))) for run in ("reference", "killed", "resumed")}
        for name in variants
    }
    started = {}
    for name, args in variants.items():
        started[dirs[name]["reference"]] = _start(script, dirs[name]["reference"], *args)
        started[dirs[name]["killed"]] = _start(script, dirs[name]["killed"], "--kill-at-step", str(kill_at), *args)
    codes = {out: _wait(process, out) for out, process in started.items()}
    for name in variants:
        reference = dirs[name]["reference"]
        assert codes.pop(reference) == 0, (reference / "stdout.txt").read_text()[-4000:]
    for out, code in codes.items():
        assert code == -signal.SIGKILL, (out / "stdout.txt").read_text()[-4000:]
    resumed = {
        dirs[name]["resumed"]: _start(
            script, dirs[name]["resumed"], "--ckpt-path", str(dirs[name]["killed"] / "checkpoints" / "last.ckpt"), *args
        )
        for name, args in variants.items()
    }
    for out, process in resumed.items():
        assert _wait(process, out) == 0, (out / "stdout.txt").read_text()[-4000:]
    return dirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return run_killed_and_resumed(SCRIPT, tmp_path_factory.mktemp("crash_resume"), KILL_AT)


def _key(record: dict) -> tuple[int, int, int]:
    return record["epoch"], record["step"], record["batch_idx"]


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))  # the runs fixture: reference and killed side by side, then resumed
def test_killed_and_resumed_run_trains_every_sample_once_with_the_same_losses(runs: dict[str, Path]) -> None:
    checkpoint = torch.load(runs["killed"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    saved_step = checkpoint["global_step"]
    reference = {rank: _records(runs["reference"], rank) for rank in range(script.WORLD)}
    steps_per_epoch = len(reference[0]) // script.EPOCHS // script.ACCUMULATE
    assert 0 < saved_step < KILL_AT and saved_step % steps_per_epoch, "the checkpoint must be mid-epoch"
    for rank in range(script.WORLD):
        killed = _records(runs["killed"], rank)
        # the killed run trained past its checkpoint: those microbatches died with it and must be trained again
        assert max(r["step"] for r in killed) >= saved_step
        prefix = [r for r in killed if r["step"] < saved_step]
        resumed = _records(runs["resumed"], rank)
        assert min(r["step"] for r in resumed) == saved_step  # no checkpointed microbatch trained twice
        combined = prefix + resumed
        assert [_key(r) for r in combined] == [_key(r) for r in reference[rank]]
        for got, want in zip(combined, reference[rank], strict=True):
            assert got["indices"] == want["indices"] == got["planned"]
            assert got["loss"] == want["loss"], _key(got)  # bitwise: same plan, weights, optimizer state, order
        reference[rank] = combined
    counts_per_epoch = {len([r for r in reference[rank] if r["epoch"] == 0]) for rank in range(script.WORLD)}
    assert len(counts_per_epoch) == 1  # lock-step: the same number of microbatches on every rank
    for epoch in range(script.EPOCHS):
        trained = Counter(
            i for rank in range(script.WORLD) for r in reference[rank] if r["epoch"] == epoch for i in r["indices"]
        )
        assert trained == Counter(range(script.NUM_SAMPLES)), f"epoch {epoch}: every sample exactly once"
    final = {
        name: torch.load(runs[name] / "final.ckpt", map_location="cpu", weights_only=False)
        for name in ("reference", "resumed")
    }
    assert final["reference"]["global_step"] == final["resumed"]["global_step"] == script.EPOCHS * steps_per_epoch
    for name, weight in final["reference"]["state_dict"].items():
        assert torch.equal(final["resumed"]["state_dict"][name], weight), name


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))  # the runs fixture, when this test runs alone
def test_resuming_a_two_rank_checkpoint_on_one_rank_fails_naming_the_world_size(runs: dict[str, Path]) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=script.EPOCHS,
        accumulate_grad_batches=script.ACCUMULATE,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=runs["resumed"],
    )
    with pytest.raises(ValueError, match=r"world_size: checkpoint 2 vs now 1"):
        trainer.fit(
            script.make_model(),
            datamodule=script.make_datamodule(num_workers=0),
            ckpt_path=runs["killed"] / "checkpoints" / "last.ckpt",
        )


def _fit_in_process(out: Path, *, ckpt_path: Path | None = None, save_at: int | None = None) -> None:
    out.mkdir()
    callbacks: list[L.Callback] = [script.TrainedLog(out)]
    if save_at is not None:  # at the end of every epoch, and at optimizer step save_at
        callbacks += [
            ModelCheckpoint(dirpath=out / "epochs", filename="{epoch}", save_top_k=-1),
            ModelCheckpoint(dirpath=out / "steps", filename="{step}", every_n_train_steps=save_at, save_top_k=-1),
        ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=script.EPOCHS,
        accumulate_grad_batches=script.ACCUMULATE,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=save_at is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=callbacks,
    )
    # ReferenceLM's default cosine schedule reads trainer.estimated_stepping_batches in configure_optimizers,
    # which makes Lightning build the train loader before it reads the checkpoint (Lightning #20550)
    trainer.fit(script.make_model(), datamodule=script.make_datamodule(num_workers=1), ckpt_path=ckpt_path)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_resume_with_a_schedule_that_reads_estimated_stepping_batches_continues_where_it_stopped(
    tmp_path: Path,
) -> None:
    """Regression: the resumed epoch restarted from its first microbatch (samples trained twice, others never)."""
    lengths = script.IndexedSamples().lengths
    sampler = PlannedBatchSampler(
        lengths, PlanConfig(mode="packing", max_tokens=script.MAX_TOKENS, accumulate_grad_batches=script.ACCUMULATE)
    )
    steps_per_epoch = len(sampler) // script.ACCUMULATE
    mid_second_epoch = steps_per_epoch + steps_per_epoch // 2
    _fit_in_process(tmp_path / "reference", save_at=mid_second_epoch)
    reference = _records(tmp_path / "reference", 0)
    assert len(reference) == script.EPOCHS * len(sampler)
    saved = tmp_path / "reference"
    checkpoints = {saved / "epochs" / "epoch=0.ckpt": steps_per_epoch}  # end of epoch 0
    checkpoints[saved / "steps" / f"step={mid_second_epoch}.ckpt"] = mid_second_epoch  # mid epoch 1
    for ckpt, step in checkpoints.items():
        _fit_in_process(tmp_path / ckpt.stem, ckpt_path=ckpt)
        done = [r for r in reference if r["step"] < step]
        assert done + _records(tmp_path / ckpt.stem, 0) == reference, ckpt.name
