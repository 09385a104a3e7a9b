"""``gather_rollout`` on 2 gloo ranks: each rank's generated samples (different counts, groups numbered per rank,
token and sample fields) become one identical rollout on every rank, in rank order; mismatched fields raise on every
rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_seqpack.rl import Rollout
from lit_seqpack.rl.gather import gather_rollout
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests.rl._rollouts import make_rollout

WORLD = 2


def _local_samples(rank: int, *, with_field: bool = True):
    """Rank 0 generates 5 samples in 3 groups, rank 1 three in 2 groups, each numbering its groups from 0."""
    count, groups = (5, [0, 0, 1, 1, 2]) if rank == 0 else (3, [0, 0, 1])
    local = make_rollout(count=count, seed=20 + rank)
    fields = {"adv": [torch.full((n,), float(10 * rank + i)) for i, n in enumerate(local.lengths.tolist())]}
    return Rollout(
        input_ids=local.input_ids,
        loss_mask=local.loss_mask,
        token_fields=fields if with_field else {},
        sample_fields={"reward": torch.arange(count) + 100.0 * rank},
        group_ids=groups,
    )


def _gather_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        local = _local_samples(rank)
        rollout = gather_rollout(local)
        results = {
            "fingerprint": rollout.fingerprint(),
            "ids": [x.tolist() for x in rollout.input_ids],
            "groups": rollout.group_ids.tolist(),
            "global": gather_rollout(local, group_ids="global").group_ids.tolist(),
            "adv": [float(a[0]) for a in rollout.token_fields["adv"]],
            "reward": rollout.sample_fields["reward"].tolist(),
            "one_rank": len(gather_rollout(local if rank == 1 else None)),
        }
        try:
            gather_rollout(_local_samples(rank, with_field=rank == 0))
            results["mismatch"] = "no error"
        except ValueError as err:
            results["mismatch"] = str(err)
        dist.barrier()
        torch.save(results, Path(out_dir, f"gather{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gather_rollout_builds_one_identical_rollout_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_gather_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"gather{rank}.pt") for rank in range(WORLD)]
    assert results[0] == results[1]  # every rank holds the same rollout
    ours = results[0]
    expected_ids = [x.tolist() for rank in range(WORLD) for x in _local_samples(rank).input_ids]
    assert ours["ids"] == expected_ids  # rank 0's samples, then rank 1's
    assert ours["groups"] == [0, 0, 1, 1, 2, 3, 3, 4]  # each rank's groups stay apart
    assert ours["global"] == [0, 0, 1, 1, 2, 0, 0, 1]
    assert ours["adv"] == [0.0, 1.0, 2.0, 3.0, 4.0, 10.0, 11.0, 12.0]
    assert ours["reward"] == [0.0, 1.0, 2.0, 3.0, 4.0, 100.0, 101.0, 102.0]
    assert ours["one_rank"] == 3
    assert "the ranks declare different fields" in ours["mismatch"]
