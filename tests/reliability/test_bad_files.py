"""Unreadable files fail at once naming the file (and the line), not with a bare decoder or Arrow error."""

from __future__ import annotations

import gzip
import socket
from pathlib import Path

import pytest

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import TextSource, TokenizedSource
from lit_seqpack.data.sources.text import TextDataset
from lit_seqpack.data.sources.tokenized import TokenizedDataset

GOOD = '{"input_ids": [1, 2, 3]}\n'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ((GOOD + '{"input_ids": [1, 2]}\n').encode("utf-16"), r"d\.jsonl: not UTF-8 text, it is UTF-16"),
        (gzip.compress(GOOD.encode()), r"d\.jsonl: not UTF-8 text, it is gzip-compressed: decompress it first"),
        (GOOD.encode() + b'{"input_ids": [1], "x": "\xe9"}\n', r"d\.jsonl, line 2: not UTF-8 text \(byte 0xe9 at col"),
        (GOOD.encode() + b"[" * 100_000 + b"\n", r"d\.jsonl, line 2: JSON nested too deeply to parse"),
    ],
    ids=["utf-16", "gzip", "latin-1", "deep"],
)
def test_jsonl_that_is_not_utf8_json_names_the_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    """Regression: a bare UnicodeDecodeError / RecursionError with neither file nor line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"), max_tokens=16).setup("fit")


def test_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert TokenizedDataset.from_jsonl(path).lengths.tolist() == [3]


def test_a_text_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_bytes(b"hello\nw\xf6rld\n")
    with pytest.raises(ValueError, match=r"docs\.txt, line 2: not UTF-8 text \(byte 0xf6 at column 2\)"):
        TextDataset(path, tokenizer=lambda texts, **_: {"input_ids": [[1] for _ in texts]}, add_eos=False)


def test_a_bad_parquet_file_names_its_path(tmp_path: Path) -> None:
    """Regression: `ArrowInvalid: ... magic bytes` with no path."""
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable Parquet file \(ArrowInvalid: .*magic"):
        SeqPackDataModule(source=TokenizedSource(str(path), format="parquet"), max_tokens=16).setup("fit")


@pytest.mark.parametrize("relative", [False, True])
def test_a_missing_tokenizer_path_fails_at_once_naming_it(tmp_path: Path, relative: bool, monkeypatch) -> None:
    """Regression: `Repo id must be in the form ...` (absolute) or 52 s of network attempts (relative)."""
    docs = tmp_path / "docs.txt"
    docs.write_text("a b\n")
    monkeypatch.chdir(tmp_path)
    missing = "./no_such_tokenizer" if relative else str(tmp_path / "no_such_tokenizer")
    lookups: list[object] = []  # no network attempt: any host lookup or connection is recorded and refused

    def offline(*args: object, **kwargs: object) -> None:
        lookups.append(args[:2])
        raise OSError("network access in a test that must not try it")

    monkeypatch.setattr(socket, "getaddrinfo", offline)
    monkeypatch.setattr(socket, "create_connection", offline)
    monkeypatch.setattr(socket.socket, "connect", offline)
    with pytest.raises(ValueError, match=rf"TextSource\(tokenizer='{missing}'\) is not a local folder"):
        SeqPackDataModule(source=TextSource(str(docs), missing), max_tokens=16).setup("fit")
    with pytest.raises(ValueError, match=rf"tokenizer='{missing}' does not exist"):
        TextDataset(docs, tokenizer=missing)
    with pytest.raises(ValueError, match=r"TextSource\(tokenizer='no_such_tokenizer'\) is not a local folder"):
        SeqPackDataModule(source=TextSource(str(docs), "no_such_tokenizer"), max_tokens=16).setup("fit")
    assert lookups == []
