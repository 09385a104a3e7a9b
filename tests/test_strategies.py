"""The engines users scale on, on 2 gloo CPU processes: ModelParallelStrategy (FSDP2 + TP) and FSDP1.

One spawned pair of processes runs three Trainers in turn (one process group, one start-up cost):

* ``ModelParallelStrategy`` data-parallel 1 x tensor-parallel 2 (the MLPs column/row-wise parallel), on documents of
  odd lengths: both TP ranks get the same microbatches (the device mesh says they are one data-parallel rank), rows
  are padded to a multiple of 2, one optimizer step with accumulation 2 equals one big padded batch, and a
  DataModule or a batch whose tensor-parallel size contradicts the mesh raises a ``ValueError`` naming both.
* ``ModelParallelStrategy`` data-parallel 2 x tensor-parallel 1 (FSDP2 ``fully_shard`` over the data-parallel mesh):
  the gradient of one optimizer step with accumulation 2 equals the token-mean gradient of one big padded batch of
  the step's samples, and the weight-decay group holds exactly the >= 2-D weights (DTensor ``ndim`` is the full one).
* ``FSDPStrategy`` (FSDP1, ``use_orig_params=True``, one FSDP unit per block) through a CPU test helper: the
  optimizer sees flat 1-D shards, yet the decay group holds exactly the >= 2-D weights.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lit_seqpack.callbacks import GradNormMonitor, PackingMonitor
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.model.lm import ReferenceLM, _clean_name
from lit_seqpack.model.mixin import check_batch_layout
from tests._limits import TEST_TIMEOUT_S
from tests.model.test_exact_loss import TINY, VOCAB, assert_gradients_match, make_samples, reference_gradients

WORLD = 2
KNOBS = {"mode": "packing", "max_tokens": 64, "seed": 1}


def odd_samples() -> list[dict[str, list[int]]]:
    """make_samples' documents (2..24 tokens, some with masked prompts), with an odd-length one for sure."""
    samples = make_samples(count=20, seed=4)
    samples[0] = {"input_ids": list(range(1, 18)), "labels": list(range(1, 18))}  # 17 tokens
    return samples


class TensorParallelLM(ReferenceLM):
    """Tensor parallelism on every MLP (gate/up column-wise, down row-wise) over the mesh's tensor-parallel ranks."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        for layer in self.model.layers:
            parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)


class ShardedLM(ReferenceLM):
    """FSDP2: every decoder block and the whole decoder ``fully_shard``-ed over the data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class CPUFSDPStrategy(FSDPStrategy):
    """Test helper: Lightning's FSDP1 strategy refuses CPU (a subclass passes) and torch needs a CPU ``device_id``."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs
        )


class Recorder(Callback):
    """Writes what a rank saw: its batches, its optimizer's parameter groups and (FSDP2) the first step's grads."""

    def __init__(self, out: str, grads: bool = False) -> None:
        self.out, self.grads, self.record = out, grads, {"batches": []}

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: dict, batch_idx: int) -> None:
        self.record["batches"].append(
            {
                "input_ids": batch["input_ids"].tolist(),
                "tp": batch.get("tensor_parallel_size", 1),
                "real_tokens": batch["num_real_tokens"],
            }
        )

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        names = {id(p): _clean_name(name) for name, p in pl_module.named_parameters()}  # FSDP1 prefixes out
        self.record["groups"] = [
            {"weight_decay": g["weight_decay"], "names": sorted(names[id(p)] for p in g["params"])}
            for g in trainer.optimizers[0].param_groups
        ]
        self.record["shapes"] = {_clean_name(n): [p.ndim, p.numel()] for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.grads and "grads" not in self.record:
            grads = {name: _full(p.grad) for name, p in pl_module.named_parameters()}  # DTensors: a collective
            self.record["grads"] = True
            if trainer.global_rank == 0:
                torch.save(grads, Path(self.out).with_suffix(".pt"))

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        logged = trainer.callback_metrics.get("train/grad_norm")
        if logged is not None and "grad_norm" not in self.record:  # the first optimizer step's (GradNormMonitor)
            self.record["grad_norm"] = float(logged)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        monitors = [c for c in trainer.callbacks if isinstance(c, PackingMonitor)]
        if monitors:  # after the monitor's own on_train_end (it comes first in the callbacks)
            self.record["monitor_real_tokens"] = monitors[0].last_summary["real_tokens"]
        Path(self.out).write_text(json.dumps(self.record))


def _full(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _trainer(strategy: Any, recorder: Recorder, **kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        use_distributed_sampler=False,
        callbacks=[PackingMonitor(summary=False), GradNormMonitor(), recorder],
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _tp_run(rank: int, out: Path) -> None:
    torch.manual_seed(0)
    module = TensorParallelLM(vocab_size=VOCAB, **TINY, lr_schedule="constant", attn_backend="sdpa").double()
    recorder = Recorder(str(out / f"tp_{rank}.json"), grads=True)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=WORLD)
    trainer = _trainer(strategy, recorder, max_steps=2, accumulate_grad_batches=2)
    trainer.fit(module, datamodule=SeqPackDataModule(source=odd_samples(), **KNOBS, tensor_parallel_size=WORLD))
    errors = {}
    unset = SeqPackDataModule(source=odd_samples(), **KNOBS)  # tensor_parallel_size left at 1
    unset.trainer = trainer
    try:
        unset.setup("fit")
    except ValueError as err:
        errors["datamodule"] = str(err)
    try:
        check_batch_layout({"world_size": 2}, world_size=WORLD, accumulate_grad_batches=1, strategy=trainer.strategy)
    except ValueError as err:
        errors["batch"] = str(err)
    (out / f"tp_errors{rank}.json").write_text(json.dumps(errors))


def _fsdp2_run(rank: int, out: Path) -> None:
    torch.manual_seed(0)
    module = ShardedLM(vocab_size=VOCAB, **TINY, lr_schedule="constant", attn_backend="sdpa").double()
    recorder = Recorder(str(out / f"fsdp2_{rank}.json"), grads=True)
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer = _trainer(strategy, recorder, max_steps=1, accumulate_grad_batches=2)  # 64-bit weights
    trainer.fit(module, datamodule=SeqPackDataModule(source=odd_samples(), **KNOBS))


def _fsdp1_run(rank: int, out: Path) -> None:
    from lit_seqpack.model.reference import _Block

    torch.manual_seed(0)
    module = ReferenceLM(vocab_size=VOCAB, **TINY, lr_schedule="constant", attn_backend="sdpa")
    recorder = Recorder(str(out / f"fsdp1_{rank}.json"))
    trainer = _trainer(CPUFSDPStrategy(auto_wrap_policy={_Block}), recorder, max_steps=1)
    trainer.fit(module, datamodule=SeqPackDataModule(source=odd_samples(), **KNOBS))


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "RANK": str(rank)}
    )
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    out = Path(out_dir)
    for run in (_tp_run, _fsdp2_run, _fsdp1_run):
        run(rank, out)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("strategies")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return out


def _load(runs: Path, name: str) -> dict[str, Any]:
    return json.loads((runs / name).read_text())


def _expected_groups() -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    module = ReferenceLM(vocab_size=VOCAB, **TINY)
    names = dict(module.named_parameters())
    return sorted(n for n, p in names.items() if p.ndim >= 2), sorted(n for n, p in names.items() if p.ndim < 2)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_tensor_parallel_ranks_of_one_data_parallel_rank_get_the_same_odd_length_batches(runs: Path) -> None:
    tp0, tp1 = _load(runs, "tp_0.json")["batches"], _load(runs, "tp_1.json")["batches"]
    assert len(tp0) == 4 and tp0 == tp1
    lengths = {len(batch["input_ids"][0]) for batch in tp0}
    assert all(n % 2 == 0 for n in lengths) and all(batch["tp"] == 2 for batch in tp0)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_monitor_counts_each_tensor_parallel_row_once(runs: Path) -> None:
    """Both TP ranks hold the same rows: the tokens summed over ranks are one rank's, not twice that."""
    for rank in range(WORLD):
        record = _load(runs, f"tp_{rank}.json")
        trained = sum(batch["real_tokens"] for batch in record["batches"])
        assert trained > 0
        assert record["monitor_real_tokens"] == trained


