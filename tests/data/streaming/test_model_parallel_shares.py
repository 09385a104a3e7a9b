"""``stream_split="rank"`` on 4 gloo processes, 2 data-parallel x 2 tensor-parallel ranks, through the lock step's real
``all_gather_object``: the two tensor-parallel processes of a data-parallel rank yield the same microbatches, the two
data-parallel ranks read disjoint shares that cover the stream (the shorter one filling), every process yields as many
microbatches, and each step's ``step_loss_tokens`` is its total over both shares.

Three layouts of the same 4 processes: no device mesh (``ParallelLayout``: tensor-parallel innermost), the mesh of
Lightning's ``ModelParallelStrategy`` (``("data_parallel", "tensor_parallel")``) and a mesh with the tensor-parallel
dimension outermost (``("tensor_parallel", "data_parallel")``: global ranks 0 and 2 are data-parallel rank 0), where
the lock step must still find each data-parallel rank's processes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import JsonlStream
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port
from tests.reliability._train_script import WithIndices

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

DATA_PARALLEL, TENSOR_PARALLEL, ACCUMULATE, NUM_SAMPLES = 2, 2, 2, 60
PROCESSES = DATA_PARALLEL * TENSOR_PARALLEL
MESHES = {
    "no_mesh": None,
    "lightning": ("data_parallel", "tensor_parallel"),
    "tp_outermost": ("tensor_parallel", "data_parallel"),
}


def _stand_in(order: tuple[str, str] | None, rank: int) -> SimpleNamespace:
    """The parts of a Trainer the DataModule reads, with a strategy holding a real device mesh of ``order`` (``None``:
    a strategy without a mesh, as DDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    strategy = SimpleNamespace()
    if order is not None:
        shape = tuple(DATA_PARALLEL if name == "data_parallel" else TENSOR_PARALLEL for name in order)
        strategy.device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=order)
    return SimpleNamespace(
        world_size=PROCESSES,
        global_rank=rank,
        accumulate_grad_batches=ACCUMULATE,
        strategy=strategy,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
    )


def _drain(path: str, trainer: SimpleNamespace) -> dict[str, Any]:
    """This process's data-parallel rank and every batch of the DataModule's training loader (the lock step's
    collective is ``all_gather_object`` over the 4 processes)."""
    data = SeqPackDataModule(
        source=JsonlStream(path, vocab_size=64),
        max_tokens=64,
        window=10,
        num_workers=0,
        stream_split="rank",
        tensor_parallel_size=TENSOR_PARALLEL,
    )
    data.trainer = trainer
    loader = data.train_dataloader()
    loader.dataset.collator = WithIndices(loader.dataset.collator)
    batches = [
        {
            "indices": batch["sample_indices"],
            "input_ids": batch["input_ids"].tolist(),
            "empty": bool(batch["is_empty"]),
            "loss_tokens": int(batch["num_loss_tokens"]),
            "step_loss_tokens": int(batch["step_loss_tokens"]),
        }
        for batch in loader
    ]
    return {"data_parallel_rank": data.pipeline.layout.rank, "batches": batches}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PROCESSES, timeout=COLLECTIVE_TIMEOUT)
    try:
        path = str(Path(out_dir, "data.jsonl"))
        outcome = {}
        for name, order in MESHES.items():
            outcome[name] = _drain(path, _stand_in(order, rank))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_tensor_parallel_ranks_of_a_data_parallel_rank_read_its_share_in_lock_step(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    lines = []
    for index in range(NUM_SAMPLES):  # the first half: short samples with a long note (rank 0's bytes, few tokens)
        length = int(torch.randint(2, 8 if index < NUM_SAMPLES // 2 else 31, (1,), generator=gen))
        note = "x" * (200 if index < NUM_SAMPLES // 2 else 0)
        ids = torch.randint(1, 64, (length,), generator=gen).tolist()
        lines.append(json.dumps({"input_ids": ids, "index": index, "note": note}) + "\n")
    (tmp_path / "data.jsonl").write_text("".join(lines))
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=PROCESSES, join=True)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(PROCESSES)]
    for name, order in MESHES.items():
        per_process = [outcome[name] for outcome in outcomes]
        dp_ranks = [p["data_parallel_rank"] for p in per_process]
        expected = [0, 1, 0, 1] if order == ("tensor_parallel", "data_parallel") else [0, 0, 1, 1]
        assert dp_ranks == expected, name
        assert len({len(p["batches"]) for p in per_process}) == 1, name  # lock step over all 4 processes
        shares = {}
        for process in per_process:  # the tensor-parallel ranks of a data-parallel rank: the same microbatches
            shares.setdefault(process["data_parallel_rank"], process["batches"])
            assert process["batches"] == shares[process["data_parallel_rank"]], name
        trained = [[i for b in shares[dp] for i in b["indices"]] for dp in range(DATA_PARALLEL)]
        assert all(trained) and not set(trained[0]) & set(trained[1]), name  # disjoint shares, both non-empty
        assert Counter(trained[0] + trained[1]) == Counter(range(NUM_SAMPLES)), name  # covering the stream once
        assert sum(b["empty"] for b in shares[0]) > sum(b["empty"] for b in shares[1]), name  # rank 0's share fills
        for start in range(0, len(shares[0]), ACCUMULATE):  # one normaliser a step: its total over both shares
            step = [b for dp in range(DATA_PARALLEL) for b in shares[dp][start : start + ACCUMULATE]]
            assert {b["step_loss_tokens"] for b in step} == {sum(b["loss_tokens"] for b in step)}, (name, start)
