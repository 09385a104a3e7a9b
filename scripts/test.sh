#!/usr/bin/env bash
# Set up the environment on a fresh clone, then run the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
