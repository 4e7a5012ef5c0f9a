"""Cluster capacity: what a Ray cluster holds now, what its autoscaler can grow it to, and waiting for it.

A run asks for ``num_workers`` bundles of one shape (``{"CPU": c, "GPU": 1}``). For each run this module
decides one of:

- ``fits_now``: the alive nodes can hold every bundle;
- ``can_grow``: they cannot, but the autoscaler may add nodes that can (wait for them, up to
  ``launch.scale_up_timeout_s``);
- ``never_fits``: even at the autoscaler's maximum the bundles do not fit (refused up front, naming
  both numbers);
- ``too_small``: a fixed-size cluster (no autoscaler found) that cannot hold them (refused at once).

Where the autoscaler's maximum comes from: :mod:`rayvit.launch.autoscaler`.

Waiting asks the autoscaler for the whole run up front with ``ray.autoscaler.sdk.request_resources``
(so all nodes boot in one round, before Ray Train's worker-group start timeout begins) and releases
the request afterwards. ``request_resources`` replaces any earlier request on the cluster: rayvit
assumes it is the cluster's only user of that call while a point runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from rayvit.errors import ClusterTooSmall, ScaleUpTimeout
from rayvit.formats import clock as _clock
from rayvit.launch.autoscaler import (Autoscaler, NodeType, autoscaler_from_config, find_autoscaler,  # noqa: F401
                                      EPS, monitor_config_path, per_node)

logger = logging.getLogger(__name__)

FITS_NOW, CAN_GROW, NEVER_FITS, TOO_SMALL = "fits_now", "can_grow", "never_fits", "too_small"

WORKER_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


# --------------------------------------------------------------------------------------------------
# What a run asks for


@dataclass(frozen=True)
class Demand:
    """``workers`` bundles of ``bundle``, plus ``spare_cpus`` CPUs left free beside them."""

    workers: int
    bundle: dict[str, float]
    spare_cpus: float = 0.0
    strategy: str = ""

    @property
    def what(self) -> str:
        return f"{self.strategy} x {self.workers} worker{'' if self.workers == 1 else 's'}"

    @classmethod
    def of(cls, cfg) -> "Demand":
        from rayvit.launch.resources import worker_bundle

        p = cfg.parallel
        bundle = worker_bundle(cfg)
        if p.accelerator_type:
            # Ray Train adds this constraint to every worker bundle (ScalingConfig.accelerator_type).
            bundle[f"accelerator_type:{p.accelerator_type}"] = 0.001
        # Ray Data reads and decodes in tasks of its own: with every CPU held by a training worker they
        # never get scheduled and the workers wait forever for their first batch.
        spare = 1.0 if cfg.data.name in ("parquet", "dataset") else 0.0
        return cls(p.num_workers, bundle, spare, p.strategy)

    @property
    def unit(self) -> str:
        """The resource people count this run in: GPUs if it uses them, else CPUs."""
        return "GPU" if "GPU" in self.bundle else "CPU"

    def total(self, key: str) -> float:
        return self.bundle.get(key, 0.0) * self.workers + (self.spare_cpus if key == "CPU" else 0.0)

    def bundles(self) -> list[dict[str, float]]:
        """What ``request_resources`` is asked for: every worker bundle, plus the spare CPU."""
        extra = [{"CPU": self.spare_cpus}] if self.spare_cpus else []
        return [dict(self.bundle) for _ in range(self.workers)] + extra


def _fmt(x: float) -> str:
    return f"{x:g}"


def _plural(n: float, word: str) -> str:
    return f"{_fmt(n)} {word}{'' if n == 1 else 's'}"


# --------------------------------------------------------------------------------------------------
# What the cluster is and may become


@dataclass
class Cluster:
    """The alive nodes' total resources (head first, if known) and the autoscaler, if one was found."""

    nodes: list[dict[str, float]]
    head: Optional[dict[str, float]] = None
    autoscaler: Optional[Autoscaler] = None
    looked_at: list[str] = field(default_factory=list)

    @property
    def workers(self) -> list[dict[str, float]]:
        return [n for n in self.nodes if n is not self.head]

    def total(self, key: str) -> float:
        return sum(n.get(key, 0.0) for n in self.nodes)


