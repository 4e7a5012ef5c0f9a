"""The Ray tier's set-up. The modules that share one local Ray instance live in ``one_instance/`` (its
conftest starts it once for the folder).

test_connect.py's unreachable-address commands start with this tier's first test, not when their
module runs: each waits out a 10 s connect timeout, taking no CPU, and their waits pass beside the tests
before it. Each notes its own exit time, so what test_connect.py asserts is unchanged.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _unreachable_runs_early(tmp_path_factory):
    from clusters import start_unreachable_runs, stop_unreachable_runs

    start_unreachable_runs(tmp_path_factory)
    yield
    stop_unreachable_runs()
