"""One local Ray instance for the modules in this folder, which drive Ray from the pytest process with the
same settings: the collective microbenchmark, Ray Data's shards, parquet storage, and rayvit.trainer.

Starting and stopping a local instance costs seconds each time, so these modules share one: a
package-scoped fixture starts it with the first test that asks for it and shuts it down after this
folder's last test (tests elsewhere start their own Ray, or none: the unit tier checks that nothing left
Ray running).

3 logical CPUs: two training workers plus one for Ray Data's read/decode tasks. The dashboard is on:
Ray Train's placement-group cleaner polls its state API. Ray's worker processes get the repo on their
PYTHONPATH (they import rayvit to run the decode function).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="package")
def shared_ray():
    """The shared local instance, started by the first test that asks for it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=3, include_dashboard=True,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [
                     str(REPO), os.environ.get("PYTHONPATH")]))}})
    yield ray
    ray.shutdown()
