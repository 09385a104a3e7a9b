"""Damaged litdata folders and an unguarded ``write_litdata`` fail naming the file (or folder) and what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_seqpack.data.sources.litdata import LitDataStream, write_litdata
from tests._limits import SUBPROCESS_TIMEOUT_S

litdata = pytest.importorskip("litdata")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _keep_the_start_method():
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    yield
    multiprocessing.set_start_method(before, force=True)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("litdata_damage") / "good"
    samples = [{"input_ids": list(range(1, 3 + i % 9))} for i in range(60)]
    assert write_litdata(samples, path, chunk_bytes=300) == 60
    return path


@pytest.fixture
def folder(written: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(written, copy)
    return copy


def _chunk(folder: Path, number: int = 1) -> Path:
    return folder / json.loads((folder / "index.json").read_text())["chunks"][number]["filename"]


def _scramble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = b"\xff" * 8
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "scrambled chunk": (lambda f: _scramble(_chunk(f)), lambda f: str(_chunk(f)), "header does not describe"),
    "missing chunk": (lambda f: _chunk(f).unlink(), lambda f: str(_chunk(f)), "missing (index.json lists it"),
    "truncated chunk": (lambda f: _truncate(_chunk(f)), lambda f: str(_chunk(f)), "bytes but index.json lists"),
    "truncated index": (lambda f: _truncate(f / "index.json"), lambda f: str(f / "index.json"), "not valid JSON"),
    "foreign index": (
        lambda f: (f / "index.json").write_text(json.dumps({"99": {"samples": 3}})),
        lambda f: str(f / "index.json"),
        "not an index written by litdata.optimize",
    ),
    "empty index": (
        lambda f: (f / "index.json").write_text(json.dumps({"chunks": [], "config": None})),
        lambda f: str(f / "index.json"),
        "not an index written by litdata.optimize",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_folder_is_refused_at_construction_naming_the_file(folder: Path, damage: str) -> None:
    harm, named, what = DAMAGE[damage]
    name = named(folder)
    harm(folder)
    with pytest.raises(ValueError) as caught:
        _ = LitDataStream(str(folder)).num_samples
    assert str(caught.value).startswith(f"{name}: ") and what in str(caught.value)


@pytest.mark.parametrize("damage", ["missing chunk", "truncated chunk"])
def test_a_chunk_damaged_while_reading_is_named_with_the_sample(folder: Path, damage: str) -> None:
    stream = LitDataStream(str(folder))
    reader = stream.open()  # checked and opened on a sound folder: the chunk breaks afterwards
    first = next(reader)
    assert first["input_ids"].tolist() == [1, 2]
    harm, named, _ = DAMAGE[damage]
    name = named(folder)
    harm(folder)
    with pytest.raises(ValueError, match="cannot be read") as caught:
        for _ in range(60):
            next(reader)
    assert f"(in {name})" in str(caught.value) and str(caught.value).startswith(f"{folder}: sample ")


def test_an_unguarded_write_litdata_fails_naming_the_folder(tmp_path: Path) -> None:
    """``write_litdata`` at a script's top level: litdata's spawned writer imports the script again; before, the
    call returned the sample count with an empty folder and exit code 0."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from lit_seqpack.data.sources.litdata import write_litdata\n"
        "count = write_litdata([{'input_ids': [1, 2, 3]}, {'input_ids': [4, 5]}], 'out')\n"
        "print('wrote', count)\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert run.returncode != 0 and "wrote" not in run.stdout
    assert "write_litdata wrote 0 of 2 samples to out" in run.stderr
    assert 'if __name__ == "__main__":' in run.stderr
