"""A real two-node Ray cluster on this machine: SPREAD placement, checkpoints in shared storage, and
recovery from a lost node.

The head and a worker node are separate ``ray start --block`` processes, each in its own process group,
with their own ports and ``--temp-dir`` (``tests/clusters.py``), so the test neither sees nor disturbs
any other Ray instance here. ``ray stop`` is never used: it stops every Ray process on the machine, other
people's included. Losing a node is ``SIGKILL`` to the worker node's whole process group (raylet, agents
and the Train worker on it), which is what a crashed machine looks like to the rest of the cluster.

Checkpoints go to ``launch.storage``, a folder under the test's tmp dir: on one machine both "nodes"
see it, the stand-in for a mount every node of a real cluster shares (or an ``s3://`` URI). The same
run without ``launch.storage`` is refused before its first step: its checkpoints would land on each
node's own disk.

The training runs go through ``rayvit.trainer.fit`` in a driver subprocess attached with ``RAY_ADDRESS``
(as under ``ray job submit``); that process, not this one, talks to Ray, so the pytest process stays
free for tests that start their own local Ray. The driver records which node each live Train worker
actor is on (Ray's state API) and each run's summary as JSON lines, which the tests assert on.

Observed with Ray 2.60 (2 CPUs, 1 per node), see the README's "Checking" section:
- killing the worker node mid-run fails the rank on the head at once (gloo: "Connection closed by peer"),
  the controller's health check finds the other actor unreachable, and with ``train.max_failures>=1``
  a new worker group is placed as soon as a node with a free CPU joins: the restarted node (a new node
  id), since SPREAD over 1-CPU nodes needs both. The run resumes from its latest checkpoint.
- if no node joins, the new group waits ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (rayvit sets 30 s)
  and the run then fails as a *controller* error (rayvit sets ``controller_failure_limit=0``), not
  counted against ``max_failures``; Ray's own default (unlimited controller retries) would wait forever.
- SPREAD is best effort ("as evenly as possible"); with one CPU per node the one-worker-per-node
  placement is also forced by resources. With spare CPUs on the surviving node, the retried group
  would be packed there instead of waiting for a replacement (STRICT_SPREAD would wait).
- ``ray start`` rewrites ``--node-ip-address=127.0.0.1`` to the host's routable address, so both nodes
  report the same IP and Ray Train gives them ``node_rank=0`` and local ranks 0 and 1: placement has to
  be read from node ids, which is what the driver records.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusters import Cluster, clean_env, kill_group

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HEAD_LABEL, WORKER_LABEL = "rayvit_head", "rayvit_worker"

# A tiny ViT for 2 x 40 steps: long enough to lose a node between checkpoints (every 5 steps, each
# report ~0.5 s), short enough that Ray's start-up dominates.
RUN = ["parallel.num_workers=2", "parallel.placement_strategy=SPREAD", "parallel.strategy=ddp",
       "parallel.cpus_per_worker=1", "data.name=synthetic", "train.batch_size=16", "train.steps=40",
       "train.warmup_steps=2", "train.report_every=5", "train.checkpoint_every=5", "train.max_failures=1"]

# Runs in the cluster as the driver: waits for both nodes, runs each requested fit(), and appends
# events (placement of the Train worker actors, results, failures) to a JSON-lines file.
DRIVER = r'''
import json, os, sys, threading, time
import ray
from ray.util.state import list_actors
from rayvit.config import ConfigError, from_dict
from rayvit.launch.connect import started_local
from rayvit.config import load_config
from rayvit.launch.connect import ensure_ray
from rayvit.trainer import fit, load_checkpoint, loop_config, make_trainer, scaling_config, train_loop_per_worker

spec = json.load(open(sys.argv[1]))
events = open(spec["events"], "a", buffering=1)
current = {"run": None}

def record(**event):
    events.write(json.dumps({"t": time.time(), "run": current["run"], **event}) + "\n")

def labels():
    return {n["NodeID"]: next((k for k in n["Resources"] if k.startswith("rayvit_")), None)
            for n in ray.nodes() if n["Alive"]}

ensure_ray()
# A killed node stays "alive" to the GCS until its health checks fail: wait for exactly our two.
deadline = time.time() + 90
while sorted(filter(None, labels().values())) != ["rayvit_head", "rayvit_worker"] or len(labels()) != 2:
    if time.time() > deadline:
        record(event="error", error=f"cluster never had exactly one head and one worker node: {labels()}")
        sys.exit(3)
    time.sleep(0.2)
node_labels = labels()
record(event="nodes", nodes=node_labels, started_local=started_local())

def watch():
    seen = None
    while True:
        try:
            actors = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
                                 raise_on_missing_output=False)
        except Exception:          # the state API can lag while a node is dying; the next poll retries
            actors = None
        if actors is not None:
            now = sorted((a.actor_id, a.node_id) for a in actors)
            if now != seen:
                seen = now
                if any(n not in node_labels for _, n in now):
                    node_labels.update(labels())
                record(event="workers", workers=[{"actor": a, "node": n, "label": node_labels.get(n)}
                                                 for a, n in now])
        time.sleep(0.25)

threading.Thread(target=watch, daemon=True).start()
def own_trainer(cfg, run):
    """A user's own TorchTrainer and RunConfig: nothing of rayvit's settings, Ray Train's own."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(train_loop_per_worker, train_loop_config=loop_config(cfg),
                        scaling_config=scaling_config(cfg),
                        run_config=RunConfig(name=run["name"], storage_path=run["storage"],
                                             failure_config=FailureConfig(max_failures=cfg.train.max_failures)))

