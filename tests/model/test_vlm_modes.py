"""Vision-language models in mode ``dynamic``, over gradient accumulation and 2 DDP ranks, and the leak probe.

The tiny Qwen2-VL / Qwen2.5-VL / LLaVA models and the 16 conversations of ``tests/model/test_vlm.py`` (which checks
``packing`` and ``padded``). ``dynamic`` (length-sorted padded rows under a token budget) must give the stock eager
model's per-conversation token-mean loss and its gradients too. Over accumulation (2 microbatches) and over 2 gloo
ranks through Lightning's DDP (2 x 2 microbatches), the step's gradient must equal the gradient of one big batch of
the same conversations with a token-mean loss (the stock model run per conversation, summed, over the step's assistant
tokens); the microbatches carry unequal numbers of loss tokens, so a per-microbatch mean would be measurably off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from tests._limits import TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks, spawn_ranks
from tests.data import _vlm_tiny as tiny
from tests.model.test_vlm import FIELDS, _config, _fields, _grads, _names, _reference, _setup, _stock


@pytest.mark.parametrize(
    ("kind", "chunked_loss"), [("qwen2_vl", True), ("qwen2_5_vl", True), ("llava", True), ("qwen2_vl", False)]
)
def test_dynamic_step_loss_and_gradients_equal_the_stock_model_per_conversation(tmp_path, kind, chunked_loss):
    """The loss from the hidden states (chunked, the default) and from the full logits alike."""
    from lit_seqpack.data.datamodule import SeqPackDataModule

    source, model = _setup(tmp_path, kind, chunked_loss=chunked_loss)
    dm = SeqPackDataModule(source=source, mode="dynamic", seed=0, max_tokens=2048, **_fields(kind))
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 1 and batches[0]["num_documents"] == 16
    batch = batches[0]
    assert batch["input_ids"].shape[0] == 16 and batch.get("cu_seqlens") is None  # padded rows, one a conversation
    assert sum(int(p.shape[0] > 0) for p in batch["pixel_values"]) >= 8
    stock = _stock(model)
    names = _names(stock, kind)

    model.model.train()
    loss = model.training_step(batch, 0)
    loss.backward()
    expected = _reference(stock, dm.pipeline.dataset, kind)
    expected.backward()

    assert abs(loss.item() - expected.item()) <= 1e-4 * max(1.0, abs(expected.item()))
    ours, theirs = _grads(model.model, names), _grads(stock, names)
    for name in names:
        error = (ours[name] - theirs[name]).norm() / theirs[name].norm()
        assert theirs[name].norm() > 0 and error <= 1e-4, (name, float(error))


def _trainer(*callbacks, devices=1, strategy="auto", max_steps=1):
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=max_steps,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _step_indices(dm, world_size, step=0, unequal=True):
    """The conversations of optimizer step ``step`` (every rank's 2 microbatches), checked to carry unequal
    numbers of loss tokens (a per-microbatch mean would then be wrong)."""
    plan = dm.pipeline.train_sampler.lazy_plan
    cells = [(rank, position) for rank in range(world_size) for position in (2 * step, 2 * step + 1)]
    indices = [int(i) for cell in cells for i in plan.microbatch(*cell).indices]
    assert not unequal or len({plan.microbatch_loss_tokens(*cell) for cell in cells}) > 1
    return indices


def _assert_step_gradients(actual, stock, dataset, indices):
    """``actual`` (the step's gradients of ``HFCausalLM``) equal those of the stock model's token-mean loss over the
    assistant tokens of ``indices``, every parameter to 1e-4 of its largest entry."""
    stock.zero_grad()
    _reference(stock, dataset, "qwen2_vl", indices).backward()
    expected = {f"model.{name}": p.grad for name, p in stock.named_parameters() if p.grad is not None}
    assert {name for name in expected if ".visual." in name} and {name for name in expected if "language" in name}
    for name, grad in expected.items():
        error, scale = (actual[name] - grad).abs().max().item(), grad.abs().max().item()
        assert error <= 1e-4 * scale, f"{name}: max error {error:.3g} > 1e-4 x {scale:.3g}"


def test_accumulated_packed_step_equals_the_big_batch(tmp_path):
    """One Trainer step over 2 packed microbatches (accumulate_grad_batches=2) of a tiny Qwen2-VL."""
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from tests.model.test_exact_loss import GradientCapture

    source, model = _setup(tmp_path, "qwen2_vl")
    stock = _stock(model)  # the initial weights
    dm = SeqPackDataModule(source=source, mode="packing", seed=0, max_tokens=160, **_fields("qwen2_vl"))
    capture = GradientCapture()
    _trainer(capture).fit(model, datamodule=dm)
    indices = _step_indices(dm, world_size=1)
    assert capture.grads is not None and len(indices) < 16  # the step is part of the epoch
    _assert_step_gradients(capture.grads, stock, dm.pipeline.dataset, indices)


def _sharded_vlm() -> type:
    """``HFCausalLM`` whose ``configure_model`` applies FSDP2 over the data-parallel mesh: each vision block, each
    text layer and the whole model ``fully_shard``-ed (ModelParallelStrategy needs the hook)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lit_seqpack.model.lm import HFCausalLM

    class ShardedVLM(HFCausalLM):
        def configure_model(self) -> None:
            if isinstance(self.model, FSDPModule):  # trainer.validate after fit calls the hook again
                return
            mesh, inner = self.device_mesh["data_parallel"], self.model.model
            for block in [*inner.visual.blocks, *inner.language_model.layers]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return ShardedVLM


def _build(data: Path, model: bool = True, sharded: bool = False):
    """The source and the seeded ``HFCausalLM`` of :func:`_setup`'s folder ``data`` (in a spawned rank)."""
    from lit_seqpack.data.sources.chat import ChatSource
    from lit_seqpack.data.sources.vision import VisionProcessor
    from lit_seqpack.model.lm import HFCausalLM

    folder = data / "processor"
    torch.manual_seed(0)
    cls = _sharded_vlm() if sharded else HFCausalLM
    lm = cls(config=_config("qwen2_vl", VisionProcessor(folder)), lr=1e-3) if model else None
    return ChatSource(str(data / "data" / "chat.jsonl"), str(folder)), lm


def _ddp_worker(rank: int, port: int, data: str) -> None:
    """One of 2 gloo ranks: one Lightning DDP step (accumulation 2); rank 0 writes the gradients and the step."""
    from lightning.pytorch.strategies import DDPStrategy

    from lit_seqpack.data.datamodule import SeqPackDataModule
    from tests._limits import COLLECTIVE_TIMEOUT
    from tests.model.test_exact_loss import GradientCapture

    join_ranks(rank, 2, port)
    source, model = _build(Path(data))
    dm = SeqPackDataModule(source=source, mode="packing", seed=0, max_tokens=96, **_fields("qwen2_vl"))
    strategy = DDPStrategy(start_method="popen", timeout=COLLECTIVE_TIMEOUT)
    _trainer(GradientCapture(str(Path(data, "ddp.pt"))), devices=2, strategy=strategy).fit(model, datamodule=dm)
    if rank == 0:
        Path(data, "step.json").write_text(json.dumps(_step_indices(dm, world_size=2)), encoding="utf-8")


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ddp_packed_step_on_two_gloo_ranks_equals_the_big_batch(tmp_path):
    """Lightning's DDP on 2 spawned gloo ranks, 2 packed microbatches each: the averaged gradient of the step is the
    big-batch token-mean one of the step's conversations (a tiny Qwen2-VL)."""
    _setup(tmp_path, "qwen2_vl")  # the processor folder and the conversations, for the ranks
    spawn_ranks(_ddp_worker, (free_port(), str(tmp_path)), nprocs=2)
    source, model = _build(tmp_path)
    from lit_seqpack.data.datamodule import SeqPackDataModule

    dm = SeqPackDataModule(source=source, mode="packing", seed=0, max_tokens=96, **_fields("qwen2_vl"))
    dm.setup("fit")
    indices = json.loads((tmp_path / "step.json").read_text(encoding="utf-8"))
    assert sorted(indices) == sorted(set(indices))
    _assert_step_gradients(torch.load(tmp_path / "ddp.pt"), _stock(model), dm.pipeline.dataset, indices)


class _VisionSnapshots(Callback):
    """Rank 0 saves the vision tower's parameters before training and after every optimizer step to ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.states = path, []

    def _keep(self, pl_module) -> None:
        params = {n: p.detach() for n, p in pl_module.named_parameters() if ".visual." in n}
        whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in params.items()}  # FSDP2: gather
        self.states.append({n: p.clone() for n, p in whole.items()})

    def on_train_start(self, trainer, pl_module) -> None:
        self._keep(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == len(self.states):
            self._keep(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            torch.save(self.states, self.path)


def _two_rank_datamodule(data: Path):
    """The DataModule of the 2-rank runs below, planned in this process as rank 0 of 2 with accumulation 2."""
    from types import SimpleNamespace

    from lit_seqpack.data.datamodule import SeqPackDataModule

    source, _ = _build(data, model=False)
    dm = SeqPackDataModule(source=source, mode="packing", seed=0, max_tokens=48, **FIELDS)
    dm.attach_fabric(SimpleNamespace(world_size=2, global_rank=0), accumulate_grad_batches=2)
    dm.setup("fit")
    dm.train_dataloader()  # builds the planned sampler
    return dm


def _one_image_data(data: Path) -> tuple[list[int], list[int]]:
    """Rewrite ``data``'s conversations so that only one has an image, one of the first of 2 steps (2 ranks,
    accumulation 2, ``max_tokens=48``): returns the conversations of the first and of the second step."""
    for chosen in range(16):
        counts = [int(i == chosen) for i in range(16)]
        tiny.write_conversations(data / "data", 16, images_per_conversation=counts)
        dm = _two_rank_datamodule(data)
        first, second = (_step_indices(dm, 2, step=step, unequal=False) for step in (0, 1))
        if chosen in first:
            return first, second
    raise AssertionError("no conversation of the first step")


def _idle_vision_worker(rank: int, port: int, data: str, engine: str) -> None:
    """One of 2 gloo ranks: 2 Lightning steps (``engine`` DDP or FSDP2) over the one-image conversations, then a
    validation of the same conversations; rank 0 saves the first step's gradients, the vision tower after each step,
    the trained weights and the validation loss."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lit_seqpack.data.datamodule import SeqPackDataModule
    from tests._limits import COLLECTIVE_TIMEOUT
    from tests.model.test_exact_loss import GradientCapture

    join_ranks(rank, 2, port)
    source, model = _build(Path(data), sharded=engine == "fsdp2")
    dm = SeqPackDataModule(source=source, val_source=source, mode="packing", seed=0, max_tokens=48, **FIELDS)
    if engine == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=COLLECTIVE_TIMEOUT)
    else:
        strategy = DDPStrategy(start_method="popen", timeout=COLLECTIVE_TIMEOUT)
    capture, snapshots = GradientCapture(str(Path(data, "ddp.pt"))), _VisionSnapshots(str(Path(data, "vision.pt")))
    trainer = _trainer(capture, snapshots, devices=2, strategy=strategy, max_steps=2)
    trainer.fit(model, datamodule=dm)
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    (metrics,) = trainer.validate(model, datamodule=dm, verbose=False)
    if rank == 0:
        torch.save({"weights": weights, "val_loss": metrics["val/loss"]}, Path(data, "trained.pt"))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_rank_without_images_runs_the_vision_tower_idle(tmp_path, engine):
    """One conversation of 16 has an image: in the first step one rank has it and the other none (the stock DDP
    reducer would stop on the rank whose vision tower never ran, FSDP2's collectives would differ between the ranks);
    the step's gradient is still the big-batch one.
    In the second step no rank has an image: the vision tower is left exactly as it was (no zero-gradient AdamW
    step, which weight decay and momentum would move), as in a run that never called the tower. The validation
    after it (FSDP2 gathers the tower in every forward, evaluation too) is the stock model's token-mean loss."""
    _setup(tmp_path, "qwen2_vl")  # the processor folder
    first, second = _one_image_data(tmp_path)
    spawn_ranks(_idle_vision_worker, (free_port(), str(tmp_path), engine), nprocs=2)

    dm, (_, model) = _two_rank_datamodule(tmp_path), _build(tmp_path)
    dataset = dm.pipeline.dataset
    assert [len(dataset[i]["pixel_values"]) > 0 for i in first + second].count(True) == 1
    _assert_step_gradients(torch.load(tmp_path / "ddp.pt"), _stock(model), dataset, first)
    before, after_first, after_second = torch.load(tmp_path / "vision.pt")
    assert any(not torch.equal(before[n], after_first[n]) for n in before)  # the first step trained the tower
    assert all(torch.equal(after_first[n], after_second[n]) for n in before)
    trained = torch.load(tmp_path / "trained.pt")
    assert not model.load_state_dict(trained["weights"], strict=False).unexpected_keys
    with torch.no_grad():
        expected = float(_reference(_stock(model).eval(), dataset, "qwen2_vl"))
    assert abs(trained["val_loss"] - expected) <= 1e-4 * max(1.0, expected)


