"""One rank of the 2-process elastic-resume runs (run as a script by ``test_elastic_resume.py``, never collected).

``python tests/reliability/_elastic_ranks.py --jobs JSON`` with ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set by the
test (Lightning then starts no process itself). The two processes run every job in sequence in one process group,
each a :func:`~tests.reliability._resume_harness.fit` on 2 DDP ranks::

    {"out": DIR, "ckpt_path": CKPT or null, "save": {"NAME": [epoch, batch_idx], ...}, "steps_per_epoch": N or null}

``save`` writes ``DIR/NAME.ckpt`` after those microbatches; ``steps_per_epoch`` adds the epoch-end and step
checkpoints of :func:`~tests.reliability._resume_harness.epoch_checkpoints`. A job that raises is recorded, not
fatal: ``DIR/outcome.rank{r}.json`` holds ``{"error": null}`` or the exception's type and message.
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


def run_job(job: dict, rank: int) -> None:
    """One 2-rank run of ``job`` (see the module docstring); its outcome goes to ``out/outcome.rank{rank}.json``."""
    out = Path(job["out"])
    save = {tuple(point): out / f"{name}.ckpt" for name, point in job.get("save", {}).items()}
    steps = job.get("steps_per_epoch")
    callbacks = harness.epoch_checkpoints(out, steps) if steps else None
    ckpt = job.get("ckpt_path")
    error = None
    try:
        harness.fit(out, strategy="ddp", save=save, callbacks=callbacks, ckpt_path=ckpt and Path(ckpt))
    except Exception as exc:  # recorded for the test, which says which ones must raise
        error = f"{type(exc).__name__}: {exc}"
    (out / f"outcome.rank{rank}.json").write_text(json.dumps({"error": error}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=str, required=True, help="JSON list of jobs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["LOCAL_RANK"])
    for job in json.loads(args.jobs):
        run_job(job, rank)


if __name__ == "__main__":
    main()
