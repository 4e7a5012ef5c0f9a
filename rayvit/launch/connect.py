"""Reach Ray: attach to a running cluster in *its* authentication mode, or start a local instance.

``ensure_ray(address)`` is the one entry point. With no address (and no ``$RAY_ADDRESS``, and no cluster
started with ``ray start`` on this machine) it starts a local instance with token authentication on,
quietly. Otherwise it attaches, in three steps that each fail with an error saying what to check:

1. **Reachability.** The cluster's GCS is asked for its cluster id over plain gRPC, retried for at most
   ``timeout_s`` (a head that is still starting gets that long to come up). Ray's own connect path
   retries for a minute or more, printing only its GCS retry lines; a typo in ``--address`` or a stale
   ``$RAY_ADDRESS`` must not look like that.
2. **Authentication mode.** The same unauthenticated call tells the mode: a GCS with token
   authentication answers ``UNAUTHENTICATED``, one without answers the request (seen with Ray 2.60).
   The driver then takes the cluster's mode: Ray reads ``RAY_AUTH_MODE`` into its cached config when it
   is imported, and a driver whose mode differs from the cluster's cannot attach, so the variable is set
   and the cached config refreshed, as Ray itself does when it turns token mode on for a local instance
   (``ray/_private/authentication/authentication_token_setup.py``, ``_enable_token_auth``).
3. **The token.** For a token cluster, a token must be found (``$RAY_AUTH_TOKEN``,
   ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and the GCS must accept it; both are checked
   with one more gRPC call before ``ray.init``, whose own error would not say where to get the token.

Under ``ray job submit`` the entrypoint inherits the head's environment plus ``RAY_ADDRESS``, so a job
on a token cluster finds the token the head was given, and a job on a cluster without authentication
finds none and needs none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Optional

from rayvit.errors import ClusterAuthError, ClusterUnreachable, ConnectError
from rayvit import process_state

__all__ = ["ensure_ray", "started_local", "check_cluster", "resolve_address", "cluster_auth_mode", "ConnectError",
           "ClusterUnreachable", "ClusterAuthError", "CONNECT_TIMEOUT_S"]

logger = logging.getLogger(__name__)

# How long an address may take to answer. Long enough for a head that is still starting, short enough
# that a typo is reported well within 30 s of the command starting (imports take part of that).
CONNECT_TIMEOUT_S = 10.0

_AUTH_MODE = "RAY_AUTH_MODE"
_TOKEN_SOURCES = ("$RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH (a file holding the token) or ~/.ray/auth_token; "
                  "`ray get-auth-token` on the head node prints the cluster's token")
# The mode this module last put in RAY_AUTH_MODE: a later local instance in the same process (after
# ray.shutdown()) must not inherit an attached cluster's "disabled" as if the user had chosen it.
_mode_we_set: Optional[str] = None
# Whether the instance this process last reached is a local one ensure_ray started (see started_local).
_started_here = False


def ensure_ray(address: Optional[str] = None, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Attach to ``address`` / ``$RAY_ADDRESS`` in the cluster's auth mode, else start a local instance.

    A no-op when Ray is already initialised (the caller's own ``ray.init`` wins). Raises
    ``ClusterUnreachable`` or ``ClusterAuthError`` within about ``timeout_s`` when attaching fails.

    ``RAY_AUTH_MODE`` and the ``ray`` logger's level are set for ``ray.init`` only and put back once it
    returns (Ray keeps the mode it started in). Inside a rayvit entry point
    (:func:`rayvit.process_state.kept`) they stay set until that entry point returns, and Ray is
    shut down (or detached from) then.
    """
    import ray

    global _started_here
    if ray.is_initialized():
        return
    mode_before = os.environ.get(_AUTH_MODE)
    scoped = process_state.on_exit(lambda: _disconnect(mode_before))
    with contextlib.ExitStack() as stack:
        if not scoped:
            stack.enter_context(_init_only(mode_before))
        target = check_cluster(address, timeout_s=timeout_s)
        _started_here = target is None
        if target is None:
            _start_local()
            return
        try:
            ray.init(address=target, logging_level=logging.WARNING)   # never num_cpus when attaching
        except ConnectionError as e:
            raise ClusterUnreachable(f"the Ray cluster at {target} answered but attaching failed: {e}. "
                                     f"Check `ray status --address {target}` on the head node") from e


@contextlib.contextmanager
def _init_only(mode_before: Optional[str]):
    """``RAY_AUTH_MODE`` and the ``ray`` logger as they were once ``ray.init`` has returned (or failed)."""
    ray_logger = logging.getLogger("ray")
    level, handlers = ray_logger.level, list(ray_logger.handlers)
    try:
        yield
    finally:
        _put_back_auth_mode(mode_before)
        ray_logger.setLevel(level)
        ray_logger.handlers[:] = handlers


