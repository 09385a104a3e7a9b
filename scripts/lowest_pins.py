"""Print ``name==lower`` for every ``name>=lower`` requirement of pyproject.toml (its dependencies and the [dev] extra).

Used by ``scripts/lowest_versions.sh`` as uv constraints, so that every direct requirement is installed at its lower
bound at once (a bound that no release matches, or that conflicts with another, then fails the install by name).

    python scripts/lowest_pins.py [--skip torch] > pins.txt
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

BOUND = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)(\[[^\]]*\])?>=(?P<lower>[0-9][0-9A-Za-z.]*)")


def lowest_pins(pyproject: Path, skip: set[str]) -> list[str]:
    """``name==lower`` of each lower-bounded requirement of the project and its [dev] extra, minus ``skip``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = {}
    for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
        match = BOUND.fullmatch(requirement.replace(" ", ""))
        if match and match["name"] not in skip:
            pins[match["name"]] = f"{match['name']}=={match['lower']}"
    return list(pins.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml")
    parser.add_argument("--skip", action="append", default=[], help="a requirement to leave out (repeatable)")
    args = parser.parse_args()
    print("\n".join(lowest_pins(args.pyproject, set(args.skip))))


if __name__ == "__main__":
    main()
