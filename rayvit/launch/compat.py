"""Workarounds for Ray bugs, each with the issue it works around and the versions it is needed for.

This is the only module of rayvit that uses Ray's private APIs. Each workaround degrades to doing
nothing when those APIs are gone.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import ray

logger = logging.getLogger(__name__)


def _actor_placement_groups(job_id: str) -> Optional[list[tuple[bytes, bool]]]:
    """``(id, creator actor dead)`` of ``job_id``'s live, non-detached groups that an actor created.

    Reads the GCS placement-group table directly: Ray's public table omits the creator. None when this
    Ray no longer exposes it (Train's own cleaner is then the only safeguard).
    """
    try:
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        table = state._connect_and_get_accessor().get_placement_group_table()
    except Exception as e:  # noqa: BLE001 - a private API: degrade to Ray's own cleaner
        logger.debug("cannot read the placement-group table: %s", e)
        return None
    groups = []
    for blob in table:
        pg = gcs_pb2.PlacementGroupTableData.FromString(blob)
        # Groups the driver made itself (Tune's per-trial groups) have a nil creator actor.
        if (pg.state == gcs_pb2.PlacementGroupTableData.REMOVED or pg.is_detached
                or pg.creator_job_id.hex() != job_id or not pg.creator_actor_id.strip(b"\x00\xff")):
            continue
        groups.append((pg.placement_group_id, bool(pg.creator_actor_dead)))
    return groups


def release_orphaned_placement_groups(job_id: str) -> list[str]:
    """Remove ``job_id``'s placement groups whose creating actor is dead; return their ids.

    ray-project/ray#54305 (Ray Train V2 + Tune, seen in Ray 2.50-2.60): Ray keeps a placement group until
    both the actor that created it and its job are gone. Train V2's controller (an actor owned by the
    trial) creates the workers' group; when Tune stops a trial mid-run (ASHA), the trial actor and its
    controller die but the group stays reserved until the driver exits, and the next trial's workers
    never fit. Train's own cleaner actor (ray-project/ray#58515) frees it only when the dashboard's
    state API answers. Nothing can use such a group any more: the only actors placed in it belonged to
    the dead creator. Driver-made groups, detached groups and other jobs' groups are left alone.
    """
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = []
    for pg_id, creator_dead in _actor_placement_groups(job_id) or []:
        if not creator_dead:
            continue
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID(pg_id)))
            removed.append(pg_id.hex())
        except Exception as e:  # noqa: BLE001 - already being removed
            logger.debug("could not remove placement group %s: %s", pg_id.hex(), e)
    return removed


def _tune_callback():
    from ray import tune

    return tune.Callback


class PlacementGroupReleaser(_tune_callback()):
    """Tune callback: frees placement groups left by stopped trials, about once a second and at each trial end."""

    def __init__(self, interval_s: float = 1.0):
        self.job_id = ray.get_runtime_context().get_job_id()
        self.interval_s = interval_s
        self.released: list[str] = []
        self._next = 0.0

    def _sweep(self) -> None:
        self._next = time.monotonic() + self.interval_s
        freed = release_orphaned_placement_groups(self.job_id)
        if freed:
            logger.info("released %d placement group(s) left by stopped trials", len(freed))
            self.released += freed

    def on_step_end(self, iteration, trials, **info):
        if time.monotonic() >= self._next:
            self._sweep()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._next = 0.0     # the stopped trial's controller dies shortly after: look again soon

    def on_trial_error(self, iteration, trials, trial, **info):
        self._next = 0.0

    def drain(self, timeout_s: float = 15.0) -> None:
        """After the last trial: wait until no Train run of this job holds a group, freeing orphans."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._sweep()
            if not _actor_placement_groups(self.job_id):
                return
            time.sleep(0.5)
        logger.warning("placement groups of this search are still reserved after %.0f s", timeout_s)


def route_worker_output(handler, keep_ray_printer: bool = False) -> bool:
    """Hand the worker and controller output Ray forwards to this driver to ``handler(batch)`` instead of
    printing it (``batch``: Ray's dict with ``lines``, ``pid``, ``actor_name``, ``is_err``).

    Ray offers only all (``log_to_driver=True``) or nothing (``False``, and then a worker's warnings are
    lost to the console too); the driver-side dispatcher it prints through is private (Ray 2.4x-2.60:
    ``ray._private.ray_logging.global_worker_stdstream_dispatcher``). Returns False, changing nothing,
    when this Ray has no such dispatcher.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    if not keep_ray_printer:
        dispatcher.remove_handler("ray_print_logs")
    dispatcher.remove_handler("rayvit_worker_output")
    dispatcher.add_handler("rayvit_worker_output", handler)
    return True
