"""``overlong="split"`` on 2 gloo ranks: map-style data (plan with its cross-rank content check) and a stream read by
rank (lock step by collective), every token of every sample trained once over the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests.data.test_overlong_split import MAX_TOKENS, FakeTrainer, check_epoch, module, records, stream

WORLD, ACCUMULATE = 2, 2


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_ranks(rank, WORLD, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        samples = records(60)
        sources = {"indexed": samples, "stream": stream(samples)}
        for name, source in sources.items():
            extra = {"window": 8, "stream_split": "rank"} if name == "stream" else {}
            dm = module(source, content_check_samples=8, **extra)
            dm.trainer = FakeTrainer(WORLD, rank, ACCUMULATE)
            dm.setup("fit")
            batches = list(dm.train_dataloader())
            torch.save({"batches": batches, "report": dm.overlong_report}, Path(out_dir, f"{name}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("split_ddp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("name", ["indexed", "stream"])
def test_two_gloo_ranks_train_every_token_once(runs: Path, name: str) -> None:
    saved = [torch.load(runs / f"{name}{rank}.pt", weights_only=False) for rank in range(WORLD)]
    check_epoch([s["batches"] for s in saved], records(60), budget=MAX_TOKENS, accumulate=ACCUMULATE, mode="packing")
    for s in saved:
        assert all(b["world_size"] == WORLD for b in s["batches"])
    if name == "indexed":  # every rank applies the policy to all the data (a stream's report counts its share)
        assert saved[0]["report"] == saved[1]["report"] and saved[0]["report"].num_split > 0
    else:
        reports = [s["report"] for s in saved]
        assert sum(r.num_samples for r in reports) == 60 and all(r.num_pieces > 0 for r in reports)