def test_a_tensor_parallel_size_that_contradicts_the_mesh_names_both(runs: Path) -> None:
    for rank in range(WORLD):
        errors = _load(runs, f"tp_errors{rank}.json")
        assert "device mesh has tensor_parallel size 2" in errors["datamodule"]
        assert "SeqPackDataModule(tensor_parallel_size=1)" in errors["datamodule"]
        assert "2 x 1 x 1 ranks but the strategy's device mesh is 1 x 1 x 2" in errors["batch"]


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("run", "data_parallel"), [("fsdp2_0", WORLD), ("tp_0", 1)])
def test_one_step_with_accumulation_equals_the_big_padded_batch(runs: Path, run: str, data_parallel: int) -> None:
    """FSDP2 over 2 data-parallel ranks, and TP over 2 ranks that form one data-parallel rank (plan for 1)."""
    planner = SeqPackDataModule(source=odd_samples(), **KNOBS)  # the same plan, read in this process
    planner.trainer = SimpleNamespace(
        world_size=data_parallel,
        global_rank=0,
        accumulate_grad_batches=2,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
        fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0))),
    )
    planner.setup("fit")
    step = planner.train_dataloader().batch_sampler.plan.step_microbatches(0)
    view = planner.splits["train"][0]
    torch.manual_seed(0)
    module = ReferenceLM(vocab_size=VOCAB, **TINY, lr_schedule="constant", attn_backend="sdpa")
    expected = reference_gradients(module, [view[i] for rank in step for micro in rank for i in micro])
    assert_gradients_match(torch.load(runs / f"{run}.pt"), expected, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("run", ["fsdp2", "tp"])
def test_the_logged_grad_norm_is_the_whole_models_on_every_rank(runs: Path, run: str) -> None:
    """GradNormMonitor under ModelParallelStrategy: each sharded gradient's norm is reduced over its mesh, so both
    ranks log the norm of the whole gradient (the saved full gradients), not their shards'."""
    grads = torch.load(runs / f"{run}_0.pt")
    whole = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    logged = [_load(runs, f"{run}_{rank}.json")["grad_norm"] for rank in range(WORLD)]
    assert logged == pytest.approx([whole] * WORLD, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("run", ["fsdp2", "fsdp1", "tp"])
def test_the_decay_group_holds_exactly_the_two_dimensional_weights(runs: Path, run: str) -> None:
    decay, no_decay = _expected_groups()
    for rank in range(WORLD):
        record = _load(runs, f"{run}_{rank}.json")
        groups = {g["weight_decay"]: g["names"] for g in record["groups"]}
        assert groups == {0.1: decay, 0.0: no_decay}
        if run == "fsdp1":  # what made grouping by p.ndim put everything in the no-decay group
            assert all(ndim == 1 for ndim, _ in record["shapes"].values())
