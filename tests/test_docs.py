"""The docs cannot go stale: the site builds with ``mkdocs build --strict`` and every code block runs.

All pages' blocks run in one subprocess (``tests/_docs_runner.py``; each page in a sandbox folder with tiny data
files, every Trainer capped at 3 steps); tests/_docs_blocks.py says what each block language means. A block that is only
an excerpt is marked ``<!-- excerpt: why -->`` on the line before it and reported as skipped, by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._docs_blocks import LANGUAGES, ROOT, RUN, Block, blocks, pages
from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

ALL = [block for page in pages() for block in blocks(page)]
RUNNABLE = {}
for _block in ALL:
    if _block.lang in RUN and _block.excerpt is None:
        RUNNABLE.setdefault(_block.page, []).append(_block)
EXCERPTS = [block for block in ALL if block.excerpt is not None]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "NO_MKDOCS_2_WARNING": "1"}


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    # mkdocs is a [docs] dependency that scripts/setup_env.sh installs: a missing one fails, never skips
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed (pip install -e '.[docs]'?):\n{log[-5000:]}"
    assert "WARNING" not in log, log[-5000:]
    assert (tmp_path / "site" / "api" / "data" / "index.html").read_text().count("SeqPackDataModule") > 3


def test_every_block_says_what_it_is() -> None:
    untagged = [f"{b.where} ({b.lang or 'no language'})" for b in ALL if b.lang not in LANGUAGES]
    assert not untagged, f"tag every code block with one of {LANGUAGES}: {untagged}"
    assert len(RUNNABLE) >= 5, "the docs pages were not found"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every runnable block's report, by place: one subprocess runs all pages (torch is imported once)."""
    folder = tmp_path_factory.mktemp("docs_blocks")
    listing = folder / "pages.json"
    pages = {page: [_listed(b) for b in page_blocks] for page, page_blocks in RUNNABLE.items()}
    listing.write_text(json.dumps(pages))
    result = subprocess.run(
        [sys.executable, "-m", "tests._docs_runner", str(listing)],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"where"')]
    return {report["where"]: report for report in found}


def _listed(block: Block) -> dict[str, Any]:
    return {"where": block.where, "lang": block.lang, "code": block.code, "parse_only": block.parse_only}


@pytest.mark.parametrize("page", sorted(RUNNABLE))
def test_code_blocks_run(page: str, reports: dict[str, dict[str, Any]]) -> None:
    for block in RUNNABLE[page]:
        report = reports.get(block.where)
        assert report is not None, f"{block.where} did not run (an earlier block of the page failed?)"
        assert "error" not in report, f"{block.where} failed:\n{report['error']}"
        assert report["status"]


@pytest.mark.parametrize("block", EXCERPTS, ids=[b.where for b in EXCERPTS])
def test_excerpts_are_skipped_by_name(block: Block) -> None:
    assert block.lang in LANGUAGES, f"{block.where}: tag the excerpt's language"
    pytest.skip(f"{block.where} ({block.lang}) is an excerpt: {block.excerpt}")


@pytest.mark.parametrize(
    ("lang", "code", "error"),
    [
        ("bash", "lit-seqpack fit --config configs/no_such.yaml\n", "no_such.yaml"),
        ("bash", "lit-seqpack fit --config configs/demo.yaml --data.no_such_setting 5\n", "no_such_setting"),
        ("bash", "lit-seqpack inspect --config configs/demo.yaml --no_such_flag\n", "no_such_flag"),
        ("bash", "python examples/own_model.py --no-such-flag\n", "no-such-flag"),
        ("bash", "bash scripts/no_such.sh\n", "no such script"),
        ("bash", "curl https://example.com\n", "does not know how to check"),
        ("yaml", "data:\n  mode: both\n", "mode"),
        ("python", "from lit_seqpack import NoSuchName\n", "NoSuchName"),
    ],
)
def test_a_stale_block_fails(lang: str, code: str, error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import _docs_runner

    _docs_runner.make_sandbox(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["docs-runner"])  # the CLIs read their own arguments
    with pytest.raises((Exception, SystemExit)) as raised:
        _docs_runner.run_block({"where": "stale.md:1", "lang": lang, "code": code})
    assert error in f"{raised.typename}: {raised.value}"
