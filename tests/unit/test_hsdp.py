"""HSDP's cost half and its checks: shard groups inside a node, the shards' all-reduce across nodes, state per
rank over the shard group; config validation; the projection beside DDP and FSDP."""

from __future__ import annotations

import pytest

from rayvit.config import load_config, load_study
from rayvit.errors import ConfigError
from rayvit.projection import comms, memory
from rayvit.projection.performance import group_link, project
from rayvit.projection.profiles import get_profile
from rayvit.strategies.hsdp import shard_size


def study(**overrides):
    return load_study("study_a100", {"parallel.strategy": "hsdp", **overrides}, baseline_required=False).run


def test_the_shard_size_is_a_nodes_gpus_or_the_configured_one():
    cfg = study()
    assert [shard_size(cfg, n, 8) for n in (1, 4, 8, 12, 16, 64)] == [1, 4, 8, 4, 8, 8]
    assert shard_size(cfg, 6, 0) == 6                              # nodes unknown: one shard group
    fixed = study(**{"parallel.shard_size": 16})
    assert [shard_size(fixed, n, 8) for n in (8, 16, 64)] == [8, 16, 16]


def test_a_shard_size_that_does_not_divide_the_workers_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.shard_size=3 does not divide parallel.num_workers=8"):
        load_config("study_a100", {"parallel.strategy": "hsdp", "parallel.shard_size": 3, "parallel.num_workers": 8})
    with pytest.raises(ConfigError, match=r"parallel.shard_size=-1 must be 0"):
        load_config("study_a100", {"parallel.shard_size": -1})
    # Larger than the workers: one shard group of them all.
    load_config("study_a100", {"parallel.strategy": "hsdp", "parallel.shard_size": 16, "parallel.num_workers": 8})


def test_messages_gather_inside_the_node_and_all_reduce_shards_across_nodes():
    cfg = study(**{"parallel.reshard_after_forward": True})
    msgs = comms.step_messages(cfg, 64, per_node=8)
    gathers = [m for m in msgs if m.kind == "all_gather"]
    scatters = [m for m in msgs if m.kind == "reduce_scatter"]
    reduces = [m for m in msgs if m.kind == "all_reduce"]
    assert {m.group for m in gathers + scatters} == {8} and {(m.group, m.stride) for m in reduces} == {(8, 8)}
    # One all-reduce per reduce-scatter, of its output: 1/8 of the group's gradient, in the reduce dtype.
    assert len(reduces) == len(scatters) and sum(m.bytes for m in reduces) * 8 == sum(m.bytes for m in scatters)
    assert all(m.element_bytes == 4 for m in reduces)            # mixed: fp32 reduction
    # Within one node it is FSDP over the node's ranks.
    fsdp = cfg.replace({"parallel.strategy": "fsdp"})
    assert [(m.kind, m.bytes) for m in comms.step_messages(cfg, 8, per_node=8)] == \
        [(m.kind, m.bytes) for m in comms.step_messages(fsdp, 8)]


def test_state_per_rank_is_sharded_over_the_shard_group_only():
    cfg = study()
    at = {n: memory.model_state(cfg, n, per_node=8).total for n in (8, 16, 64)}
    assert at[8] == at[16] == at[64]
    fsdp = cfg.replace({"parallel.strategy": "fsdp"})
    assert at[8] == memory.model_state(fsdp, 8).total
    assert memory.model_state(fsdp, 64).total < at[64] / 4


def test_the_replicas_share_each_nodes_network_as_one_ddp_all_reduce_would():
    """Eight replica groups (one per shard index) cross each node's NICs at once, each with 1/8 of the
    gradients: together the bytes one DDP all-reduce puts through the node, at the node's bandwidth."""
    a100 = get_profile("a100-40gb")
    link, nodes = group_link(a100, "all_reduce", 64, 8, 8)
    assert nodes == 8 and link.busbw == pytest.approx(a100.link("all_reduce", 64).busbw / 8)
    # Within one node a strided group runs over NVLink at its own rate.
    link, nodes = group_link(a100, "all_reduce", 8, 4, 2)
    assert nodes == 1 and link.busbw == a100.intra.busbw


def test_hsdp_beside_ddp_and_fsdp():
    cfg = study(**{"parallel.reshard_after_forward": True})
    fsdp, ddp = cfg.replace({"parallel.strategy": "fsdp"}), cfg.replace({"parallel.strategy": "ddp"})
    h100 = get_profile("h100-sxm")
    # One node: FSDP, exactly.
    assert project(cfg, 8, h100).step_s == pytest.approx(project(fsdp, 8, h100).step_s)
    # At 128 GPUs FSDP's collectives run over 128 ranks (their latency grows with every rank), HSDP's
    # gathers over 8 on NVLink: HSDP wins; and it sends what DDP sends across nodes, which DDP exposes
    # after a whole backward where HSDP spreads it over backward.
    at = {p: project(c, 128, h100) for p, c in (("hsdp", cfg), ("fsdp", fsdp), ("ddp", ddp))}
    assert at["hsdp"].step_s < at["fsdp"].step_s and at["hsdp"].step_s < at["ddp"].step_s
    assert at["hsdp"].memory.state.total > at["fsdp"].memory.state.total


def test_rayvit_project_shows_hsdp_rows_with_its_variant(capsys, tmp_path):
    from rayvit.cli import main

    assert main(["project", "--config", "study_a100", "--set", "sweep.strategies=hsdp", "--hardware", "h100-sxm",
                 "--chips", "8", "64", "--out-dir", str(tmp_path)]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines() if line[:2] in ("8 ", "64")]
    assert [r[1] for r in rows if r[0] == "64"] == ["ddp", "hsdp", "hsdp"]


def test_hsdp_takes_fsdp2s_measured_figures_until_it_has_its_own():
    """HSDP runs FSDP2's wrapper: its own overhead and host path per collective, measured for fsdp, hold for
    hsdp until hsdp's are measured (a plan from a sweep that ran fsdp only)."""
    from rayvit.projection.performance import inherited
    from rayvit.projection.profiles import cpu_profile

    assert inherited({"fsdp": 0.01}, "hsdp") == 0.01 and inherited({"fsdp": 0.01, "hsdp": 0.02}, "hsdp") == 0.02
    assert inherited({"fsdp": 0.01}, "ddp") == 0.0
    cfg = load_config("cpu_default", {"parallel.strategy": "hsdp", "parallel.num_workers": 2})
    bare = cpu_profile(peaks={"fp32": 1e10})
    with_path = bare.replace(collective_path_s={"fsdp": 2e-3})
    assert project(cfg, 2, with_path).step_s > project(cfg, 2, bare).step_s + 10e-3


def test_the_gpu_check_plans_hsdps_cases():
    """rayvit gpu-check trains HSDP, checks its reduce dtype and its 2-D mesh over NCCL (only a GPU runs them)."""
    import torch

    from rayvit.gpu_check import plan_checks

    names = [name for name, _ in plan_checks(torch.device("cpu"), quick=False, compile_=False)]
    assert {"strategy hsdp mixed-bf16", "reduce hsdp mixed-bf16 ->fp32", "hsdp 2-D mesh over NCCL"} <= set(names)
