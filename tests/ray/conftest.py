"""One local Ray instance (``ray.init`` in the pytest process) for the modules that drive Ray from this
process with the same settings: the collective microbenchmark, Ray Data's shards, parquet storage, and
rayvit.trainer.

Starting and stopping a local instance costs seconds each time, so these modules share one: they run
one after another at the end of the tier (``SHARED``, in that order, where test_trainer.py stands), the
first starts it and it is shut down before the next test that does not use it (tests after these start
their own Ray, or none: the unit tier checks that nothing left Ray running). test_search_runs.py keeps
an instance of its own (without the dashboard, on purpose).

3 logical CPUs: two training workers plus one for Ray Data's read/decode tasks. The dashboard is on:
Ray Train's placement-group cleaner polls its state API. Ray's worker processes get the repo on their
PYTHONPATH (they import rayvit to run the decode function).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# test_projection_distributed.py first: its test without Ray runs before the instance starts.
SHARED = ("test_projection_distributed.py", "test_data_ray.py", "test_data_storage.py", "test_trainer.py")


def _shared_index(item) -> int | None:
    path = Path(str(item.fspath))
    if path.parent == Path(__file__).parent and path.name in SHARED:
        return SHARED.index(path.name)
    return None


def pytest_collection_modifyitems(session, config, items):
    """The SHARED modules' tests moved together (in SHARED's order) to where test_trainer.py's were."""
    shared = [i for i in items if _shared_index(i) is not None]
    if not shared:
        return
    anchor = next((k for k, i in enumerate(items) if _shared_index(i) == len(SHARED) - 1),
                  items.index(shared[-1]))
    before = [i for i in items[:anchor] if _shared_index(i) is None]
    after = [i for i in items[anchor:] if _shared_index(i) is None]
    items[:] = before + sorted(shared, key=_shared_index) + after


@pytest.fixture(scope="module")
def shared_ray():
    """The shared local instance, started by the first module that asks for it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=3, include_dashboard=True,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [
                     str(REPO), os.environ.get("PYTHONPATH")]))}})
    return ray


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if "shared_ray" in getattr(item, "fixturenames", ()) and (
            nextitem is None or "shared_ray" not in getattr(nextitem, "fixturenames", ())):
        import ray

        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _unreachable_runs_early(request, tmp_path_factory):
    """test_connect.py's unreachable-address commands start with this tier's first test, not when their
    module runs: each waits out a 10 s connect timeout, taking no CPU, and their waits pass beside the
    tests before it. Each notes its own exit time, so what test_connect.py asserts is unchanged."""
    if not any(Path(str(i.fspath)).name == "test_connect.py" for i in request.session.items):
        yield
        return
    import test_connect

    test_connect.start_unreachable_runs(tmp_path_factory)
    yield
    test_connect.stop_unreachable_runs()
