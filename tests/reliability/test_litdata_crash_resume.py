"""SIGKILL a 2-process DDP CPU run on a litdata folder mid-epoch, resume it, and prove nothing was lost.

The protocol and the checks of ``test_stream_crash_resume`` (imported: they run here against this module's runs) on
the same samples written by ``write_litdata`` and read as a ``LitDataStream``: the checkpointed prefix of the killed
run plus the resumed run train the same microbatches with bitwise the same losses as the uninterrupted run, every
sample exactly once per epoch over both ranks, in lock step, with the same final weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_seqpack.data import write_litdata
from tests.reliability import _litdata_train_script as script
from tests.reliability import _stream_train_script as stream_script
from tests.reliability.test_crash_resume import run_killed_and_resumed
from tests.reliability.test_stream_crash_resume import (  # noqa: F401 - collected here, with this module's runs
    KILL_AT,
    test_a_ddp_stream_trains_every_sample_once_in_lock_step,
    test_a_killed_stream_run_resumes_exactly,
)

pytest.importorskip("litdata")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("litdata_crash_resume")
    write_litdata(stream_script.samples(), root / "optimized", chunk_bytes=2_000)  # chunks of a few samples
    os.environ[script.FOLDER_ENV] = str(root / "optimized")  # the runs inherit it (both ranks, every worker)
    try:
        return run_killed_and_resumed(Path(script.__file__), root, KILL_AT)
    finally:
        del os.environ[script.FOLDER_ENV]
