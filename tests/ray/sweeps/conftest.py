"""The sweeps' set-up: the default sweep, started in the background as soon as the module starts, with no
address (a local instance of its own) and a store of its own, and the ``ray start`` head the other CLI runs
attach to, with their own store (test_sweep_runs.py's docstring says why)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

import browser
from clusters import ReadToEnd, clean_env, running_head

from helpers_cli import FEW_STEPS, SCRIPT, cli_env


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The default sweep's store and environment: a fresh root, as a user's first run finds it."""
    root = tmp_path_factory.mktemp("sweeps")
    return root, cli_env(root)


class _DefaultSweep(ReadToEnd):
    """The default sweep's process (``ReadToEnd``); once it has exited with status 0 (and a browser test
    can run here), the reading thread starts ``mlflow server`` over its store (``ui``), which the browser
    test waits for instead of starting it."""

    def __init__(self, proc: subprocess.Popen, uri: str, ui_root: Path):
        self.ui = browser.MlflowServer(uri, ui_root)
        super().__init__(proc, then=self._serve)

    def _serve(self, _) -> None:
        if self.proc.returncode == 0 and browser.missing() is None:
            self.ui.start()

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        self.finish(timeout)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.out, self.err)

    def close(self) -> None:
        self.stop()
        self.ui.stop()


@pytest.fixture(scope="module")
def _default_sweep_started(store, tmp_path_factory):
    """The default sweep, started in the background as soon as a test of this module needs it or the
    module's head (it mostly waits on its local instance's start-up and on its worker groups, which the
    other tests' commands fill), with no address: it starts a local instance of its own. Killed at the
    module's end if no test waited for it; the MLflow server over its store is stopped then too."""
    root, env = store
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--name", "default", *FEW_STEPS], env=env, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sweep = _DefaultSweep(proc, env["MLFLOW_TRACKING_URI"], tmp_path_factory.mktemp("ui"))
    try:
        yield sweep
    finally:
        sweep.close()


@pytest.fixture(scope="module")
def shared_head(tmp_path_factory, _default_sweep_started):
    """A ``ray start`` head the other CLI runs attach to. Its ``ray_current_cluster`` file is in its own
    temp dir, so the default sweep, running meanwhile with no address, never finds it."""
    token = secrets.token_hex(32)
    with running_head(tmp_path_factory.mktemp("head"), clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
                      prefix="rvsw") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def _attached_store(tmp_path_factory, _mlflow_template):
    """The attached runs' store, apart from the default sweep's (two commands write at once): a copy of
    the session's empty store, its tables already made."""
    root = tmp_path_factory.mktemp("attached-sweeps")
    shutil.copyfile(_mlflow_template, root / "mlflow.db")
    return root, cli_env(root)


@pytest.fixture
def attached(_attached_store, shared_head):
    """A CLI environment attached to the module's head (its address and token), with its own store."""
    root, env = _attached_store
    return root, {**env, "RAY_ADDRESS": shared_head.address, "RAY_AUTH_TOKEN": shared_head.env["RAY_AUTH_TOKEN"]}


@pytest.fixture(scope="module")
def default_sweep(store, _default_sweep_started):
    root, env = store
    proc = _default_sweep_started.result(timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"default sweep: {time.monotonic() - _default_sweep_started.start:.0f} s")
    return proc, MlflowClient(env["MLFLOW_TRACKING_URI"])
