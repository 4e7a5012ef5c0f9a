"""Shared test setup: four tiers, by folder.

- ``tests/unit``: in one process, no Ray; ``pytest -m "not slow"`` runs these alone, in under a minute.
- ``tests/system``: what needs more than one process but no Ray: a wheel built and installed into a fresh
  venv, two-rank gloo groups; and what takes seconds in one process (the GPU check's worker-group cases on
  CPU). Marked ``slow`` here, by folder.
- ``tests/ray``: real Ray instances and clusters (``ray start``, the fake autoscaler, ``ray job submit``),
  an MLflow server, a browser. Marked ``slow`` here, by folder.
- ``tests/gpu``: what only a GPU can tell (the GPU check's cases); marked ``gpu`` and skipped without CUDA.
- ``tests/helpers_*.py``: what the tiers share (``tests/`` is on ``sys.path`` through this conftest), one
  module per purpose: the repository's paths and the CLIs' settings (helpers_cli), results with chosen
  figures (helpers_results), data (helpers_data), sessions (helpers_sessions), two gloo ranks
  (helpers_two_ranks), a caller's process (helpers_process), and the rest named for their subject.

rayvit itself chooses Ray's authentication mode when it reaches Ray (``rayvit.launch.connect``): token
mode for a local instance, the cluster's own mode when attaching. Several tests call ``ray.init()``
themselves; Ray then turns token mode on too, but warns that it did. Ray caches RAY_AUTH_MODE when it is
imported, so saying so here, before any test module imports Ray, keeps their local instances on token
mode, quietly. Subprocesses that stand for users or cluster nodes get a clean environment
(``clusters.clean_env``), not this one.
"""

import gc
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "token")
# Ray Train's controller notices that its workers have finished at its next health-check tick: rayvit
# keeps Ray's 2 s for worker groups (fewer polls while they time steps) and 0.5 s for runs that report.
# The suite runs dozens of short Ray Train runs, none of whose figures it asserts against a
# threshold that polling could move: a 0.2 s tick (the caller's value, which rayvit keeps) saves about
# 2 s per worker group. Its drivers, CLI subprocesses and cluster nodes inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

TESTS = Path(__file__).resolve().parent
TIER_MARKS = {"ray": ("slow",), "system": ("slow",), "gpu": ("gpu",)}


def pytest_collection_modifyitems(config, items):
    """Each test is marked by its tier, the folder under tests/ it lives in (subfolders included)."""
    for item in items:
        tier = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        for mark in TIER_MARKS.get(tier, ()):
            item.add_marker(getattr(pytest.mark, mark))


def pytest_collection_finish(session):
    """Everything the test modules imported (torch, Ray, MLflow, ...) moves to the collector's permanent
    generation: rayvit collects garbage after every run it trains (a full ``gc.collect()``, to release a
    model before its process group), and a full collection walks every tracked object, a quarter second
    each in this process. Frozen objects are never walked (nor freed); what the tests make is collected
    as usual."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_earlier_modules_left():
    """The same at each module's start, for what earlier modules imported late (a collection first, so
    that no garbage is frozen)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="module")
def digits_parquet(tmp_path_factory) -> Path:
    """All 1797 digits as PNGs converted to parquet by the to_parquet CLI (4 shards), once per module."""
    from helpers_data import export_digits_parquet

    return export_digits_parquet(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, its tables made once: MLflow's migrations take seconds per store."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = tmp_path_factory.mktemp("mlflow-template")
    SqlAlchemyStore(f"sqlite:///{folder / 'mlflow.db'}", str(folder / "mlartifacts")).engine.dispose()
    return folder / "mlflow.db"


@pytest.fixture
def mlflow_store(tmp_path, _mlflow_template) -> str:
    """A fresh, empty MLflow store of this test's own (a copy of the template): its sqlite URI."""
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_mlflow_template, db)
    return "sqlite:///" + str(db)
