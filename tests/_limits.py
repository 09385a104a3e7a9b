"""The suite's hang guards, in one place: limits that only a hang reaches, never a check of the machine's speed.

A loaded 2-core box runs the suite about 4x slower than a quiet one (56 min under load 15-20 against 13.5 min), and
one test failed there only because its subprocess limit (280 s) was sized for a quiet box. These limits are far above
what any test takes on a loaded box, so a test that reaches one is hung (a collective waiting for a rank that will
never come, a deadlocked loader), not slow:

- :data:`SUBPROCESS_TIMEOUT_S` bounds one subprocess or one group of processes started together (a training run, a
  benchmark, the CLI, ``mp.spawn`` ranks);
- :data:`COLLECTIVE_TIMEOUT` bounds one collective of a test's process group (gloo), so a hang inside the group
  raises naming the collective before the test's own limit is reached;
- :data:`TEST_TIMEOUT_S` and :func:`stages_timeout` are the ``pytest.mark.timeout`` of a test (one stage, or
  several run one after the other).
"""

from __future__ import annotations

from datetime import timedelta

SUBPROCESS_TIMEOUT_S = 900
"""Seconds one subprocess (or one group of processes started together) may run before it counts as hung."""

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""The process-group timeout of the suite's multi-process tests: below a test's limit, far above any collective."""

TEST_TIMEOUT_S = SUBPROCESS_TIMEOUT_S + 300
"""``pytest.mark.timeout`` of a test with at most one subprocess stage (or none: a long in-process test)."""


def stages_timeout(stages: int) -> int:
    """``pytest.mark.timeout`` for a test (fixture included) that runs ``stages`` subprocess stages in sequence."""
    return stages * SUBPROCESS_TIMEOUT_S + 300
