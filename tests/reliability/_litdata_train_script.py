"""The streaming crash/resume run of ``_stream_train_script`` on a litdata folder (run as a script, never collected).

``python tests/reliability/_litdata_train_script.py --out DIR [--kill-at-step K] [--ckpt-path CKPT]`` trains on the
same samples as ``_stream_train_script``, written by :func:`~lit_seqpack.data.write_litdata` into the folder named by
the environment variable :data:`FOLDER_ENV` and read as a :class:`~lit_seqpack.data.LitDataStream` (2 DDP ranks,
2 loader workers each, windows of ``BUFFER`` samples); each rank logs every trained microbatch to ``DIR/rank{r}.jsonl``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lit_seqpack.data import LitDataStream  # noqa: E402
from tests.reliability._stream_train_script import (  # noqa: E402
    BUFFER,
    MAX_TOKENS,
    VOCAB,
    RecordingStreamModule,
    StreamTrainedLog,
)
from tests.reliability._train_script import fit, parse_args  # noqa: E402

FOLDER_ENV = "LIT_SEQPACK_TEST_LITDATA_DIR"
"""The environment variable naming the optimized folder (written once by the test, before the runs start)."""


def make_datamodule(num_workers: int = 1) -> RecordingStreamModule:
    """The streaming DataModule of the run over the litdata folder (packing, best fit over each window)."""
    return RecordingStreamModule(
        source=LitDataStream(os.environ[FOLDER_ENV], vocab_size=VOCAB),
        window=BUFFER,
        max_tokens=MAX_TOKENS,
        algorithm="best_fit_decreasing",
        num_workers=num_workers,
    )


def main() -> None:
    args = parse_args(default_workers=2)
    fit(args, StreamTrainedLog(args.out), make_datamodule(args.num_workers))


if __name__ == "__main__":
    main()
