#!/usr/bin/env bash
# Long fuzzing campaign of the reliability invariants (planner, samplers, collators, DataModule, attention,
# reference decoder): tests/reliability/test_fuzz.py under the hypothesis profile "fuzz".
#
#   bash scripts/fuzz.sh                      # FUZZ_EXAMPLES=3000 examples per property (10-15 min on 2 cores)
#   FUZZ_EXAMPLES=30000 bash scripts/fuzz.sh  # longer
#   bash scripts/fuzz.sh -k attention         # extra arguments go to pytest
#
# A failing example is printed with a reproduction blob (@reproduce_failure) and kept in .hypothesis/; copy it
# into the test as an @example(...) so that CI replays it forever.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export HYPOTHESIS_PROFILE=fuzz
exec .venv/bin/python -m pytest tests/reliability/test_fuzz.py -q --timeout=0 \
  --hypothesis-show-statistics "$@"
