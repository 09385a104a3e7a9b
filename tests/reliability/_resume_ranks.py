"""One rank of the 2-process resume matrix (run as a script by ``test_resume_matrix.py``, never collected).

``python tests/reliability/_resume_ranks.py --out DIR --cells JSON`` with ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*``
set by the test (Lightning then starts no process itself). The two processes run every cell in sequence in one
process group: an uninterrupted reference run that saves checkpoints at the cell's points, then one resume per
``(point, num_workers)``. A resume that raises is recorded, not fatal: ``DIR/<cell>/<point>-<workers>.rank{r}.json``
holds ``{"error": null}`` or the exception's type and message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` is a package

from tests.reliability import _resume_harness as harness  # noqa: E402


def run_cell(out: Path, cell: dict, rank: int) -> None:
    """The reference of ``cell`` with its checkpoints, then its resumes (see the module docstring)."""
    points = {name: tuple(point) for name, point in cell["points"].items()}
    common = {"strategy": cell["strategy"], "mode": cell["mode"]}
    harness.fit(
        out / "reference",
        num_workers=cell["save_workers"],
        save={point: out / f"{name}.ckpt" for name, point in points.items()},
        **common,
    )
    for name, workers in cell["resumes"]:
        error = None
        try:
            harness.fit(out / f"{name}-{workers}", num_workers=workers, ckpt_path=out / f"{name}.ckpt", **common)
        except Exception as exc:  # recorded for the test, which says which ones must raise
            error = f"{type(exc).__name__}: {exc}"
        (out / f"{name}-{workers}.rank{rank}.json").write_text(json.dumps({"error": error}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", type=str, required=True, help="JSON list of cells")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["LOCAL_RANK"])
    for cell in json.loads(args.cells):
        run_cell(args.out / cell["name"], cell, rank)


if __name__ == "__main__":
    main()