@dataclass(frozen=True)
class Placement:
    """What this cluster can do for one run."""

    demand: Demand
    kind: str                       # FITS_NOW, CAN_GROW, NEVER_FITS or TOO_SMALL
    fits_now: int                   # bundles the alive nodes hold
    ceiling: Optional[int] = None   # bundles the cluster holds at the autoscaler's maximum
    message: str = ""

    @property
    def refused(self) -> bool:
        return self.kind in (NEVER_FITS, TOO_SMALL)


def _ceiling(cluster: Cluster, demand: Demand) -> tuple[int, float]:
    """Bundles and CPUs at the autoscaler's maximum: the head as it is, every worker node the limits
    allow (nodes up now are among them), or what is up now if that is more."""
    a = cluster.autoscaler
    assert a is not None
    head = cluster.head or {}
    grown = a.plan(demand.bundle, 10**9)
    bundles = per_node(head, demand.bundle) + sum(per_node(t.resources, demand.bundle) * n for t, n in grown)
    cpus = head.get("CPU", 0.0) + sum(t.resources.get("CPU", 0.0) * n for t, n in grown)
    now = sum(per_node(n, demand.bundle) for n in cluster.nodes)
    return max(bundles, now), max(cpus, cluster.total("CPU"))


def decide(cluster: Cluster, demand: Demand) -> Placement:
    """Whether ``demand`` fits the cluster now, after the autoscaler grows it, or never."""
    now = sum(per_node(n, demand.bundle) for n in cluster.nodes)
    cpus_now = cluster.total("CPU")
    if now >= demand.workers and cpus_now - demand.total("CPU") >= -EPS:
        return Placement(demand, FITS_NOW, now)
    if cluster.autoscaler is None:
        return Placement(demand, TOO_SMALL, now, None, _too_small(cluster, demand, now))
    ceiling, cpus_max = _ceiling(cluster, demand)
    if ceiling >= demand.workers and cpus_max - demand.total("CPU") >= -EPS:
        return Placement(demand, CAN_GROW, now, ceiling)
    return Placement(demand, NEVER_FITS, now, ceiling, _never_fits(cluster, demand, ceiling, cpus_max))


def _bundle_text(demand: Demand) -> str:
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in demand.bundle.items()) + "}"


def _too_small(cluster: Cluster, demand: Demand, now: int) -> str:
    where = ", ".join(cluster.looked_at) or "nowhere"
    if now < demand.workers:
        need = (f"asked for {demand.workers} workers x {_bundle_text(demand)} ({_plural(demand.total(demand.unit), demand.unit)} "
                f"in all, strategy {demand.strategy}); this fixed-size cluster has {len(cluster.nodes)} node(s) with "
                f"{_fmt(cluster.total('CPU'))} CPUs and {_fmt(cluster.total('GPU'))} GPUs in all, room for {now} "
                f"such workers.")
    else:
        need = (f"data.name=parquet streams through Ray Data, which needs at least one CPU beside the "
                f"{demand.what} x {_fmt(demand.bundle['CPU'])} CPU; this fixed-size cluster has "
                f"{_fmt(cluster.total('CPU'))} CPUs.")
    return (f"{need} Lower parallel.num_workers / sweep.worker_counts or parallel.cpus_per_worker, or add "
            f"nodes. (No autoscaler was found, looked at: {where}. On an autoscaling cluster run the driver "
            f"on the head node, as `ray job submit` does.)")


