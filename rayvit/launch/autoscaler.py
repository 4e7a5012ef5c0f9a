"""The autoscaler's limits: which worker node types it may launch and how many, read from the config
it reads itself.

Ray 2.60's autoscalers (v1 and v2) do not publish their node types or limits to the GCS: the GCS slot
meant for it (``ray._private.state.state.get_cluster_config()``, which Ray Train V2 reads before placing
a worker group) is filled by nothing in open-source Ray. So the limits are read from

1. the autoscaler monitor process of *this* cluster on this machine (the head): its
   ``--autoscaling-config`` file, matched to our GCS address so another cluster on the same machine
   is never mistaken for ours. Covers ``ray up`` (the launcher starts the head with
   ``--autoscaling-config=~/ray_bootstrap_config.yaml``, autoscaler v1 or v2) and the fake provider;
2. ``~/ray_bootstrap_config.yaml`` when the driver runs on the head node (what Ray Tune checks too);
3. on KubeRay, the RayCluster custom resource, translated by Ray's own
   ``AutoscalingConfigProducer`` (the code the KubeRay autoscaler sidecar runs); the head pod's
   service account may read it.

A driver that finds none of these treats the cluster as fixed-size (:mod:`rayvit.launch.capacity`).
``ray job submit`` runs drivers on the head node, where 1-3 apply.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
EPS = 1e-9                       # resources compare with this slack (Ray reports 0.999... CPUs)


def per_node(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle``s one node with ``resources`` holds."""
    counts = [math.floor(resources.get(k, 0.0) / v + EPS) for k, v in bundle.items() if v > 0]
    return max(0, min(counts)) if counts else 0


def _fmt(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class NodeType:
    """A worker node type the autoscaler may launch: its resources and how many of it at most."""

    name: str
    resources: dict[str, float]
    max_nodes: int


@dataclass(frozen=True)
class Autoscaler:
    """The autoscaler's limits: worker node types and the cap on worker nodes of all types together."""

    source: str
    node_types: tuple[NodeType, ...]
    max_workers: Optional[int] = None

    def plan(self, bundle: dict[str, float], workers: int) -> list[tuple[NodeType, int]]:
        """The fewest worker nodes that hold ``workers`` bundles, biggest holders first, within the
        limits; with ``workers`` beyond the maximum, every node the limits allow."""
        left = self.max_workers if self.max_workers is not None else float("inf")
        chosen = []
        for t in sorted(self.node_types, key=lambda t: -per_node(t.resources, bundle)):
            each = per_node(t.resources, bundle)
            if each <= 0 or workers <= 0 or left <= 0:
                continue
            n = int(min(t.max_nodes, left, math.ceil(workers / each)))
            chosen.append((t, n))
            workers -= n * each
            left -= n
        return chosen

    def describe(self) -> str:
        types = ", ".join(f"{t.max_nodes} x {t.name} {{{', '.join(f'{k}: {_fmt(v)}' for k, v in t.resources.items() if k in ('CPU', 'GPU'))}}}"
                          for t in self.node_types)
        cap = f", at most {self.max_workers} worker nodes in all" if self.max_workers is not None else ""
        return f"up to {types}{cap} (autoscaler config: {self.source})"


def autoscaler_from_config(config: dict[str, Any], source: str) -> Autoscaler:
    """The limits in an autoscaling config (launcher YAML, ``ray_bootstrap_config.yaml``, or the dict
    Ray derives from a RayCluster): every node type but the head's, with its resources and max_workers."""
    types = config.get("available_node_types") or {}
    head = config.get("head_node_type")
    cap = config.get("max_workers")
    node_types = []
    for name, spec in types.items():
        if name == head:
            continue
        # A node type without its own max_workers is limited by the global one only (Ray's schema).
        most = spec.get("max_workers", cap if cap is not None else 0)
        if cap is not None:
            most = min(most, cap)
        resources = {k: float(v) for k, v in (spec.get("resources") or {}).items()}
        if most > 0 and resources:
            node_types.append(NodeType(name, resources, int(most)))
    return Autoscaler(source, tuple(node_types), int(cap) if cap is not None else None)


def _read_config_file(path: str) -> Optional[dict[str, Any]]:
    import yaml  # JSON is YAML too: ray up writes the bootstrap config as JSON

    try:
        with open(os.path.expanduser(path)) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        logger.warning("cannot read the autoscaling config %s: %s", path, e)
        return None
    return config if isinstance(config, dict) else None


def _same_gcs(ours: str, theirs: str, local_ips: set[str]) -> bool:
    host, _, port = ours.rpartition(":")
    their_host, _, their_port = theirs.rpartition(":")
    if port != their_port:
        return False
    # The monitor runs on this machine: a loopback or any of this node's addresses names the same GCS.
    return host == their_host or host in local_ips or host.startswith("127.") or host == "localhost"


def monitor_config_path(gcs_address: str, local_ips: set[str], proc: Path = Path("/proc")) -> Optional[str]:
    """``--autoscaling-config`` of the autoscaler monitor (v1 or v2) serving ``gcs_address`` on this machine."""
    from rayvit.launch import compat

    return compat.autoscaler_monitor_config(gcs_address, lambda ours, theirs: _same_gcs(ours, theirs, local_ips),
                                            proc)


def _kuberay_autoscaler() -> tuple[Optional[Autoscaler], Optional[str]]:
    """On a KubeRay pod: the limits in this pod's RayCluster, read with the pod's service account."""
    from rayvit.launch import compat

    name = os.environ.get("RAY_CLUSTER_NAME")       # KubeRay sets it on every Ray container
    ns_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if not name or not ns_file.exists():
        return None, None
    source = f"RayCluster {name}"
    try:
        config = compat.kuberay_autoscaling_config(name, ns_file.read_text().strip())
    except Exception as e:  # noqa: BLE001 - RBAC or API errors mean "not known", never a crash
        logger.warning("cannot read RayCluster %s from the Kubernetes API: %s", name, e)
        return None, source + " (unreadable)"
    return autoscaler_from_config(config, source), source


def find_autoscaler() -> tuple[Optional[Autoscaler], list[str]]:
    """The attached cluster's autoscaler limits, and the places looked at (for messages)."""
    from rayvit.launch import compat

    import ray

    looked = []
    gcs = ray.get_runtime_context().gcs_address
    node_ip = ray.util.get_node_ip_address()
    path = monitor_config_path(gcs, {node_ip})
    looked.append("the autoscaler monitor on this node")
    if path:
        config = _read_config_file(path)
        if config:
            return autoscaler_from_config(config, path), looked
    on_head = any(n.get("Alive") and n["NodeID"] == ray.get_runtime_context().get_node_id()
                  and compat.HEAD_NODE_RESOURCE in n["Resources"] for n in ray.nodes())
    bootstrap = Path(os.path.expanduser(BOOTSTRAP_CONFIG))
    looked.append(BOOTSTRAP_CONFIG + ("" if on_head else " (not on the head node)"))
    if on_head and bootstrap.exists():
        config = _read_config_file(str(bootstrap))
        if config:
            return autoscaler_from_config(config, BOOTSTRAP_CONFIG), looked
    found, source = _kuberay_autoscaler()
    looked.append(source or "a KubeRay RayCluster (not on Kubernetes)")
    return found, looked
