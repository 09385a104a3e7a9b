"""The metrics synchronise over two gloo processes with deliberately unequal tokens and elapsed times."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_seqpack.metrics import PackingEfficiency, PaddingRatio, RankImbalance, TokensPerSecond
from lit_seqpack.metrics.tracker import PackingTracker
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S

WORLD_SIZE = 2

# rank 0 trains 1000 real tokens (2 microbatches) in 1 s; rank 1 trains 3000 (3 microbatches) in 4 s.
# True throughput: 4000 tokens / 4 s = 1000 tokens/s. Rank 0's rate times the world size: 2 * 1000 = 2000.
RANK_BATCHES = {
    0: [(600, 424), (400, 624)],
    1: [(1024, 0), (1000, 24), (976, 48)],
}
RANK_ELAPSED = {0: 1.0, 1: 4.0}
# optimizer steps of each rank (real tokens): step 1 (600 vs 1024 + 1000), step 2 (400 vs 976)
RANK_STEPS = {0: [[0], [1]], 1: [[0, 1], [2]]}


def _batch(real: int, padding: int) -> dict:
    return {"num_real_tokens": real, "num_padding_tokens": padding, "max_tokens": 1024, "is_empty": False}


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        batches = [_batch(*counts) for counts in RANK_BATCHES[rank]]
        real, computed = TokensPerSecond(), TokensPerSecond(tokens="computed")
        padding, packing, imbalance = PaddingRatio(), PackingEfficiency(), RankImbalance()
        tracker = PackingTracker()
        for batch in batches:
            for metric in (real, computed, padding, packing):
                metric.update(batch)
        for metric in (real, computed):
            metric.update(elapsed=RANK_ELAPSED[rank])
        for step in RANK_STEPS[rank]:
            imbalance.update([batches[i] for i in step])
            for position, i in enumerate(step):
                tracker.update(batches[i], step_end=position == len(step) - 1)
        window = tracker.flush(elapsed=RANK_ELAPSED[rank])
        unequal = RankImbalance()
        for _ in range(rank + 1):  # rank 0 closes one step, rank 1 two: lock-step broken
            unequal.update(batches[0])
        try:
            unequal.compute()
            unequal_error = ""
        except RuntimeError as error:
            unequal_error = str(error)
        result = {
            "local_tokens_per_sec": float(real.tokens) / RANK_ELAPSED[rank],
            "tokens_per_sec": real.compute().item(),
            "computed_tokens_per_sec": computed.compute().item(),
            "padding_ratio": padding.compute().item(),
            "packing": {key: value.item() for key, value in packing.compute().items()},
            "imbalance": {key: value.item() for key, value in imbalance.compute().items()},
            "local_after_compute": int(padding.real_tokens),
            "window": window,
            "totals": tracker.totals.state_dict(),
            "unequal_error": unequal_error,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp_metrics")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD_SIZE, join=True)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


def test_tokens_per_second_is_the_true_aggregate_not_rank_zero_times_world(results):
    for result in results:
        assert result["tokens_per_sec"] == pytest.approx(4000 / 4.0)
        assert result["computed_tokens_per_sec"] == pytest.approx((2048 + 3072) / 4.0)
    assert results[0]["local_tokens_per_sec"] * WORLD_SIZE == pytest.approx(2000.0)  # what ThroughputMonitor reports


def test_padding_and_packing_are_summed_over_ranks(results):
    for result in results:
        assert result["padding_ratio"] == pytest.approx(1120 / 5120)
        packing = result["packing"]
        assert packing["bin_utilization"] == pytest.approx(4000 / (5 * 1024))
        assert packing["packing_efficiency"] == pytest.approx(4 / 5)  # ceil(4000 / 1024) = 4 of 5 bins
        fills = torch.tensor([600.0, 400.0, 1024.0, 1000.0, 976.0], dtype=torch.float64)
        expected_balance = 1 - fills.std(correction=0).item() / fills.mean().item()
        assert packing["bin_balance"] == pytest.approx(expected_balance, rel=1e-6)
        assert result["local_after_compute"] in (1000, 3000)  # compute restores the local state


def test_rank_imbalance_per_optimizer_step(results):
    # step 1: rank 0 has 600, rank 1 has 2024: 2024 / 1312; step 2: 400 vs 976: 976 / 688
    step1, step2 = 2024 / 1312, 976 / 688
    for result in results:
        assert result["imbalance"]["rank_imbalance"] == pytest.approx((step1 + step2) / 2, rel=1e-6)
        assert result["imbalance"]["rank_imbalance_max"] == pytest.approx(step1, rel=1e-6)


def test_tracker_flush_agrees_on_every_rank(results):
    window = results[0]["window"]
    assert window == results[1]["window"]
    assert results[0]["totals"] == results[1]["totals"]
    assert window["tokens_per_sec"] == pytest.approx(1000.0)
    assert window["padding_ratio"] == pytest.approx(1120 / 5120)
    assert window["rank_imbalance_max"] == pytest.approx(2024 / 1312, rel=1e-6)
    assert results[0]["totals"]["elapsed"] == 4.0 and results[0]["totals"]["steps"] == 2


def test_unequal_step_counts_raise_on_every_rank(results):
    for result in results:
        assert "lock-step" in result["unequal_error"]
