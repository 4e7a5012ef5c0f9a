"""Real Ray nodes for tests: ``ray start --block`` processes, each in its own process group.

Not a test module. Every node gets its own ports and shares a short ``--temp-dir`` under /tmp, so a
test neither sees nor disturbs any other Ray instance on the machine. ``ray stop`` is never used: it
stops every Ray process on the machine, other people's included. A node is stopped (or "crashed") by
signalling its whole process group (raylet, GCS, agents and the Ray workers it started).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

RAY = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_in_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


def pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def kill_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGKILL a process group and wait until none of its members is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.time() + timeout
    while pids_in_group(proc.pid) and time.time() < deadline:
        time.sleep(0.1)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would point Ray, auth or MLflow elsewhere."""
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


class Cluster:
    """A head node and any number of worker nodes on this machine, started with ``ray start --block``.

    ``env`` is every node's environment: it decides the cluster's authentication mode
    (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, and ``HOME`` for ``~/.ray/auth_token``).
    """

    def __init__(self, logs: Path, env: dict[str, str], *, prefix: str = "rvc-"):
        # Short path: Ray's Unix socket paths live under the temp dir and must stay under 107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        self.logs, self.env = Path(logs), env
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url: Optional[str] = None
        self.nodes: dict[str, subprocess.Popen] = {}

    def _start(self, name: str, num_cpus: int, args: list[str]) -> subprocess.Popen:
        # Every port a second node would otherwise share with the head (or with another Ray instance on
        # this machine) is chosen free; the rest default to random ports.
        cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
               f"--temp-dir={self.temp_dir}", "--object-store-memory=100000000", "--disable-usage-stats",
               f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}", *args]
        with open(self.logs / f"{name}.log", "w") as log:
            # Its own session: the whole node (raylet, GCS, agents, Ray workers) shares one process group.
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.nodes[name] = proc
        return proc

    def start_head(self, num_cpus: int, resources: str = "") -> subprocess.Popen:
        dashboard = free_port()
        self.dashboard_url = f"http://127.0.0.1:{dashboard}"
        return self._start("head", num_cpus, [
            "--head", f"--port={self.port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}",
            *([f"--resources={resources}"] if resources else [])])

    def start_worker(self, name: str, num_cpus: int, resources: str = "") -> subprocess.Popen:
        return self._start(name, num_cpus, [f"--address={self.address}",
                                            *([f"--resources={resources}"] if resources else [])])

    def wait_dashboard(self, timeout: float = 90) -> None:
        """Until the head's dashboard answers (any HTTP status: 401 without a token is an answer)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.dashboard_url + "/api/version", timeout=2).read()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                head = self.nodes["head"]
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("ray head did not start:\n" + self.log("head")[-3000:])
                time.sleep(0.5)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def kill(self, name: str) -> None:
        """SIGKILL a node's whole process group: what a crashed machine looks like to the others."""
        proc = self.nodes.pop(name)
        kill_group(proc)
        left = pids_in_group(proc.pid)
        assert not left, f"node {name}'s processes outlived SIGKILL: {left}"

    def alive(self, name: str) -> bool:
        return name in self.nodes and self.nodes[name].poll() is None

    def stop(self) -> list[int]:
        """Kill every node; returns the pids of Ray processes that survived (should be none)."""
        procs = list(self.nodes.values())
        for name in reversed(list(self.nodes)):
            kill_group(self.nodes.pop(name))
        # Anything still naming our temp dir (e.g. a process that left the group) is ours too.
        for pid in pids_mentioning(self.temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        stray = pids_mentioning(self.temp_dir) + [pid for p in procs for pid in pids_in_group(p.pid)]
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return stray


@contextmanager
def running_head(logs: Path, env: dict[str, str], *, prefix: str, num_cpus: int = 2) -> Iterator[Cluster]:
    """A one-node cluster (its head, dashboard up) for the ``with`` block; stopped after it, and no Ray
    process of it may be left behind."""
    cluster = Cluster(logs, env, prefix=prefix)
    cluster.start_head(num_cpus=num_cpus)
    try:
        cluster.wait_dashboard()
        yield cluster
    finally:
        stray = cluster.stop()
        assert not stray, f"Ray processes left behind: {stray}"


class SweepJob:
    """``ray job submit --working-dir . -- python experiments/scaling.py ...`` against ``dashboard_url``,
    started in the background at once (``submit``); its output (stdout and stderr) goes to ``log``.

    ``result()`` waits for it, within ``limit_s`` of its submission, and returns the output. ``stop()``
    (for a module's end) stops the job if no test waited for it: Ray starts a job's driver in a session
    of its own, which stopping the head would not end."""

    def __init__(self, dashboard_url: str, env: dict[str, str], log: Path, store: str, home: Path,
                 sweep_args: list[str], *, name: str, limit_s: float):
        self.url, self.env, self.log, self.store, self.limit_s = dashboard_url, env, log, store, limit_s
        self.submission = f"rayvit-{name}-{os.urandom(4).hex()}"
        runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": store, "RAYVIT_HOME": str(home)}}
        self.cmd = [RAY, "job", "submit", "--address", dashboard_url, "--working-dir", ".",
                    "--submission-id", self.submission, "--runtime-env-json", json.dumps(runtime_env), "--",
                    sys.executable, "experiments/scaling.py", "--name", name, *sweep_args]
        self.proc: Optional[subprocess.Popen] = None
        self.deadline = 0.0

    def submit(self, cwd: Path) -> "SweepJob":
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         text=True)
        self.deadline = time.monotonic() + self.limit_s
        return self

    def result(self) -> tuple[int, str]:
        """(``ray job submit``'s exit status, its output); fails the test past the limit."""
        assert self.proc is not None, "the job was never submitted"
        try:
            self.proc.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            import pytest

            pytest.fail(f"ray job submit did not end in {self.limit_s:g} s:\n" + self.log.read_text()[-4000:])
        return self.proc.returncode, self.log.read_text()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        subprocess.run([RAY, "job", "stop", "--address", self.url, self.submission], env=self.env,
                       capture_output=True, timeout=120)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ReadToEnd:
    """A command started in the background, read to its end by a thread of its own, which notes when it
    exited (``took``: its own seconds, however late a test reads them) and then calls ``then(self)``.
    Killed after ``limit_s`` if given."""

    def __init__(self, proc: subprocess.Popen, *, limit_s: Optional[float] = None,
                 then: Optional[Callable[["ReadToEnd"], None]] = None):
        self.proc, self.start = proc, time.monotonic()
        self.took: Optional[float] = None
        self.out = self.err = ""
        self._limit, self._then = limit_s, then
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            out, err = self.proc.communicate(timeout=self._limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.out, self.err, self.took = out or "", err or "", time.monotonic() - self.start
        if self._then is not None:
            self._then(self)

    def finish(self, timeout: float) -> "ReadToEnd":
        """Wait up to ``timeout`` seconds for the command to end (and ``then``); fail if it has not."""
        self.thread.join(timeout)
        assert self.took is not None and not self.thread.is_alive(), \
            f"{self.proc.args} still runs after {time.monotonic() - self.start:.0f} s"
        return self

    def stop(self) -> None:
        """Kill the command if it still runs; wait for the thread."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.thread.join()


# -- test_connect.py's unreachable-address commands, started with the tier --------------------------

def scaling_command(tmp_path: Path, args: list[str], **env: str) -> subprocess.Popen:
    run_env = clean_env(RAYVIT_HOME=str(tmp_path / "home"), **env)
    run_env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"
    return subprocess.Popen([sys.executable, "experiments/scaling.py", "--set", "sweep.strategies=ddp",
                             "--set", "sweep.worker_counts=1", *args], cwd=REPO, env=run_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


DEAD_ADDRESS = ("import time; from rayvit.launch.connect import ensure_ray, ClusterUnreachable\n"
                 "t = time.monotonic()\n"
                 "try:\n    ensure_ray()\nexcept ClusterUnreachable as e:\n"
                 "    print(f'{time.monotonic() - t:.1f}|{e}')\n")


class UnreachableRun(ReadToEnd):
    """One unreachable-address command (``ReadToEnd``: its seconds are its own), killed after 60 s."""

    def __init__(self, address: Optional[str], folder: Path, proc: subprocess.Popen):
        super().__init__(proc, limit_s=60)
        self.address, self.folder = address, folder


STARTED_UNREACHABLE: dict[str, UnreachableRun] = {}


def start_unreachable_runs(tmp_path_factory) -> dict[str, UnreachableRun]:
    """The three unreachable-address runs, started together: each mostly waits on a connect timeout, so
    they wait side by side, and beside whatever else runs then. ``tests/ray/conftest.py`` starts them with
    the tier's first test (they take no CPU while they wait); each of test_connect.py's reads its own run."""
    if not STARTED_UNREACHABLE:
        free, dead = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"   # free: nothing listens there
        folders = {name: tmp_path_factory.mktemp(name) for name in ("free", "dead", "dashboard")}
        STARTED_UNREACHABLE["free"] = UnreachableRun(free, folders["free"], scaling_command(folders["free"], ["--address", free]))
        STARTED_UNREACHABLE["dead"] = UnreachableRun(dead, folders["dead"], subprocess.Popen(
            [sys.executable, "-c", DEAD_ADDRESS], cwd=REPO, env=clean_env(RAY_ADDRESS=dead),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        STARTED_UNREACHABLE["dashboard"] = UnreachableRun(None, folders["dashboard"],
                                     scaling_command(folders["dashboard"], ["--address", "http://127.0.0.1:8265"]))
    return STARTED_UNREACHABLE


def stop_unreachable_runs() -> None:
    for run in STARTED_UNREACHABLE.values():
        run.stop()
    STARTED_UNREACHABLE.clear()
