"""A loader worker stuck at start-up on one rank ends the job on every rank within ``loader_timeout`` (2 gloo ranks).

Before: the plan check's collective ran at the batch sampler's first ``next()``, behind torch's unbounded wait for
every worker's start-up acknowledgement; a worker blocked on one rank parked that rank in the wait and the other
inside gloo (for the process group's timeout). Now the check runs before the workers start, the wait is bounded and
every rank learns that one rank's workers are stuck.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.indexed._loader import ResumableDataLoader
from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler, PlannedDataset
from lit_seqpack.data.workers import worker_options
from lit_seqpack.planning.config import PlanConfig
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks, spawn_ranks

WORLD = 2
LOADER_TIMEOUT = 12.0  # small, but far above a healthy worker's start-up on a loaded box
STALLED_RANK = 1
SAMPLES = [{"input_ids": list(range(1, 2 + i % 7))} for i in range(24)]


class _StallOn:
    """A ``worker_init_fn`` that blocks (far past the loader timeout) in the workers of one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        if self.rank == STALLED_RANK:
            time.sleep(600)


def _collate(samples: list[dict]) -> int:
    return len(samples)


def _loader(rank: int, data: list[dict], worker_init_fn: _StallOn | None = None) -> ResumableDataLoader:
    config = PlanConfig(mode="packing", max_tokens=16, world_size=WORLD, shuffle=False)
    sampler = PlannedBatchSampler([len(s["input_ids"]) for s in data], config, rank=rank)
    return ResumableDataLoader(
        PlannedDataset(data),
        batch_sampler=sampler,
        collate_fn=_collate,
        num_workers=1,
        worker_init_fn=worker_init_fn,
        name="train",
        loader_timeout=LOADER_TIMEOUT,
    )


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        return {"error": None, "seconds": time.monotonic() - start}
    except RuntimeError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_ranks(rank, WORLD, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    outcome = {"context": type(worker_options(1, 1.0, SAMPLES)["multiprocessing_context"]).__name__}
    outcome["healthy"] = _outcome(lambda: next(iter(_loader(rank, SAMPLES))))
    outcome["stalled"] = _outcome(lambda: next(iter(_loader(rank, SAMPLES, _StallOn(rank)))))
    # other data with equal lengths, with workers: refused on every rank, before any worker starts
    shifted = [{"input_ids": [t + rank for t in s["input_ids"]]} for s in SAMPLES]
    module = SeqPackDataModule(source=shifted, max_tokens=16, num_workers=1, loader_timeout=LOADER_TIMEOUT)
    outcome["different"] = _outcome(lambda: next(iter(module.train_dataloader())))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("workers_ddp")
    spawn_ranks(_worker, (free_port(), str(out)), WORLD)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_workers_start_with_forkserver_under_torch_distributed(outcomes: list[dict]) -> None:
    for outcome in outcomes:
        assert outcome["context"] == "ForkServerContext"
        assert outcome["healthy"]["error"] is None


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_worker_stuck_at_start_up_on_one_rank_ends_every_rank_within_the_loader_timeout(
    outcomes: list[dict],
) -> None:
    stalled, other = outcomes[STALLED_RANK]["stalled"], outcomes[1 - STALLED_RANK]["stalled"]
    assert stalled["error"].startswith(f"the train loader on rank {STALLED_RANK} of 2 got nothing from its worker")
    assert f"loader_timeout={LOADER_TIMEOUT:g} s" in stalled["error"]
    assert other["error"].startswith(f"the train loader on rank {1 - STALLED_RANK} of 2 stops because")
    assert f"rank {STALLED_RANK}: the train loader on rank {STALLED_RANK} of 2 got nothing" in other["error"]
    for outcome in (stalled, other):  # within the loader timeout (plus start-up), not the process group's 10 min
        assert outcome["seconds"] < LOADER_TIMEOUT + 60


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ranks_that_read_different_data_are_still_refused_with_workers(outcomes: list[dict]) -> None:
    for rank, outcome in enumerate(outcomes):
        assert f"rank {rank} reads different data than ranks [{1 - rank}]" in outcome["different"]["error"]
