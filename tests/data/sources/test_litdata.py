"""``LitDataStream``: an optimized folder streams every sample in order, resumes at a count, splits by share."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lit_seqpack import ReferenceLM, SeqPackDataModule
from lit_seqpack._imports import LITDATA_INSTALL_HINT
from lit_seqpack.data import LitDataStream, StreamSource, write_litdata
from lit_seqpack.data.sources.streams import describe_stream

litdata = pytest.importorskip("litdata")


@pytest.fixture(autouse=True)
def _keep_the_start_method():
    """A test that calls ``litdata.optimize`` itself would leave the whole test process spawning DataLoader workers."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    yield
    multiprocessing.set_start_method(before, force=True)


COUNT = 57


def _samples() -> list[dict]:
    rng = np.random.default_rng(0)
    samples = []
    for index in range(COUNT):
        ids = rng.integers(1, 50, int(rng.integers(2, 40))).tolist()
        prompt = int(rng.integers(0, len(ids) // 2 + 1))
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "index": index})
    return samples


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("litdata") / "optimized"
    assert write_litdata(_samples(), path, chunk_bytes=600) == COUNT  # several chunks of a few samples each
    assert len(list(path.glob("*.bin"))) > 3
    return path


def _indices(reader) -> list[int]:
    return [sample["index"] for sample in reader]


def test_the_stream_yields_exactly_the_samples_written(folder: Path) -> None:
    stream = LitDataStream(str(folder), vocab_size=50)
    assert isinstance(stream, StreamSource) and stream.num_samples == COUNT
    assert describe_stream(stream) == f"LitDataStream({folder})"  # how errors name it
    got = list(stream.open())
    assert len(got) == COUNT
    for sample, want in zip(got, _samples(), strict=True):
        assert isinstance(sample["input_ids"], torch.Tensor)  # a checkpoint of carried samples loads weights-only
        assert sample["input_ids"].tolist() == want["input_ids"] and sample["labels"].tolist() == want["labels"]
        assert sample["index"] == want["index"]


@pytest.mark.parametrize("first", [0, 1, 9, 30, COUNT - 1, COUNT])
def test_a_reader_reopened_at_its_position_yields_exactly_the_rest(folder: Path, first: int) -> None:
    stream = LitDataStream(str(folder))
    reader = stream.open()
    head = [next(reader)["index"] for _ in range(first)]
    assert reader.position == first
    assert head + _indices(LitDataStream(str(folder)).open(reader.position)) == list(range(COUNT))


@pytest.mark.parametrize("count", [1, 2, 3, 7, COUNT + 5])
def test_shares_are_disjoint_and_cover_the_folder_also_split_again(folder: Path, count: int) -> None:
    stream = LitDataStream(str(folder))
    shares = [_indices(stream.split(index, count).open()) for index in range(count)]
    assert [i for share in shares for i in share] == list(range(COUNT))  # contiguous runs, in order
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    inner = stream.split(count - 1, count)  # a rank's share split again by DataLoader worker
    assert [i for w in range(3) for i in _indices(inner.split(w, 3).open())] == shares[-1]
    share = stream.split(0, count)
    reader = share.open()
    first = next(reader, None)
    if first is not None:  # a share resumes within itself
        assert [first["index"], *_indices(share.open(reader.position))] == shares[0]


@pytest.mark.parametrize(("index", "count"), [(2, 2), (-1, 2), (0, 0), (True, 2), (0.5, 2)])
def test_a_share_that_does_not_exist_is_refused_naming_the_stream(folder: Path, index, count) -> None:
    with pytest.raises(ValueError, match=r"LitDataStream\('.*optimized'\)\.split\(index=.*index must be in"):
        LitDataStream(str(folder)).split(index, count)


@pytest.mark.parametrize("position", [-1, COUNT + 1, "3", True])
def test_a_position_outside_the_stream_is_refused(folder: Path, position) -> None:
    with pytest.raises(ValueError, match=rf"a position is a sample count in \[0, {COUNT}\], got"):
        LitDataStream(str(folder)).open(position)


def test_a_folder_that_litdata_did_not_write_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"LitDataStream\('.*'\): not a folder written by litdata.optimize"):
        LitDataStream(str(tmp_path)).open()
    with pytest.raises(ValueError, match="LitDataStream.input_dir must be a folder or URL"):
        LitDataStream("")


def test_samples_of_another_layout_are_refused_naming_the_sample(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"sample 1 has the keys \['input_ids', 'labels'\] but sample 0 has"):
        write_litdata([{"input_ids": [1, 2]}, {"input_ids": [1, 2], "labels": [1, 2]}], tmp_path / "a")
    with pytest.raises(ValueError, match="sample 0: labels must hold integers, got float64"):
        write_litdata([{"input_ids": [1, 2], "labels": [1.5, 2.0]}], tmp_path / "b")
    with pytest.raises(ValueError, match="no sample to write"):
        write_litdata([], tmp_path / "c")


def test_a_stored_sample_that_breaks_the_contract_is_refused_naming_folder_and_sample(tmp_path: Path) -> None:
    items = [{"input_ids": np.arange(1, 4), "labels": np.arange(1, 4)}, {"input_ids": np.arange(1, 4),
             "labels": np.arange(1, 3)}]  # fmt: skip
    litdata.optimize(fn=_same, inputs=items, output_dir=str(tmp_path), chunk_bytes="1MB", num_workers=1, verbose=False)
    reader = LitDataStream(str(tmp_path)).open()
    next(reader)
    with pytest.raises(ValueError, match=rf"{tmp_path}: sample 1: labels has 2 entries but input_ids has 3"):
        next(reader)


def _same(item: dict) -> dict:
    return item


def test_without_litdata_the_error_gives_the_install_line(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "litdata", None)
    stream = LitDataStream(str(folder))  # building the source needs no litdata (configs parse without it)
    with pytest.raises(ImportError, match="pip install --no-deps 'litdata>=0.2.76'") as error:
        stream.open()
    assert LITDATA_INSTALL_HINT in str(error.value)


class _Trained(L.Callback):
    def __init__(self) -> None:
        self.indices: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.indices += batch["index"].tolist()


def test_a_trainer_fits_on_the_folder_and_trains_every_sample_once(folder: Path) -> None:
    L.seed_everything(0, verbose=False)
    model = ReferenceLM(
        vocab_size=50, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64, max_seq_len=128,
        attn_backend="sdpa",
    )  # fmt: skip
    source = LitDataStream(str(folder), vocab_size=50)
    data = SeqPackDataModule(source=source, window=20, max_tokens=128, sample_fields=["index"])
    trained = _Trained()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False, callbacks=[trained],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert trainer.global_step > 0
    assert sorted(trained.indices) == list(range(COUNT))


def test_writing_a_folder_leaves_the_process_start_method_alone(tmp_path: Path) -> None:
    """litdata.optimize forces multiprocessing's start method to "spawn" for the whole process: every DataLoader after
    it would spawn its workers (and refuse datasets that only fork can hand over)."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    write_litdata([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}], tmp_path / "out")
    assert multiprocessing.get_start_method(allow_none=True) == before
