"""Ray's private APIs and the workarounds for Ray bugs, each with the Ray version it was checked against.

This is the only module of rayvit that uses Ray's private APIs. Each is listed in :data:`PRIVATE_APIS`
with the Ray version it was checked against and the public API that would replace it;
:func:`missing_private_apis` names those a Ray upgrade removed (a unit test fails loudly on any). Each
workaround degrades to doing nothing when its API is gone; each lookup raises with what to do.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

from rayvit import process_state

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


def job_holds_actor_placement_groups(job_id: str) -> bool:
    """Whether an actor of ``job_id`` (a Train controller) still holds a live placement group; False when
    this Ray no longer exposes the table."""
    return bool(_actor_placement_groups(job_id))


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
    before = list(dispatcher.handlers)
    if not keep_ray_printer:
        dispatcher.remove_handler("ray_print_logs")
    dispatcher.remove_handler("rayvit_worker_output")
    dispatcher.add_handler("rayvit_worker_output", handler)
    # Inside a rayvit entry point, Ray prints its workers' output as before once it returns.
    process_state.on_exit(lambda: setattr(dispatcher, "handlers", before))
    return True


# --------------------------------------------------------------------------------------------------
# Private APIs rayvit relies on (checked against Ray 2.60.0), each with its public replacement, if any.

CHECKED_RAY = "2.60.0"

# The resource Ray puts on the head node only. Public replacement: ``is_head_node`` of
# ``ray.util.state.list_nodes()`` (needs the dashboard, which attached drivers may not have).
HEAD_NODE_RESOURCE = "node:__internal_head__"

# The autoscaler monitor's scripts (v1, v2), as its process's command line names them.
AUTOSCALER_MONITOR_SCRIPTS = ("autoscaler/_private/monitor.py", "autoscaler/v2/monitor.py")


def canonicalize_bootstrap_address(address: Optional[str]) -> str:
    """Ray's own resolution of a driver's address ("auto", "local", $RAY_ADDRESS, the
    ray_current_cluster file), as ``ray.init`` does it. No public replacement: ``ray.init`` resolves
    and connects in one call."""
    from ray._private.services import canonicalize_bootstrap_address as resolve

    return resolve(address)


def ask_gcs_cluster_id(channel, metadata, timeout: float) -> None:
    """One ``GetClusterId`` call to the GCS on ``channel`` (a gRPC channel): raises ``grpc.RpcError``.
    Used to probe a cluster's reachability and authentication mode before ``ray.init``, which would
    hang or retry for minutes. No public replacement."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
    stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=metadata, timeout=timeout)


def auth_token_loader():
    """Ray's token loader (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), which
    knows where this process's token comes from. Public replacement: none (``ray get-auth-token`` is a CLI)."""
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance()


def reload_auth_mode() -> None:
    """Make Ray re-read ``RAY_AUTH_MODE`` (cached when ``ray._raylet`` is imported) and drop the token
    loader's cache, in the order Ray's own ``reset_auth_token_state`` uses. No public replacement."""
    from ray._raylet import Config

    Config.initialize("")
    auth_token_loader().reset_cache()


def kuberay_autoscaling_config(cluster_name: str, namespace: str) -> dict:
    """The autoscaling config of a KubeRay RayCluster, translated by the code the KubeRay autoscaler
    sidecar runs. No public replacement."""
    from ray.autoscaler._private.kuberay.autoscaling_config import AutoscalingConfigProducer

    return AutoscalingConfigProducer(cluster_name, namespace)()


