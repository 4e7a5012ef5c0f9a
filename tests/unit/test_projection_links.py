"""The links the projection prices collectives with: the wait for the slowest rank (a curve over the compute
before each message, read between rounds), FSDP2's own host path per message, the sweep's links lines, and
measured links over a profile's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayvit.config import load_config
from rayvit.measure.links import fit_link, host_wait
from rayvit.projection import comms
from rayvit.projection.hardware_profile import Link, with_measured_links
from rayvit.projection.performance import ComputeRate, project
from rayvit.projection.profiles import cpu_profile, get_profile

DEFAULT = Path(__file__).resolve().parents[2] / "experiments/configs/cpu_default.yaml"


def test_the_wait_for_the_slowest_rank_grows_with_the_compute_before_each_message():
    """a + b sqrt(gap) through the measured curve; one point is a flat wait; noise never makes it shrink."""
    link = Link(busbw=1e9, latency_s=1e-4, wait_curve=((2e-3, 0.8e-3), (10e-3, 1.4e-3)))
    b = (1.4e-3 - 0.8e-3) / (10e-3 ** 0.5 - 2e-3 ** 0.5)
    assert link.wait_s(2e-3) == pytest.approx(0.8e-3) and link.wait_s(10e-3) == pytest.approx(1.4e-3)
    assert link.wait_s(4e-3) == pytest.approx(0.8e-3 + b * (4e-3 ** 0.5 - 2e-3 ** 0.5))
    assert link.wait_s(0.0) == pytest.approx(max(0.0, 0.8e-3 - b * 2e-3 ** 0.5))
    assert Link(1e9, 1e-4, wait_curve=((2e-3, 0.8e-3),)).wait_s(10e-3) == pytest.approx(0.8e-3)
    shrinking = Link(1e9, 1e-4, wait_curve=((2e-3, 1.0e-3), (10e-3, 0.6e-3)))
    assert shrinking.wait_s(2e-3) == shrinking.wait_s(10e-3) == pytest.approx(0.8e-3)
    assert Link(1e9, 1e-4).wait_s(10e-3) == 0.0 and link.wait_s(None) == 0.0


def test_measured_waits_follow_each_strategys_gap_and_fsdps_path_is_added_per_message():
    """DDP's one all-reduce waits after a whole step's work, FSDP's nine messages after a ninth each; FSDP2's
    own host path (measured per message) is added to each of its messages, and to no other strategy's."""
    from rayvit.projection.performance import step_gap

    curve = [[2e-3, 0.8e-3], [10e-3, 1.4e-3]]
    links = {"backend": "gloo", "world_size": 2, "nodes": 1, "memory_bw": 10e9, "shared_host_slowdown": 1.0,
             "host_wait_s": 0.8e-3, "host_wait_curve": curve, "collective_path_s": {"fsdp": 0.5e-3},
             "collectives": {k: {"latency_s": 0.9e-3, "transfer_latency_s": 0.1e-3, "busbw": 1e9} for k in
                             ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")}}
    profile = with_measured_links(cpu_profile(), links)
    link = profile.link("all_gather", 2)
    assert link.latency_s == pytest.approx(0.1e-3) and link.wait_curve == ((2e-3, 0.8e-3), (10e-3, 1.4e-3))
    rate = ComputeRate(seconds_per_image=0.6e-3, source="given")
    for strategy, path in (("ddp", 0.0), ("fsdp", 0.5e-3), ("fairscale_oss", 0.0)):
        cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}"])
        p = project(cfg, 2, profile, rate, peak=1e12)
        msgs = comms.step_messages(cfg, 2)
        gap = step_gap(p.compute_s + p.optimizer_s, msgs)
        assert gap == pytest.approx((p.compute_s + p.optimizer_s) / len(msgs))
        expected = sum(0.1e-3 + link.wait_s(gap) + path + comms.bus_factor(m.kind, 2) * m.bytes / 1e9 for m in msgs)
        assert p.exposed_comm_s == pytest.approx(expected), strategy        # overlap 0 on CPU: all exposed
    ddp = project(load_config(DEFAULT), 2, profile, rate, peak=1e12)
    assert ddp.exposed_comm_s - ddp.comm_s == pytest.approx(0) and ddp.exposed_comm_s > 0.1e-3 + 0.8e-3
    # Links without a curve (older links.json) keep their flat wait inside the latency.
    flat = with_measured_links(cpu_profile(), {**links, "host_wait_curve": None})
    assert flat.link("all_gather", 2).latency_s == pytest.approx(0.9e-3)
    assert flat.link("all_gather", 2).wait_s(10e-3) == 0.0


def test_the_sweeps_links_lines_show_transfer_latencies_the_wait_curve_and_fsdps_path():
    from rayvit.projection.profiles import describe_links as describe

    kinds = {"all_reduce": {"latency_s": 1.1e-3, "transfer_latency_s": 0.2e-3, "busbw": 1.8e9}}
    links = {"backend": "gloo", "world_size": 2, "nodes": 1, "shared_host_slowdown": 1.03, "memory_bw": 17e9,
             "seconds": 2.3, "host_wait_s": 0.9e-3, "host_waits_during_rounds": [[[2e-3, 0.9e-3], [10e-3, 1.2e-3]]],
             "host_wait_curve": [[2e-3, 0.9e-3], [10e-3, 1.2e-3]], "collective_path_s": {"fsdp": 0.5e-3},
             "collectives": kinds}
    lines = describe(links).splitlines()
    assert lines[0].endswith("2.3 s):") and "slowdown 1.03" in lines[0]
    assert lines[1].split() == ["all_reduce", "latency", "200", "us", "busbw", "1.80", "GB/s"]
    assert lines[2].endswith("(read between the rounds): 900 us after 2 ms, 1200 us after 10 ms")
    assert lines[3] == "  fsdp's own host path per collective (beyond its one-rank path): 500 us"
    # Older links (no curve): one flat wait, inside each latency.
    old = describe({**links, "host_wait_curve": None, "collective_path_s": {}}).splitlines()
    assert old[0].endswith("latency includes 900 us waiting for the slowest rank (read between the rounds):")
    assert old[1].split()[2] == "1100" and len(old) == 2


def test_measured_links_override_the_profile_within_their_span():
    links = {"backend": "nccl", "world_size": 16, "nodes": 2, "shared_host_slowdown": 1.0,
             "collectives": {"all_reduce": {"latency_s": 1e-4, "busbw": 5e9}}}
    profile = with_measured_links(get_profile("a100-40gb"), links)
    assert profile.link("all_reduce", 64).busbw == 5e9           # across nodes: measured
    assert profile.link("all_reduce", 8).busbw == 225e9          # inside a node: NVLink, from the profile
    # Not measured: EFA, 50 GB/s x 0.8, x 0.96 for the network's load at 8 nodes (2% per doubling past 2).
    assert profile.link("all_gather", 64).busbw == pytest.approx(40e9 * 0.96)


def test_fit_link_recovers_latency_and_bus_bandwidth():
    n, latency, busbw = 4, 2e-4, 3e9
    points = [[b, latency + comms.bus_factor("all_gather", n) * b / busbw] for b in (2 ** 16, 2 ** 20, 2 ** 24)]
    fit = fit_link(points, "all_gather", n)
    assert fit["latency_s"] == pytest.approx(latency)
    assert fit["busbw"] == pytest.approx(busbw)


def test_the_wait_for_the_slowest_rank_is_one_figure_pooled_over_kinds_and_sizes():
    in_step = {"all_gather": [[1e4, 1.2e-3], [1e6, 2.0e-3]], "all_reduce": [[1e4, 1.4e-3], [1e6, 2.6e-3]]}
    aligned = {"all_gather": [[1e4, 0.2e-3], [1e6, 1.0e-3]], "all_reduce": [[1e4, 0.2e-3], [1e6, 1.8e-3]]}
    assert host_wait(in_step, aligned) == pytest.approx(1.0e-3)
    assert host_wait(aligned, in_step) == 0.0          # never negative
