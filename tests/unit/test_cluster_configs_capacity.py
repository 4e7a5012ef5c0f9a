"""What rayvit's capacity check (rayvit.launch.capacity) makes of the shipped cluster configs: the limits as
the AWS launcher's and KubeRay's autoscalers read them, the A100 study's points against them, the progress
line. The configs themselves: test_cluster_configs.py."""

from __future__ import annotations

import copy

import pytest
from ray.autoscaler._private.util import prepare_config

from rayvit.config import load_config, load_study
from rayvit.launch import capacity

from helpers_cluster_files import LAUNCHER, RAYCLUSTER, ROOT, STUDY, read_raycluster, read_yaml


def _launcher_limits() -> capacity.Autoscaler:
    return capacity.autoscaler_from_config(prepare_config(read_yaml(LAUNCHER)), str(LAUNCHER))


def _kuberay_limits() -> capacity.Autoscaler:
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    rc = copy.deepcopy(read_raycluster())
    rc["metadata"]["namespace"] = "default"   # set by the API server; Ray's translation reads it
    return capacity.autoscaler_from_config(_derive_autoscaling_config_from_ray_cr(rc), str(RAYCLUSTER))


def _one_node_up() -> tuple[dict, dict]:
    """The clusters as they start: the CPU head and the one GPU node min_workers keeps."""
    head = {"CPU": 8.0, "node:__internal_head__": 1.0}
    worker = {"CPU": 88.0, "GPU": 8.0, "accelerator_type:A100": 1.0}
    return head, worker


@pytest.mark.parametrize("limits", [_launcher_limits, _kuberay_limits], ids=["launcher", "kuberay"])
def test_every_study_point_fits_or_can_grow_from_one_node(limits):
    head, worker = _one_node_up()
    cluster = capacity.Cluster([head, worker], head, limits())
    study = load_study(ROOT / STUDY)
    cfg = study.run
    kinds = {n: capacity.decide(cluster, capacity.Demand.of(cfg.replace({"parallel.num_workers": n}))).kind
             for n in study.sweep.worker_counts}
    assert kinds == {8: "fits_now", 16: "can_grow", 32: "can_grow", 64: "can_grow"}
    # The check the sweep makes before its first point passes for the whole study.
    capacity.check_plan([cfg.replace({"parallel.num_workers": n}) for n in study.sweep.worker_counts], cluster)


@pytest.mark.parametrize("limits", [_launcher_limits, _kuberay_limits], ids=["launcher", "kuberay"])
def test_a_point_beyond_the_autoscalers_maximum_is_refused_naming_both_numbers(limits):
    head, worker = _one_node_up()
    cluster = capacity.Cluster([head, worker], head, limits())
    cfg = load_config(ROOT / STUDY, ["parallel.num_workers=72"])
    with pytest.raises(capacity.ClusterTooSmall, match=r"asked for 72 workers .*= 72 GPUs.* at most 8 worker "
                                                       r"nodes, room for 64 such workers = 64 GPUs"):
        capacity.check_plan([cfg], cluster)


def test_a_fixed_size_cluster_refuses_what_its_nodes_cannot_hold():
    head, worker = _one_node_up()
    cluster = capacity.Cluster([head, worker], head, None, ["nowhere"])
    cfg = load_config(ROOT / STUDY, ["parallel.num_workers=16"])
    with pytest.raises(capacity.ClusterTooSmall, match=r"asked for 16 workers.*fixed-size cluster.*room for 8"):
        capacity.check_plan([cfg], cluster)


def test_progress_line_counts_gpus_and_nodes():
    head, worker = _one_node_up()
    cluster = capacity.Cluster([head, worker], head, _launcher_limits())
    demand = capacity.Demand.of(load_config(ROOT / STUDY, ["parallel.num_workers=64"]))
    assert capacity.progress_line(cluster, demand, 130) == "waiting for 56 more GPUs: 1 of 8 nodes up, 2:10 elapsed"
