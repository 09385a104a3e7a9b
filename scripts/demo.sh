#!/usr/bin/env bash
# Set up the environment on a fresh clone, then run the short CPU demo training on the embedded data.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
echo "lit-seqpack is installed in $root/.venv: 'source .venv/bin/activate' puts it on PATH (or call .venv/bin/lit-seqpack)"
exec .venv/bin/lit-seqpack fit --config configs/demo.yaml "$@"
