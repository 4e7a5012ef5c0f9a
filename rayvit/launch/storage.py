"""Where Ray Train keeps run folders and checkpoints (``launch.storage``), checked before a run starts.

Ray Train persists every rank's checkpoint folder into ``RunConfig.storage_path`` from the node that rank
runs on, and a restarted worker group reads the latest one back from there, possibly on another node.
On one node any local folder serves. On several it must be a folder every node mounts at the same path
(NFS, EFS, FSx, ...) or a URI of a filesystem pyarrow understands (``s3://bucket/prefix``,
``gs://bucket/prefix``): with the default, a folder on each node's own disk, checkpoints scatter over the
nodes and recovery from a lost node fails at its first restore. So a run that checkpoints, on a cluster
where its workers can land on more than one node, is refused unless ``launch.storage`` is set.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from rayvit.errors import StorageError
from rayvit.config import rayvit_home
from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.launch.resources import worker_bundle

__all__ = ["StorageError", "default_storage_path", "storage_path", "check_storage", "worker_slots",
           "checkpoints"]


def default_storage_path() -> str:
    """Absolute (workers change directory): ``$RAYVIT_HOME/ray_results``, default ``~/.rayvit``."""
    return str(rayvit_home() / "ray_results")


def storage_path(cfg: Config) -> str:
    """``RunConfig.storage_path`` for ``cfg``: ``launch.storage`` checked and normalised, else the default.

    A URI must name a filesystem ``pyarrow.fs.FileSystem.from_uri`` opens (the call Ray Train makes; for
    ``s3://`` it asks the bucket's region unless the URI carries ``?region=``). A path must be absolute:
    Train workers run in a Ray session folder of their own, where a relative path means something else.
    """
    value = (cfg.launch.storage or "").strip()
    if not value:
        return default_storage_path()
    if "://" in value:
        return _check_uri(value)
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise StorageError(
            f"launch.storage={value!r} is a relative path; Ray Train workers resolve it in their own session "
            f"folders. Give an absolute path on a mount every node shares (e.g. /mnt/shared/rayvit) or a "
            f"URI such as s3://bucket/prefix")
    try:
        # Created here so a mount that is missing or read-only on the driver's node is reported now.
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StorageError(f"launch.storage={value!r}: cannot create it on this node ({e.strerror}); "
                           f"is the shared mount there and writable?") from e
    return os.path.normpath(path)


def _check_uri(uri: str) -> str:
    import pyarrow.fs

    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(uri)
    except (ValueError, OSError, pyarrow.ArrowException) as e:   # ArrowInvalid is a ValueError
        raise StorageError(
            f"launch.storage={uri!r}: pyarrow cannot open it ({str(e).splitlines()[0]}). Use a URI pyarrow's "
            f"filesystems understand (s3://bucket/prefix, gs://bucket/prefix; for S3 add ?region=... when "
            f"the region cannot be looked up) with credentials on every node, or an absolute path on a "
            f"shared mount") from e
    if not path.strip("/"):
        raise StorageError(f"launch.storage={uri!r} names no bucket or folder; e.g. s3://bucket/rayvit")
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        os.makedirs(path, exist_ok=True)
    return uri


def worker_slots(cfg: Config, nodes: list[dict]) -> list[int]:
    """For each alive node (``ray.nodes()`` entries) that can host one of ``cfg``'s workers, how many."""
    need = worker_bundle(cfg)
    slots = []
    for n in nodes:
        have = n.get("Resources", {})
        fit = int(min(have.get(k, 0.0) // v for k, v in need.items() if v > 0)) if n.get("Alive") else 0
        if fit > 0:
            slots.append(fit)
    return slots


def checkpoints(cfg: Config) -> bool:
    """Whether the run writes checkpoints or restores from them."""
    return cfg.train.checkpoint_every > 0 or cfg.train.max_failures > 0


def check_storage(cfgs: Iterable[Config], nodes: Optional[list[dict]] = None, *,
                  storage_given: bool = False) -> None:
    """Check each run's ``launch.storage``, and refuse runs that would checkpoint to node-local storage
    on a cluster where their workers can span nodes. Raises ``StorageError``; run before the first step.

    ``nodes`` defaults to the running cluster's (``ray.nodes()``). Node-local storage serves only when
    exactly one alive node can host the run's workers and it holds all of them. Otherwise the workers
    (and their replacements after a failure) may land on different nodes; with no node able to host
    them yet, an autoscaling cluster will add nodes, perhaps several. ``storage_given``: the caller set
    ``RunConfig.storage_path`` itself and answers for it.
    """
    cfgs = list(cfgs)
    checked: set[str] = set()
    for cfg in cfgs:
        value = (cfg.launch.storage or "").strip()
        if value and value not in checked:
            storage_path(cfg)
            checked.add(value)
    local = [c for c in cfgs if checkpoints(c) and not (c.launch.storage or "").strip()]
    if not local or storage_given:
        return
    if nodes is None:
        import ray

        nodes = ray.nodes()
    for cfg in local:
        slots = worker_slots(cfg, nodes)
        if len(slots) == 1 and slots[0] >= cfg.parallel.num_workers:
            continue
        if len(slots) > 1:
            where = f"{len(slots)} nodes of this cluster can each host its workers"
        elif slots:
            where = (f"the one node that can host its workers holds {slots[0]} of its "
                     f"{cfg.parallel.num_workers}, so the rest will run on nodes added later")
        else:
            where = "no node can host its workers yet, so they will run on nodes added later"
        raise StorageError(
            f"{cfg.parallel.strategy} x {cfg.parallel.num_workers} workers checkpoints "
            f"(train.checkpoint_every={cfg.train.checkpoint_every}, train.max_failures="
            f"{cfg.train.max_failures}) and {where}, but launch.storage is not set: checkpoints would go to "
            f"{default_storage_path()} on each node's own disk, where a worker restarted on another node "
            f"cannot find them. Set launch.storage to a folder every node mounts (e.g. --set "
            f"launch.storage=/mnt/shared/rayvit) or to a URI such as s3://bucket/rayvit; or run without "
            f"checkpoints (train.checkpoint_every=0, train.max_failures=0)")
