"""rayvit.launch.capacity without a cluster: the decisions, the limits and finding the autoscaler's config.

The end-to-end behaviour against Ray's real autoscaler is in tests/ray/test_autoscaling.py; the decisions on
the shipped cluster configs are in tests/unit/test_cluster_configs_capacity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rayvit.config import load_config
from rayvit.launch import capacity
from rayvit.launch.capacity import Autoscaler, Cluster, Demand, NodeType, decide

HEAD = {"CPU": 0.0, "node:__internal_head__": 1.0}


def _cfg(*overrides: str):
    return load_config(overrides=["parallel.cpus_per_worker=1", *overrides])


def test_the_fewest_nodes_biggest_first_within_each_type_and_the_global_cap():
    small = NodeType("small", {"CPU": 2.0}, max_nodes=10)
    big = NodeType("big", {"CPU": 8.0}, max_nodes=2)
    a = Autoscaler("test", (small, big), max_workers=3)
    assert a.plan({"CPU": 1.0}, 9) == [(big, 2)]
    assert a.plan({"CPU": 1.0}, 17) == [(big, 2), (small, 1)]
    # Beyond the maximum: every node the limits allow (3 in all), 18 bundles of 1 CPU.
    cluster = Cluster([HEAD], HEAD, a)
    v = decide(cluster, Demand.of(_cfg("parallel.num_workers=19")))
    assert (v.kind, v.ceiling) == ("never_fits", 18)
    assert "asked for 19 workers" in v.message and "at most 3 worker nodes, room for 18 such workers" in v.message
    assert decide(cluster, Demand.of(_cfg("parallel.num_workers=18"))).kind == "can_grow"


def test_a_node_type_too_small_for_one_worker_adds_nothing():
    a = Autoscaler("test", (NodeType("cpu1", {"CPU": 1.0}, 4),))
    v = decide(Cluster([HEAD], HEAD, a), Demand.of(_cfg("parallel.num_workers=1", "parallel.cpus_per_worker=2")))
    assert (v.kind, v.ceiling) == ("never_fits", 0)


def test_parquet_needs_a_cpu_beside_the_workers_now_or_at_the_maximum():
    a = Autoscaler("test", (NodeType("cpu1", {"CPU": 1.0}, 2),))
    parquet = ("data.name=parquet", "data.path=/nonexistent")
    cluster = Cluster([HEAD], HEAD, a)
    assert decide(cluster, Demand.of(_cfg("parallel.num_workers=1", *parquet))).kind == "can_grow"
    v = decide(cluster, Demand.of(_cfg("parallel.num_workers=2", *parquet)))
    assert v.kind == "never_fits" and "Ray Data" in v.message
    assert Demand.of(_cfg("parallel.num_workers=1", *parquet)).bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_a_fixed_cluster_refuses_and_says_where_it_looked():
    cluster = Cluster([{"CPU": 2.0, "node:__internal_head__": 1.0}], None, None, ["the monitor", "elsewhere"])
    with pytest.raises(capacity.ClusterTooSmall, match=r"asked for 3 workers.*fixed-size.*looked at: the monitor, "
                                                       r"elsewhere"):
        capacity.check_plan([_cfg("parallel.num_workers=2"), _cfg("parallel.num_workers=3")], cluster)


def _proc(root: Path, pid: int, *args: str) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "cmdline").write_bytes("\0".join(args).encode() + b"\0")


def test_the_monitor_of_our_cluster_is_found_not_another_clusters(tmp_path):
    py = "/venv/lib/python3.11/site-packages/ray/autoscaler"
    _proc(tmp_path, 10, "python", "-u", f"{py}/_private/monitor.py", "--gcs-address=10.0.0.5:6379",
          "--autoscaling-config=/other/cluster.yaml")
    _proc(tmp_path, 11, "python", "-u", f"{py}/v2/monitor.py", "--logs-dir=/x", "--gcs-address=10.0.0.5:47123",
          "--autoscaling-config=/ours/bootstrap.yaml", "--monitor-ip=10.0.0.5")
    _proc(tmp_path, 12, "python", "-u", f"{py}/_private/monitor.py", "--gcs-address=10.0.0.5:50000")  # readonly
    (tmp_path / "self").mkdir()
    find = capacity.monitor_config_path
    assert find("10.0.0.5:47123", {"10.0.0.5"}, tmp_path) == "/ours/bootstrap.yaml"
    assert find("127.0.0.1:47123", {"10.0.0.5"}, tmp_path) == "/ours/bootstrap.yaml"   # attached by loopback
    assert find("10.0.0.5:6379", {"10.0.0.5"}, tmp_path) == "/other/cluster.yaml"
    assert find("10.0.0.5:50000", {"10.0.0.5"}, tmp_path) is None       # no autoscaler: fixed size
    assert find("10.0.0.9:47123", {"10.0.0.5"}, tmp_path) is None       # a GCS on another machine


def test_progress_line_and_worker_start_timeout(monkeypatch):
    a = Autoscaler("test", (NodeType("cpu1", {"CPU": 1.0}, 2),), max_workers=2)
    cluster = Cluster([HEAD, {"CPU": 1.0}], HEAD, a)
    demand = Demand.of(_cfg("parallel.num_workers=2"))
    assert capacity.progress_line(cluster, demand, 61) == "waiting for 1 more CPU: 1 of 2 nodes up, 1:01 elapsed"
    monkeypatch.delenv(capacity.WORKER_START_TIMEOUT_ENV, raising=False)
    assert capacity.worker_start_timeout_s(_cfg()) == 30
    monkeypatch.setenv(capacity.WORKER_START_TIMEOUT_ENV, "1800")
    assert capacity.worker_start_timeout_s(_cfg()) == 1800
    assert capacity.worker_start_timeout_s(_cfg("launch.worker_start_timeout_s=600")) == 600


def test_every_private_ray_api_rayvit_uses_is_still_there():
    """rayvit.launch.compat is the one door to Ray's private APIs; a Ray upgrade that removes one fails
    here, naming it, rather than deep inside a cluster run."""
    from rayvit.launch import compat

    assert compat.missing_private_apis() == []
    assert all(replacement for _, replacement in compat.PRIVATE_APIS.values())
    import ray

    assert ray.__version__ == compat.CHECKED_RAY, (
        f"Ray {ray.__version__} is not the {compat.CHECKED_RAY} rayvit.launch.compat was checked against: "
        "check each of its private APIs and the workarounds, then update CHECKED_RAY")


def test_no_module_but_compat_reaches_into_rays_private_apis():
    import re
    from pathlib import Path

    import rayvit

    root = Path(rayvit.__file__).parent
    private = re.compile(r"^\s*(from|import)\s+ray(\.\w+)*\.(_private|_raylet|core\.generated)|__internal_head__", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "compat.py" and private.search(p.read_text())]
    assert offenders == [], f"private Ray APIs outside rayvit/launch/compat.py: {offenders}"