def _never_fits(cluster: Cluster, demand: Demand, ceiling: int, cpus_max: float) -> str:
    a = cluster.autoscaler
    assert a is not None
    unit, each = demand.unit, demand.bundle.get(demand.unit, 0.0)
    if ceiling < demand.workers:
        nodes = sum(n for _, n in a.plan(demand.bundle, 10**9))
        return (f"asked for {demand.workers} workers x {_bundle_text(demand)} = {_plural(demand.workers * each, unit)} "
                f"(strategy {demand.strategy}); "
                f"the autoscaler can grow this cluster to at most {_plural(nodes, 'worker node')}, room for "
                f"{ceiling} such workers = {_plural(ceiling * each, unit)} ({a.describe()}). Lower "
                f"parallel.num_workers / sweep.worker_counts to at most {ceiling}, or raise the autoscaler's "
                f"max_workers")
    return (f"data.name=parquet streams through Ray Data, which needs at least one CPU beside the "
            f"{demand.what} x {_fmt(demand.bundle['CPU'])} CPU; at the autoscaler's maximum this cluster "
            f"has {_fmt(cpus_max)} CPUs ({a.describe()})")


# --------------------------------------------------------------------------------------------------
# Reading the autoscaler's limits


def read_cluster() -> Cluster:
    """The attached cluster: alive nodes and the autoscaler's limits. Needs ``ray.init`` first."""
    from rayvit.launch import compat

    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    nodes = [dict(n["Resources"]) for n in alive]
    head = next((r for r in nodes if compat.HEAD_NODE_RESOURCE in r), None)
    autoscaler, looked = find_autoscaler()
    return Cluster(nodes, head, autoscaler, looked)


# --------------------------------------------------------------------------------------------------
# The checks the sweep and the search make


def check_plan(cfgs: list, cluster: Optional[Cluster] = None) -> list[Placement]:
    """A verdict per config; raises ``ClusterTooSmall`` naming the first run that can never be placed.

    Runs the autoscaler can grow into pass: they wait for it, one at a time, in :func:`capacity_for`.
    """
    cluster = cluster if cluster is not None else read_cluster()
    verdicts = [decide(cluster, Demand.of(c)) for c in cfgs]
    for v in verdicts:
        if v.refused:
            raise ClusterTooSmall(v.message)
    return verdicts


def summary(verdicts: list[Placement]) -> Optional[str]:
    """One line about the runs that need the autoscaler, or None when every run fits now."""
    grow = [v for v in verdicts if v.kind == CAN_GROW]
    if not grow:
        return None
    largest = max(grow, key=lambda v: v.demand.total(v.demand.unit))
    return (f"cluster: {len(grow)} of {len(verdicts)} run(s) wait for the autoscaler to add nodes (the largest, "
            f"{largest.demand.what}, needs {_plural(largest.demand.total(largest.demand.unit), largest.demand.unit)}; "
            f"at most {largest.ceiling} such workers fit at the autoscaler's maximum)")


def largest(cfgs: list):
    """The config that asks for the most of its unit (GPUs, else CPUs)."""
    return max(cfgs, key=lambda c: (Demand.of(c).total("GPU"), Demand.of(c).total("CPU")))


def worker_start_timeout_s(cfg) -> float:
    """``launch.worker_start_timeout_s``, else ``$RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, else 30."""
    if cfg.launch.worker_start_timeout_s is not None:
        return float(cfg.launch.worker_start_timeout_s)
    return float(os.environ.get(WORKER_START_TIMEOUT_ENV, 30))


def progress_line(cluster: Cluster, demand: Demand, elapsed: float) -> str:
    """``waiting for 56 more GPUs: 1 of 8 nodes up, 2:10 elapsed``."""
    now = sum(per_node(n, demand.bundle) for n in cluster.nodes)
    missing = max(demand.workers - now, 0) * demand.bundle.get(demand.unit, 0.0)
    if missing == 0 and demand.spare_cpus:
        missing = max(demand.total("CPU") - cluster.total("CPU"), 0.0)
    on_head = per_node(cluster.head or {}, demand.bundle)
    needed = (sum(n for _, n in cluster.autoscaler.plan(demand.bundle, demand.workers - on_head))
              if cluster.autoscaler else 0)
    up = sum(1 for n in cluster.workers if per_node(n, demand.bundle) > 0)
    return (f"waiting for {_fmt(missing)} more {demand.unit}{'' if missing == 1 else 's'}: {min(up, needed)} of "
            f"{_plural(needed, 'node')} up, {_clock(elapsed)} elapsed")


