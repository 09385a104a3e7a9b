"""``ParquetStream`` names the file, row group and row of a null or non-list token column (as the indexed reader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_seqpack.data.sources.file_streams import ParquetStream

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write(path: Path, column: dict, **others: list) -> str:
    pq.write_table(pa.table({**column, **others}), path, row_group_size=2)
    return str(path)


@pytest.mark.parametrize(
    ("column", "what"),
    [
        ({"input_ids": [[1, 2], [3], [4, 5], None]}, "input_ids is null"),
        ({"input_ids": [[1, 2], [3], [4, 5], [6, None]]}, "input_ids must be a list of integers, holds None"),
        ({"input_ids": ["ab", "c", "de", "f"]}, "input_ids must be a list of integers, got str 'f'"),
        ({"input_ids": [1, 2, 3, 4]}, "input_ids must be a list of integers, got int 4"),
    ],
)
def test_a_bad_token_column_names_file_row_group_and_row(tmp_path: Path, column: dict, what: str) -> None:
    path = _write(tmp_path / "part.parquet", column)
    reader = ParquetStream(path).open()
    if "got int" in what or "got str" in what:  # every row is bad: the first one is named
        what, row, group = what.replace("'f'", "'ab'").replace("int 4", "int 1"), 0, 0
    else:
        for _ in range(3):
            next(reader)
        row, group = 1, 1
    with pytest.raises(ValueError) as caught:
        next(reader)
    assert str(caught.value).startswith(f"{path}: row group {group}, row {row}: {what}")


def test_float_labels_are_named_with_file_row_group_and_row(tmp_path: Path) -> None:
    path = _write(tmp_path / "l.parquet", {"input_ids": [[1, 2], [3, 4]]}, labels=[[-100, 2], [3.5, 4.0]])
    with pytest.raises(ValueError, match=r"l\.parquet: row group 0, row 0: labels must be a list of integers"):
        next(ParquetStream(path).open())