def _put_back_auth_mode(mode_before: Optional[str]) -> None:
    global _mode_we_set
    if mode_before is None:
        os.environ.pop(_AUTH_MODE, None)
    else:
        os.environ[_AUTH_MODE] = mode_before
    _mode_we_set = None


def _disconnect(mode_before: Optional[str]) -> None:
    """The end of the rayvit entry point that reached Ray: stop the local instance it started (or detach
    from the cluster), then make Ray's cached auth mode the caller's again."""
    import ray

    from rayvit.launch import compat

    global _started_here
    ray.shutdown()
    _started_here = False
    _put_back_auth_mode(mode_before)
    compat.reload_auth_mode()


def started_local() -> bool:
    """True while Ray runs on a local instance this process started: by :func:`ensure_ray`, or by the
    caller's own ``ray.init()`` with no cluster to attach to (its head node is then this process's). One
    node, this machine, nothing a cloud provider can preempt or drain. False when attached to a cluster."""
    import ray

    if not ray.is_initialized():
        return False
    if _started_here:
        return True
    from rayvit.launch import compat

    return compat.driver_started_its_head()


def check_cluster(address: Optional[str] = None, *, timeout_s: float = CONNECT_TIMEOUT_S) -> Optional[str]:
    """Everything ``ensure_ray`` checks before ``ray.init``, without connecting: the cluster to attach to
    answers, this process takes its auth mode, and holds a token it accepts. Returns the address to
    attach to, or None when a local instance would be started (nothing to check). Cheap when the cluster
    is fine, so callers run it before slower set-up (the tracking store) to report a bad address first.
    """
    import ray

    if ray.is_initialized():
        return None
    target = resolve_address(address)
    if target is None:
        return None
    if target.startswith("ray://"):
        # Ray Client: a different server (port 10001 by default) with no GCS to probe; check only that
        # something listens, and leave authentication to the caller's environment.
        _check_tcp(target[len("ray://"):], timeout_s, what="Ray Client server")
        return target
    given = (address or os.environ.get("RAY_ADDRESS") or "").strip()
    # Ray turns 127.0.0.1 / localhost into this host's address: name both, the user knows only theirs.
    label = target if given in ("", "auto", target) else f"{given} ({target})"
    mode = cluster_auth_mode(target, timeout_s=timeout_s, label=label)
    _set_auth_mode(mode)
    if mode == "token":
        _check_token(target, timeout_s, label)
    return target


def resolve_address(address: Optional[str] = None) -> Optional[str]:
    """The GCS address (host:port or ``ray://...``) ``ray.init`` would attach to, or None for a new local
    instance. Same rules as Ray: ``address``, else ``$RAY_ADDRESS``, else a cluster started with
    ``ray start`` on this machine (Ray's ``ray_current_cluster`` file); ``"local"`` forces a new one."""
    from rayvit.launch import compat

    given = (address or os.environ.get("RAY_ADDRESS") or "").strip() or None
    source = "--address" if address else "$RAY_ADDRESS"
    if given is not None:
        if given.startswith(("http://", "https://")):
            raise ClusterUnreachable(
                f"{source} {given} is a dashboard (job submission) URL; a driver attaches to the cluster's "
                f"GCS address, host:port (`ray start --head --port`, default 6379). To run on the cluster "
                f"through the dashboard, use `ray job submit --address {given} -- python ...`")
        if given.startswith("ray://"):
            return given
    try:
        # Ray's own resolution (its worker.py calls this in ray.init), so "auto", "local", $RAY_ADDRESS and
        # the ray_current_cluster file mean here what they mean to ray.init.
        return compat.canonicalize_bootstrap_address(given)
    except ConnectionError as e:       # "auto" with no cluster running on this machine
        raise ClusterUnreachable(f"{source}={given}: {e}") from e
    except ValueError as e:
        raise ClusterUnreachable(f"{source} {given!r} is not a Ray address: {e}. Expected host:port of the "
                                 f"head node's GCS (default port 6379), e.g. 10.0.0.5:6379") from e


