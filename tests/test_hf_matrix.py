"""benchmarks/hf_matrix.py prints the architecture table it promises (a few families, CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_matrix_reports_exact_refused_and_dynamic_rows_against_the_stock_model() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hf_matrix.py"), "--families", "llama,lfm2,gpt2"],
        cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        cells[0]: cells[1:]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| model_type")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {"llama", "lfm2", "gpt2"}
    for family in ("llama", "gpt2"):
        packing, dynamic, padded, _ = rows[family]
        assert packing.startswith("exact") and float(packing.split()[1]) <= 1e-5
        assert dynamic.startswith("exact") and padded.startswith("exact")
    packing, dynamic, padded, _ = rows["lfm2"]
    assert packing.startswith("refused (leak ") and float(packing.split()[-1].rstrip(")")) > 0  # a real leak
    assert dynamic.startswith("exact") and float(dynamic.split()[1]) <= 1e-5 and padded.startswith("exact")
    assert "`lfm2`: packing: documents mix in Lfm2ShortConv" in result.stdout
