"""Hypothesis profiles of the reliability fuzzing (selected with ``HYPOTHESIS_PROFILE``; see scripts/fuzz.sh).

``reliability-ci`` (the default) keeps the suite fast; ``fuzz`` runs ``FUZZ_EXAMPLES`` examples per property
(default 3000) with no deadline. The profiles are only applied to ``tests/reliability/test_fuzz.py`` (through
:data:`FUZZ_SETTINGS`), so the other hypothesis tests of the suite keep their own settings.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile("reliability-ci", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "3000")),
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "reliability-ci")
FUZZ_SETTINGS = settings(settings.get_profile(PROFILE if PROFILE in ("reliability-ci", "fuzz") else "reliability-ci"))
"""The settings every property of test_fuzz.py runs under."""