def test_the_leak_probe_runs_on_the_first_multimodal_packed_row(tmp_path, monkeypatch):
    """The isolation probe runs once, on the first packed row with images, and passes by the gradient method.

    It draws its 3 documents from the row's tokens (image placeholders included) and runs them as text: it checks
    the language model's attention isolation; the vision path is checked against the stock model above.
    """
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from lit_seqpack.model import isolation
    from lit_seqpack.model.mixin import _VERIFIED

    probe, calls = isolation.probe_packing_isolation, []

    def spy(model, batch, **kwargs):
        report = probe(model, batch, **kwargs)
        calls.append((batch, report))
        return report

    monkeypatch.setattr(isolation, "probe_packing_isolation", spy)
    source, model = _setup(tmp_path, "qwen2_vl")
    dm = SeqPackDataModule(source=source, mode="packing", seed=0, max_tokens=1024, **_fields("qwen2_vl"))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    model.model.train()
    assert True not in _VERIFIED.get(model, set())
    model.training_step(batch, 0)
    model.training_step(batch, 0)  # once per module and mode
    assert len(calls) == 1 and True in _VERIFIED[model]
    probed, report = calls[0]
    assert probed is batch and batch.get("cu_seqlens") is not None and any(p.numel() for p in batch["pixel_values"])
    assert report.passed and report.method == "gradient" and report.training and len(report.cross_entries) == 3
