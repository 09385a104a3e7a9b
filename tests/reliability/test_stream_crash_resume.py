"""SIGKILL a 2-process DDP CPU run on a stream mid-epoch, resume it from ``last.ckpt``, and prove nothing was lost.

The same protocol as ``test_crash_resume`` with ``_stream_train_script`` (a generator read as a stream, windows of
40 samples, each rank reading its own share (``stream_split="rank"``), 2 or 0 loader workers per rank): the
checkpointed prefix of the killed run plus the resumed run train the
same microbatches with bitwise the same losses as the uninterrupted run, every sample exactly once per epoch over
both ranks, the same number of microbatches on each rank, and end with the same weights. With 2 workers each worker
reads its own lane of the rank's share (other microbatches than without workers), so each worker count has its own
uninterrupted run, run side by side with the killed ones.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests._limits import stages_timeout
from tests.reliability import _stream_train_script as script
from tests.reliability.test_crash_resume import _key, _records, run_variants_killed_and_resumed

SCRIPT = Path(script.__file__)
KILL_AT = 18  # 12 steps an epoch, checkpoints every 4: the last one before the kill is step 16 (epoch 1, mid-stream)


WORKERS = {"2_workers": 2, "0_workers": 0}


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """The uninterrupted, killed and resumed runs of each loader-worker count."""
    root = tmp_path_factory.mktemp("stream_crash_resume")
    variants = {name: ["--num-workers", str(count)] for name, count in WORKERS.items()}
    return run_variants_killed_and_resumed(SCRIPT, root, KILL_AT, variants)


@pytest.fixture(params=list(WORKERS))
def runs(request: pytest.FixtureRequest, worker_runs: dict[str, dict[str, Path]]) -> dict[str, Path]:
    return worker_runs[request.param]


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))  # the runs fixture: killed and reference, then resumed
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
@pytest.mark.timeout(stages_timeout(2))  # the runs fixture, when this test runs alone
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
