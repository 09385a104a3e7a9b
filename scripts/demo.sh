#!/usr/bin/env bash
# Set up the environment on a fresh clone, then run the short CPU demo training on the embedded data.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/lit-seqpack fit --config configs/demo.yaml "$@"