def trained(run):
    """fit(), or (how: make_trainer / own) a TorchTrainer's fit() and its final checkpoint read back."""
    cfg = load_config(run["config"], run["overrides"]) if run.get("config") else from_dict({}, run["overrides"])
    how = run.get("how", "fit")
    if how == "fit":
        return {"result": fit(cfg).to_dict()}
    trainer = make_trainer(cfg) if how == "make_trainer" else own_trainer(cfg, run)
    result = trainer.fit()
    loaded = load_checkpoint(result.checkpoint)
    return {"result": result.return_value, "metrics": {k: result.metrics.get(k) for k in ("step", "restarts", "final")},
            "loaded": {"step": loaded.step, "parameters": sum(p.numel() for p in loaded.model.parameters())}}

for run in spec["runs"]:
    current["run"] = run["name"]
    os.environ["RAYVIT_HOME"] = run["home"]          # the node-local default storage, if none is set
    record(event="start")
    try:
        record(event="done", **trained(run))
    except ConfigError as e:                         # rayvit.launch.storage.StorageError among them
        record(event="refused", error=str(e))
    except Exception as e:                           # TrainingError from fit(); Ray's own from a trainer's
        record(event="failed", error=f"{type(e).__name__}: {e}")
time.sleep(0.5)                                      # let the watcher log the workers' exit
'''


class LocalCluster(Cluster):
    """A head and one worker node (1 CPU each), with token authentication and a token of their own."""

    def __init__(self, logs: Path):
        # The token goes by environment to the nodes and the drivers, never into ~/.ray. Ray Train's
        # health-check tick is rayvit's own (0.5 s a report), not the suite's shorter one: the node-loss
        # test needs the run to outlast the kill.
        env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        env.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
        # A killed node is declared dead after 3 failed health checks 1 s apart (Ray's default: 5 checks
        # 3 s apart): the node-loss tests wait for that. A live but busy node is not: each check still
        # gets Ray's 10 s to answer, and a dead raylet refuses the connection at once.
        env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
        super().__init__(logs, env, prefix="rvmn-")
        self.start_head(num_cpus=1, resources=f'{{"{HEAD_LABEL}": 1}}')
        self.worker_starts = 0
        self.start_worker()

    @property
    def worker_name(self) -> str:
        return f"worker{self.worker_starts}"

    def start_worker(self) -> None:  # type: ignore[override]
        self.worker_starts += 1
        super().start_worker(self.worker_name, num_cpus=1, resources=f'{{"{WORKER_LABEL}": 1}}')

    def kill_worker(self) -> None:
        self.kill(self.worker_name)

    def ensure_worker(self) -> None:
        if not self.alive(self.worker_name):
            self.nodes.pop(self.worker_name, None)
            self.start_worker()

    def driver(self, name: str, runs: list[dict], env: dict | None = None) -> "Driver":
        return Driver(self, name, runs, env or {})


class Driver:
    """``fit()`` runs in a subprocess attached to the cluster; its events as a list of dicts."""

    def __init__(self, cluster: LocalCluster, name: str, runs: list[dict], env: dict):
        self.events_path = cluster.logs / f"{name}.events.jsonl"
        self.log_path = cluster.logs / f"{name}.driver.log"
        spec = cluster.logs / f"{name}.spec.json"
        spec.write_text(json.dumps({"events": str(self.events_path), "runs": runs}))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(spec)], cwd=ROOT, start_new_session=True,
            env={**cluster.env, "RAY_ADDRESS": cluster.address, **env},
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def events(self) -> list[dict]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"driver still running after {timeout:.0f} s:\n{self.tail()}") from None

    def events_at_end(self, timeout: float) -> list[dict]:
        """Wait for the driver to exit (stopped past ``timeout``); its events, once it exited cleanly."""
        try:
            rc = self.wait(timeout=timeout)
        finally:
            self.stop()
        assert rc == 0, self.tail()
        return self.events()

    def wait_for(self, what: str, condition, timeout: float) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert self.proc.poll() is None, f"driver exited (rc {self.proc.returncode}) before {what}:\n{self.tail()}"
            assert time.time() < deadline, f"no {what} after {timeout:.0f} s:\n{self.tail()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("multinode"))
    try:
        yield c
    finally:
        stray = c.stop()
        assert not stray, f"Ray processes left behind: {stray}"


def _checkpoints(storage: Path) -> list[str]:
    """The checkpoint folders runs have committed under a storage location (one folder per run)."""
    return [p for p in glob.glob(os.path.join(storage, "*", "checkpoint_*")) if os.path.isdir(p)]


def _placements(events: list[dict], run: str) -> list[list[dict]]:
    """Each distinct set of two live Train workers seen during ``run``."""
    return [e["workers"] for e in events if e["event"] == "workers" and e["run"] == run and len(e["workers"]) == 2]


def _one(events: list[dict], event: str, run: str) -> dict:
    found = [e for e in events if e["event"] == event and e["run"] == run]
    assert len(found) == 1, f"expected one {event!r} event for run {run!r}, got {found}"
    return found[0]


def test_checkpointing_to_node_local_storage_is_refused(cluster, tmp_path):
    """Without ``launch.storage`` the checkpointing run would write to each node's own disk: it is
    refused before any Train worker starts, with a message that says what to set."""
    cluster.ensure_worker()
    home = tmp_path / "home"
    events = cluster.driver("refused", [{"name": "refused", "home": str(home), "overrides": RUN}]).events_at_end(90)
    refused = _one(events, "refused", "refused")["error"]
    assert "2 nodes of this cluster can each host its workers" in refused, refused
    assert "launch.storage" in refused and "s3://" in refused and "train.checkpoint_every=5" in refused
    assert not [e for e in events if e["event"] == "workers" and e["run"] == "refused" and e["workers"]]
    assert not _checkpoints(home / "ray_results")


def _check_one_worker_per_node_across_the_loss(events: list[dict], first_worker_node: str) -> None:
    """The faulty run's worker groups: one worker per node before the worker node's loss and after it,
    afterwards on the restarted node (a new id), with new actors."""
    before, *after = _placements(events, "faulty")
    assert sorted(w["label"] for w in before) == [HEAD_LABEL, WORKER_LABEL], before
    assert first_worker_node in {w["node"] for w in before}
    assert after, f"no second worker group seen: {events}"
    assert sorted(w["label"] for w in after[-1]) == [HEAD_LABEL, WORKER_LABEL], after[-1]
    assert first_worker_node not in {w["node"] for w in after[-1]}
    assert not {w["actor"] for w in before} & {w["actor"] for w in after[-1]}


def test_node_loss_mid_run_recovers_from_checkpoint(cluster, tmp_path):
    """SPREAD puts one worker per node; killing the worker node mid-run and restarting it, the run
    resumes from its last checkpoint in ``launch.storage`` and ends with the same step count and losses
    as an unbroken run. The unbroken run names its storage as a ``file://`` URI, the other as a path."""
    cluster.ensure_worker()
    shared = tmp_path / "shared"                       # both nodes see it: the stand-in for a shared mount
    storage = {"reference": f"file://{shared}/reference", "faulty": str(shared / "faulty")}
    home = {name: str(tmp_path / name) for name in ("reference", "faulty")}
    driver = cluster.driver("recover", [{"name": name, "home": home[name],
                                         "overrides": RUN + [f"launch.storage={storage[name]}"]}
                                        for name in ("reference", "faulty")])
    try:
        driver.wait_for("checkpoint of the faulty run in launch.storage",
                        lambda: _checkpoints(shared / "faulty"), timeout=90)
        [nodes_event] = [e for e in driver.events() if e["event"] == "nodes"]
        nodes = nodes_event["nodes"]
        assert nodes_event["started_local"] is False       # attached to a cluster: Ray's preemption watcher stays
        first_worker_node = next(n for n, label in nodes.items() if label == WORKER_LABEL)
        killed_at = time.time()
        cluster.kill_worker()
        cluster.start_worker()
        restarted_at = time.time()
        rc = driver.wait(timeout=90)
    finally:
        driver.stop()
    events = driver.events()
    assert rc == 0, driver.tail()

    # Every checkpoint is in the configured storage, none on a node's default folder.
    for name in ("reference", "faulty"):
        assert _checkpoints(shared / name), f"no checkpoint of the {name} run under {shared / name}"
        assert not _checkpoints(Path(home[name]) / "ray_results"), f"{name}: checkpoints in the default"

    reference = _one(events, "done", "reference")["result"]
    faulty = _one(events, "done", "faulty")["result"]
    assert reference["restarts"] == 0
    assert faulty["restarts"] == 1, "the worker node was lost but the run never restarted"

    # One worker per node, before and after the loss; afterwards on the restarted node (a new id).
    _check_one_worker_per_node_across_the_loss(events, first_worker_node)

    # Continuous: every step exactly once, and the resumed steps reproduce the unbroken run's losses
    # (same seed, data stream, optimizer and schedule state restored from the checkpoint).
    steps = 40
    assert [h["step"] for h in faulty["history"]] == list(range(steps))
    ref_losses = [h["loss"] for h in reference["history"]]
    losses = [h["loss"] for h in faulty["history"]]
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
    assert losses[-1] < losses[0]

    new_group = next(e["t"] for e in events if e["event"] == "workers" and e["run"] == "faulty"
                     and e["workers"] and e["t"] > killed_at)
    done = _one(events, "done", "faulty")["t"]
    print(f"\nworker node killed; restarted {restarted_at - killed_at:.1f} s later; first new Train worker "
          f"{new_group - killed_at:.1f} s after the kill; run finished {done - killed_at:.1f} s after it")


def test_node_loss_without_a_replacement_fails_after_start_timeout(cluster, tmp_path):
    """If the lost node never comes back, the new worker group cannot be placed (SPREAD, 1 CPU per
    node): the run fails once ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` has passed, never hangs."""
    cluster.ensure_worker()
    timeout_s = 5          # no node can take the lost worker back: the run waits this long, then fails
    shared = tmp_path / "shared"
    driver = cluster.driver("lost", [{"name": "lost", "home": str(tmp_path / "lost"),
                                      "overrides": RUN + [f"launch.storage={shared}"]}],
                            env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(timeout_s)})
    try:
        driver.wait_for("checkpoint", lambda: _checkpoints(shared), timeout=90)
        killed_at = time.time()
        cluster.kill_worker()
        rc = driver.wait(timeout=90)
    finally:
        driver.stop()
    events = driver.events()
    assert rc == 0, driver.tail()
    failed = _one(events, "failed", "lost")
    assert f"timed out after {float(timeout_s)} seconds" in failed["error"], failed["error"]
    waited = failed["t"] - killed_at
    assert waited >= timeout_s, f"failed {waited:.1f} s after the loss, before the start timeout"
    print(f"\nworker node killed, not replaced: run failed {waited:.1f} s later: {failed['error'][:160]}")


# cpu_default at its shipped report cadence (one report per 35 steps): the step-10 checkpoint's report is
# the only one before rank 1's process exits at step 15, as a lost worker's would.
LOST_WORKER = ["parallel.num_workers=2", "data.name=digits", "train.steps=30", "train.checkpoint_every=10",
               "train.max_failures=1", "train.fail_at_step=15", "train.fail_rank=1", "train.fail_mode=exit"]


def test_a_lost_worker_resumes_from_the_checkpoint_before_it_whatever_the_report_cadence(cluster, tmp_path):
    """A checkpoint, once written, survives the failure that follows it: rank 1 lost 5 steps after the
    step-10 checkpoint, each run resumes there (``restarts`` 1, every step once) and its final checkpoint
    is the model, read back by ``load_checkpoint``. On this cluster Ray Train keeps its own health-check
    tick: Ray's 2 s under the user's own ``TorchTrainer`` and ``RunConfig``, rayvit's 0.5 s under
    ``make_trainer``; a checkpoint reported between two of its polls was lost with the group."""
    cluster.ensure_worker()
    shared = tmp_path / "shared"
    runs = [{"name": "lost-make-trainer", "how": "make_trainer", "config": "cpu_default", "home": str(tmp_path / "a"),
             "overrides": LOST_WORKER + [f"launch.storage={shared}"]},
            {"name": "lost-own-trainer", "how": "own", "config": "cpu_default", "home": str(tmp_path / "b"),
             "storage": str(shared), "overrides": LOST_WORKER}]
    assert "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in cluster.env
    events = cluster.driver("lost-worker", runs).events_at_end(300)
    for run in runs:
        name = run["name"]
        started = _one(events, "start", name)["t"]
        failed = [e for e in events if e["event"] == "failed" and e["run"] == name]
        assert not failed, f"{name}: {failed[0]['error'][-1500:]}"
        done = _one(events, "done", name)
        result = done["result"]
        assert result["restarts"] == 1, f"{name} never resumed"
        assert [h["step"] for h in result["history"]] == list(range(30)), f"{name}: steps trained twice or lost"
        assert done["metrics"] == {"step": 30, "restarts": 1, "final": True}
        assert done["loaded"]["step"] == 30 and done["loaded"]["parameters"] > 0
        print(f"\n{name}: rank 1 lost at step 15, resumed from step 10; the run took {done['t'] - started:.1f} s")