def _request(bundles: list[dict[str, float]]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


@contextlib.contextmanager
def capacity_for(cfg, out: Callable[[str], None] = print, *, poll_s: float = 1.0,
                 report_every_s: float = 15.0) -> Iterator[Placement]:
    """Hold the cluster at the size ``cfg`` needs while the body runs.

    Refuses runs that can never fit (``ClusterTooSmall``). When the autoscaler can grow the cluster to
    fit, asks it for every bundle at once, prints progress through ``out`` and waits until the alive
    nodes hold the run, up to ``launch.scale_up_timeout_s`` (then ``ScaleUpTimeout``); the request is
    released when the body ends.
    """
    demand = Demand.of(cfg)
    cluster = read_cluster()
    verdict = decide(cluster, demand)
    if verdict.refused:
        raise ClusterTooSmall(verdict.message)
    requested = False
    try:
        if verdict.kind == CAN_GROW:
            _request(demand.bundles())
            requested = True
            verdict = _wait(cfg, demand, cluster, out, poll_s, report_every_s)
        yield verdict
    finally:
        if requested:
            try:
                _request([])   # an empty request withdraws ours; idle nodes then time out as usual
            except Exception as e:  # noqa: BLE001 - the run's own outcome matters more than this
                logger.warning("could not withdraw the autoscaler request: %s", e)


def _wait(cfg, demand: Demand, cluster: Cluster, out: Callable[[str], None], poll_s: float,
          report_every_s: float) -> Placement:
    import ray
    from rayvit.launch import compat


    deadline_s = float(cfg.launch.scale_up_timeout_s)
    start = time.monotonic()
    out(f"{demand.what}: asked the autoscaler for {_plural(demand.total(demand.unit), demand.unit)} "
        f"(waiting up to {_clock(deadline_s)}, launch.scale_up_timeout_s); "
        + progress_line(cluster, demand, 0.0))
    last = start
    while True:
        time.sleep(poll_s)
        cluster.nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
        cluster.head = next((r for r in cluster.nodes if compat.HEAD_NODE_RESOURCE in r), None)
        verdict = decide(cluster, demand)
        elapsed = time.monotonic() - start
        if verdict.kind == FITS_NOW:
            out(f"{demand.what}: the cluster holds it after {_clock(elapsed)} ({len(cluster.workers)} worker "
                f"node(s) up)")
            return verdict
        if elapsed >= deadline_s:
            raise ScaleUpTimeout(
                f"{demand.what}: the autoscaler did not grow the cluster in time: "
                f"{progress_line(cluster, demand, elapsed)} (launch.scale_up_timeout_s={_fmt(deadline_s)}). "
                f"`ray status` on the head shows pending and failed launches (quota, capacity, image pull)")
        if time.monotonic() - last >= report_every_s:
            out(f"{demand.what}: {progress_line(cluster, demand, elapsed)}")
            last = time.monotonic()


def waiting(fit: Callable[..., Any], out: Callable[[str], None] = print) -> Callable[..., Any]:
    """``fit`` wrapped in :func:`capacity_for`: each call waits for its nodes, then runs."""

    def run(cfg, *args, **kwargs):
        # A worker group's configs (fit_group) share one worker count and resources: the first speaks for all.
        with capacity_for(cfg[0] if isinstance(cfg, (list, tuple)) else cfg, out):
            return fit(cfg, *args, **kwargs)

    return run