def autoscaler_monitor_config(gcs_address: str, same_gcs: Callable[[str, str], bool],
                              proc: Path = Path("/proc")) -> Optional[str]:
    """``--autoscaling-config`` of the autoscaler monitor (v1 or v2) serving ``gcs_address`` on this
    machine, from the processes' command lines: Ray 2.60's autoscalers publish neither their node types
    nor their limits (the GCS slot ``ray._private.state.state.get_cluster_config()`` stays empty in
    open-source Ray). Public replacement: that slot, once an autoscaler fills it."""
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            args = (proc / entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not any(a.endswith(AUTOSCALER_MONITOR_SCRIPTS) for a in args):
            continue
        opts = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
        if opts.get("autoscaling-config") and same_gcs(gcs_address, opts.get("gcs-address", "")):
            return opts["autoscaling-config"]
    return None


def driver_started_its_head() -> bool:
    """Whether this process's ``ray.init()`` started the instance it is connected to (a local instance,
    its head node this driver's), rather than attaching to a running cluster (``connect_only``). False
    when this Ray no longer keeps the driver's node where it was checked."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:
        return False
    return bool(getattr(getattr(ray_worker, "_global_node", None), "head", False))


def _has(module: str, *names: str) -> Callable[[], Any]:
    def check() -> Any:
        import importlib

        found = importlib.import_module(module)
        for name in names:
            found = getattr(found, name)
        return found
    return check


def _monitor_scripts_exist() -> None:
    import ray

    root = Path(ray.__file__).parent
    missing = [s for s in AUTOSCALER_MONITOR_SCRIPTS if not (root / s).exists()]
    if missing:
        raise FileNotFoundError(", ".join(missing))


def _head_resource_named() -> None:
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    if HEAD_NODE_RESOURCE != HEAD_NODE_RESOURCE_NAME:
        raise ValueError(f"Ray's head-node resource is {HEAD_NODE_RESOURCE_NAME}, no longer {HEAD_NODE_RESOURCE}")


# name -> (how to check it is still there, the public API that would replace it)
PRIVATE_APIS: dict[str, tuple[Callable[[], Any], str]] = {
    "ray._private.services.canonicalize_bootstrap_address": (
        _has("ray._private.services", "canonicalize_bootstrap_address"), "none (ray.init resolves and connects)"),
    "ray.core.generated.gcs_service_pb2_grpc.NodeInfoGcsServiceStub.GetClusterId": (
        _has("ray.core.generated.gcs_service_pb2", "GetClusterIdRequest"), "none"),
    "ray._raylet.AuthenticationTokenLoader": (_has("ray._raylet", "AuthenticationTokenLoader", "instance"), "none"),
    "ray._raylet.Config.initialize": (_has("ray._raylet", "Config", "initialize"), "none"),
    "ray.autoscaler._private.kuberay.autoscaling_config.AutoscalingConfigProducer": (
        _has("ray.autoscaler._private.kuberay.autoscaling_config", "AutoscalingConfigProducer"), "none"),
    "the autoscaler monitor's scripts (AUTOSCALER_MONITOR_SCRIPTS)": (
        _monitor_scripts_exist, "ray._private.state.state.get_cluster_config(), once filled"),
    "the head node's resource (HEAD_NODE_RESOURCE)": (
        _head_resource_named, "ray.util.state.list_nodes()[i].is_head_node"),
    "ray._private.state.state (placement-group table)": (
        _has("ray._private.state", "state"), "ray.util.state.list_placement_groups() lacks the creator actor"),
    "ray._private.worker._global_node (the driver's node: a head it started, or connect_only)": (
        _has("ray._private.worker", "_global_node"), "none (ray.util.state.list_nodes() does not say who started a head)"),
    "ray._private.ray_logging.global_worker_stdstream_dispatcher": (
        _has("ray._private.ray_logging", "global_worker_stdstream_dispatcher"), "ray.init(log_to_driver=...)"),
}


def missing_private_apis() -> list[str]:
    """The private APIs of :data:`PRIVATE_APIS` this Ray no longer has, each with what went wrong."""
    missing = []
    for name, (check, _) in PRIVATE_APIS.items():
        try:
            check()
        except Exception as e:  # noqa: BLE001 - every way of being gone is the same answer
            missing.append(f"{name} ({type(e).__name__}: {e})")
    return missing
