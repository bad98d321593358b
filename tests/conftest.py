"""Settings shared by every test.

Hypothesis runs derandomised (a fixed seed, the same examples every run) with the number of examples
each test asks for, so a property test that finds a bug finds it on every run, on every machine, in CI
and on a laptop alike. `HYPOTHESIS_PROFILE=explore` draws fresh random examples (ten times as many) for
a local bug hunt.

A module that leaves a socket, a transport or a file to the garbage collector fails at its own end
(`no_leaks_left_to_the_collector`), instead of its ResourceWarning (an error under `filterwarnings`) landing in
whichever later test the collector happens to run in.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=3000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def no_leaks_left_to_the_collector() -> Iterator[None]:
    yield
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    leaks = sorted({str(warning.message) for warning in caught if issubclass(warning.category, ResourceWarning)})
    if leaks:
        pytest.fail("this module left to the garbage collector:\n" + "\n".join(leaks), pytrace=False)
