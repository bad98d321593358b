"""Settings shared by every test.

Hypothesis runs derandomised (a fixed seed, the same examples every run) with the number of examples
each test asks for, so a property test that finds a bug finds it on every run, on every machine, in CI
and on a laptop alike. `HYPOTHESIS_PROFILE=explore` draws fresh random examples (ten times as many) for
a local bug hunt.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=3000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
