"""SIGKILL a 2-process DDP CPU run on a stream mid-epoch, resume it from ``last.ckpt``, and prove nothing was lost.

The same protocol as ``test_crash_resume`` with ``_stream_train_script`` (a generator read as a stream, windows of
40 samples, 2 loader workers per rank): the checkpointed prefix of the killed run plus the resumed run train the
same microbatches with bitwise the same losses as the uninterrupted run, every sample exactly once per epoch over
both ranks, the same number of microbatches on each rank, and end with the same weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.reliability import _stream_train_script as script
from tests.reliability.test_crash_resume import RUN_TIMEOUT_S, _free_port, _key, _records

SCRIPT = Path(script.__file__)
ROOT = SCRIPT.parents[2]
KILL_AT = 18  # 12 steps an epoch, checkpoints every 4: the last one before the kill is step 16 (epoch 1, mid-stream)


def _start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK"):
        env.pop(key, None)
    out.mkdir(parents=True)
    log = (out / "stdout.txt").open("w")
    command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(process: subprocess.Popen, out: Path) -> int:
    try:
        return process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"{out.name} run hung for {RUN_TIMEOUT_S} s:\n{(out / 'stdout.txt').read_text()[-4000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream_crash_resume")
    dirs = {name: root / name for name in ("reference", "killed", "resumed")}
    reference, killed = _start(dirs["reference"]), _start(dirs["killed"], "--kill-at-step", str(KILL_AT))
    codes = {"reference": _wait(reference, dirs["reference"]), "killed": _wait(killed, dirs["killed"])}
    assert codes["reference"] == 0, (dirs["reference"] / "stdout.txt").read_text()[-4000:]
    assert codes["killed"] == -signal.SIGKILL, (dirs["killed"] / "stdout.txt").read_text()[-4000:]
    resumed = _start(dirs["resumed"], "--ckpt-path", str(dirs["killed"] / "checkpoints" / "last.ckpt"))
    assert _wait(resumed, dirs["resumed"]) == 0, (dirs["resumed"] / "stdout.txt").read_text()[-4000:]
    return dirs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ddp_stream_trains_every_sample_once_in_lock_step(runs: dict[str, Path]) -> None:
    reference = [_records(runs["reference"], rank) for rank in range(script.WORLD)]
    for epoch in range(script.EPOCHS):
        per_rank = [[r for r in records if r["epoch"] == epoch] for records in reference]
        assert len({len(records) for records in per_rank}) == 1  # lock step: the same count on each rank
        assert len(per_rank[0]) % script.ACCUMULATE == 0
        for step in {r["step"] for r in per_rank[0]}:  # each step's normaliser is the same on every rank
            assert len({r["step_loss_tokens"] for records in per_rank for r in records if r["step"] == step}) == 1
        trained = Counter(i for records in per_rank for r in records for i in r["indices"])
        assert trained == Counter(range(script.NUM_SAMPLES)), f"epoch {epoch}: every sample exactly once"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_stream_run_resumes_exactly(runs: dict[str, Path]) -> None:
    checkpoint = torch.load(runs["killed"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    saved_step = checkpoint["global_step"]
    reference = {rank: _records(runs["reference"], rank) for rank in range(script.WORLD)}
    steps_per_epoch = len(reference[0]) // script.EPOCHS // script.ACCUMULATE
    assert saved_step > steps_per_epoch and saved_step % steps_per_epoch, "the checkpoint must be mid-epoch 1"
    for rank in range(script.WORLD):
        killed = _records(runs["killed"], rank)
        assert max(r["step"] for r in killed) >= saved_step  # trained past the checkpoint, then lost
        prefix = [r for r in killed if r["step"] < saved_step]
        resumed = _records(runs["resumed"], rank)
        assert min(r["step"] for r in resumed) == saved_step
        combined = prefix + resumed
        assert [_key(r) for r in combined] == [_key(r) for r in reference[rank]]
        for got, want in zip(combined, reference[rank], strict=True):
            assert got["indices"] == want["indices"]
            assert got["loss"] == want["loss"], _key(got)
    final = {
        name: torch.load(runs[name] / "final.ckpt", map_location="cpu", weights_only=False)
        for name in ("reference", "resumed")
    }
    for name, weight in final["reference"]["state_dict"].items():
        assert torch.equal(final["resumed"]["state_dict"][name], weight), name