def cluster_auth_mode(address: str, *, timeout_s: float = CONNECT_TIMEOUT_S, label: str = "") -> str:
    """``"token"`` or ``"disabled"``: what the GCS at ``address`` (host:port) requires, asked without a
    token. Raises ``ClusterUnreachable`` when nothing there answers as a GCS within ``timeout_s``.
    ``label``: how to name the address in errors (default: ``address``).
    """
    import grpc

    code, detail = _ask_gcs(address, timeout_s, metadata=None)
    label = label or address
    if code is None:
        return "disabled"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "token"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        raise ClusterUnreachable(
            f"no Ray cluster answered at {label} within {timeout_s:g} s ({detail}). Check that the head "
            f"node is up (`ray status` on it), that {label.split()[0]} is its GCS address (`ray start --head "
            f"--port`, default 6379; not the dashboard's 8265), that this machine can reach that port "
            f"(firewall, security group, VPN), and that $RAY_ADDRESS is not left over from an old cluster")
    raise ClusterUnreachable(
        f"{label} answered, but not as a Ray GCS ({code.name}: {detail}). Is it the head node's GCS port "
        f"(`ray start --head --port`, default 6379), and the same Ray version as here?")


def _ask_gcs(address: str, timeout_s: float, metadata) -> tuple:
    """One ``GetClusterId`` call, retried while the address does not answer; (status code or None, detail)."""
    from rayvit.launch import compat

    import grpc

    deadline = time.monotonic() + timeout_s
    # gRPC backs off up to 2 minutes between reconnects; a head coming up must be seen within the timeout.
    options = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    with grpc.insecure_channel(address, options=options) as channel:
        while True:
            remaining = deadline - time.monotonic()
            try:
                compat.ask_gcs_cluster_id(channel, metadata, timeout=max(0.5, min(remaining, 5.0)))
                return None, ""
            except grpc.RpcError as e:
                code, detail = e.code(), (e.details() or "").strip()
            # Refused or silent: the head may still be starting. Anything else is an answer.
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or time.monotonic() + 0.5 >= deadline:
                return code, detail
            time.sleep(0.5)


def _check_token(address: str, timeout_s: float, label: str) -> None:
    """A token is at hand and the cluster at ``address`` accepts it."""
    from rayvit.launch import compat

    import grpc

    loader = compat.auth_token_loader()
    if not loader.has_token(ignore_auth_mode=True):
        raise ClusterAuthError(
            f"the Ray cluster at {label} has token authentication on, and no token was found here. "
            f"Give this process the cluster's token: {_TOKEN_SOURCES}. A job submitted with "
            f"`ray job submit` needs it in the submitting shell too (with RAY_AUTH_MODE=token)")
    code, detail = _ask_gcs(address, timeout_s, metadata=tuple(loader.get_token_for_http_header().items()))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        raise ClusterAuthError(
            f"the Ray cluster at {label} rejected this process's token ({_token_source()}): it is not that "
            f"cluster's token. Use the token the cluster was started with: {_TOKEN_SOURCES}")
    if code is not None:
        raise ClusterUnreachable(f"the Ray cluster at {label} stopped answering ({code.name}: {detail})")


def _token_source() -> str:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "from $RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"from $RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    return "from ~/.ray/auth_token"


def _set_auth_mode(mode: str) -> None:
    """Make this process (and the processes it starts) use ``mode``, whatever it was at Ray's import.

    Ray caches ``RAY_AUTH_MODE`` in its config when ``ray._raylet`` is imported: it is made to re-read it
    (:func:`rayvit.launch.compat.reload_auth_mode`).
    """
    from rayvit.launch import compat

    global _mode_we_set
    current = os.environ.get(_AUTH_MODE)
    if current == mode:
        return
    if current is not None and current.lower() not in ("token", "disabled"):
        return                      # e.g. "k8s" (KubeRay's own scheme): the operator set it on purpose
    if current is not None and current != _mode_we_set:
        logger.info("RAY_AUTH_MODE=%s here, the cluster's mode is %s: using the cluster's", current, mode)
    os.environ[_AUTH_MODE] = _mode_we_set = mode
    compat.reload_auth_mode()


def _start_local() -> None:
    import ray

    # A fresh local instance turns token authentication on anyway (ray.init calls
    # enable_token_auth_by_default) and warns that it did; choosing it explicitly keeps it on, quietly.
    # An explicit RAY_AUTH_MODE (e.g. "disabled") is the user's choice and stays.
    if os.environ.get(_AUTH_MODE) in (None, _mode_we_set):
        _set_auth_mode("token")
    # The dashboard stays on: Ray Train's placement-group cleaner queries its state API, and without it
    # the console fills with "Failed to query Ray Train Controller actor state".
    ray.init(include_dashboard=True, logging_level=logging.WARNING)


def _check_tcp(hostport: str, timeout_s: float, *, what: str) -> None:
    import socket

    host, _, port = hostport.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except (OSError, ValueError) as e:
            if time.monotonic() + 0.5 >= deadline:
                raise ClusterUnreachable(
                    f"no {what} answered at {hostport} within {timeout_s:g} s ({e}). Check the head node is "
                    f"up and the port (ray start --ray-client-server-port, default 10001) is reachable"
                ) from e
            time.sleep(0.5)
