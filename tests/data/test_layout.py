"""The device mesh is the source of truth for the data-parallel layout (fake meshes; the real one: test_strategies)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_seqpack.data._trainer import read_layout
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.parallel import ParallelLayout
from lit_seqpack.parallel.layout import check_mesh, mesh_layout
from tests.test_strategies import odd_samples


class FakeMesh:
    """What the DataModule reads of a ``DeviceMesh``: names, sizes and this rank's coordinate per dimension."""

    def __init__(self, names: tuple[str, ...] | None, shape: tuple[int, ...], coords: tuple[int, ...]) -> None:
        self.mesh_dim_names, self.shape, self.coords, self.ndim = names, shape, coords, len(shape)

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def get_local_rank(self, dim: int) -> int:
        return self.coords[dim]


def _trainer(mesh: FakeMesh, global_rank: int, accumulate: int = 1) -> SimpleNamespace:
    world = 1
    for size in mesh.shape:
        world *= size
    return SimpleNamespace(
        world_size=world,
        global_rank=global_rank,
        accumulate_grad_batches=accumulate,
        strategy=SimpleNamespace(device_mesh=mesh),
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
        fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0))),
    )


def test_mesh_layout_reads_names_sizes_and_ranks():
    layout = mesh_layout(FakeMesh(("dp_replicate", "dp_shard", "cp", "tp"), (2, 3, 2, 2), (1, 2, 1, 0)))
    assert (layout.data_parallel_size, layout.data_parallel_rank) == (6, 5)  # several dp dims: row-major
    assert (layout.context_parallel_size, layout.context_parallel_rank) == (2, 1)
    assert (layout.tensor_parallel_size, layout.tensor_parallel_rank) == (2, 0)
    assert mesh_layout(FakeMesh(None, (4,), (3,))).data_parallel_rank == 3  # an unnamed 1-D mesh is data parallel
    with pytest.raises(ValueError, match="dimension 'pp'"):
        mesh_layout(FakeMesh(("pp", "dp"), (2, 2), (0, 0)))
    with pytest.raises(ValueError, match="no dimension names"):
        mesh_layout(FakeMesh(None, (2, 2), (0, 0)))


def test_data_parallel_size_and_rank_come_from_the_mesh_not_the_world_size():
    """Lightning's ModelParallelStrategy mesh (data_parallel, tensor_parallel) = (2, 2): world 4, 2 dp ranks."""
    names = ("data_parallel", "tensor_parallel")
    seen = []
    for rank in range(4):
        mesh = FakeMesh(names, (2, 2), (rank // 2, rank % 2))
        dm = SeqPackDataModule(source=odd_samples(), max_tokens=64, tensor_parallel_size=2)
        dm.trainer = _trainer(mesh, rank, accumulate=2)
        dm.setup("fit")
        assert dm.layout == (2, rank // 2, 2)
        seen.append([list(mb) for mb in dm.train_dataloader().batch_sampler])
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    assert sorted(i for rank in (0, 2) for mb in seen[rank] for i in mb) == list(range(20))


@pytest.mark.parametrize(("knobs", "match"), [
    ({}, r"tensor_parallel size 2 but SeqPackDataModule\(tensor_parallel_size=1\)"),
    ({"tensor_parallel_size": 4}, r"tensor_parallel size 2 but SeqPackDataModule\(tensor_parallel_size=4\)"),
    ({"context_parallel_size": 2, "tensor_parallel_size": 2}, r"context_parallel size 1 but .*context_parallel_size=2"),
])  # fmt: skip
def test_settings_that_contradict_the_mesh_name_both(knobs, match):
    dm = SeqPackDataModule(source=odd_samples(), **knobs, max_tokens=64)
    dm.trainer = _trainer(FakeMesh(("data_parallel", "tensor_parallel"), (1, 2), (0, 1)), 1)
    with pytest.raises(ValueError, match=match):
        dm.setup("fit")


def test_context_parallel_needs_the_rank_order_its_groups_assume():
    parallel = ParallelLayout(context_parallel_size=2)
    good = FakeMesh(("dp", "cp"), (2, 2), (1, 0))  # global rank 2 = dp 1, cp 0
    check_mesh(mesh_layout(good), parallel, world_size=4, global_rank=2)
    assert read_layout(_trainer(good, 2), parallel) == ((2, 1, 1), 0)
    swapped = FakeMesh(("cp", "dp"), (2, 2), (1, 0))  # global rank 2 = cp 1, dp 0
    with pytest.raises(ValueError, match="order the mesh dimensions"):
        check_mesh(mesh_layout(swapped), parallel, world_size=4, global_rank=2)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_tensor_parallel_without_context_parallel_takes_odd_documents(mode):
    """17-token documents: rows (packed, or the L of a dynamic block) are padded to a multiple of tp, never refused."""
    dm = SeqPackDataModule(source=odd_samples(), mode=mode, max_tokens=64, tensor_parallel_size=2, shuffle=False)
    dm.trainer = _trainer(FakeMesh(("data_parallel", "tensor_parallel"), (1, 2), (0, 1)), 1)
    batches = list(dm.train_dataloader())
    assert sum(b["num_real_tokens"] for b in batches) == sum(len(s["input_ids"]) for s in odd_samples())
    for batch in batches:
        assert batch["input_ids"].shape[-1] % 2 == 0 and batch["tensor_parallel_size"] == 2
        assert "shift_labels" not in batch and batch["world_size"] == 1
    if mode == "packing":
        assert any(length % 2 for b in batches for length in b["cu_seqlens"].diff().tolist())
