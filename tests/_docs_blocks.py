"""The fenced code blocks of README.md and docs/: where they are, what they are, and how the docs test treats them.

A block's language decides what the test does with it:

- ``python``: executed (each block in a fresh namespace: a block is self-contained, as a reader copies it);
- ``bash`` / ``console``: every ``lit-seqpack ...`` and ``python ...`` command is parsed by its own CLI (the
  LightningCLI subcommands with ``--print_config``, ``inspect`` and ``export`` by their parsers, scripts by their
  ``argparse`` parser), ``bash scripts/...`` must name an existing script, ``pip install`` lines are not run;
- ``yaml``: parsed; a config (top-level ``trainer``/``model``/``data``) is instantiated by the CLI, or only checked
  by its parser when the line before says ``<!-- parse-only: why -->`` (a logger whose package is not a test
  dependency);
- ``text``: output or a diagram, never run.

A block that is only an excerpt says so on the line before it, ``<!-- excerpt: why -->``, and is skipped by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ("python", "bash", "console", "yaml")
"""Languages whose blocks run (or are parsed) in the test."""
LANGUAGES = (*RUN, "text")
"""Every language a block may declare: an untagged block is an error (say what it is)."""

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_EXCERPT = re.compile(r"^\s*<!--\s*excerpt:\s*(?P<reason>.+?)\s*-->\s*$")
_PARSE_ONLY = re.compile(r"^\s*<!--\s*parse-only:\s*(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    page: str
    """The file, relative to the repository root."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    excerpt: str | None
    """Why the block is only an excerpt (skipped), or ``None``."""
    parse_only: str | None = None
    """Why a YAML config is only parsed, not instantiated, or ``None``."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file, in order.

    Raises:
        ValueError: an unclosed fence, naming the file and line.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(ROOT).as_posix()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, indent = i, len(match["indent"])
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{start + 1}: the code block is never closed")
        code = "\n".join(line[indent:] for line in lines[start + 1 : end]) + "\n"
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        excerpt, parse_only = _EXCERPT.match(before), _PARSE_ONLY.match(before)
        found.append(
            Block(
                page,
                start + 1,
                match["lang"],
                code,
                excerpt["reason"] if excerpt else None,
                parse_only["reason"] if parse_only else None,
            )
        )
        i = end + 1
    return found


def commands(code: str) -> list[str]:
    """The commands of a shell block: ``$`` prompts dropped, ``\\`` continuations joined, comments cut.

    Example:
        >>> commands("$ lit-seqpack fit \\\\\\n    --config c.yaml  # train\\n# a note\\n")
        ['lit-seqpack fit --config c.yaml']
    """
    out, pending = [], ""
    for raw in code.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not pending and (not line or line.startswith("#")):
            continue
        line = re.sub(r"\s+#\s.*$", "", line)
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        out.append((pending + line).strip())
        pending = ""
    return out
