"""Two gloo ranks in forked processes, no Ray, against what the projection counts: the activation bytes
kept with and without checkpointing, a strategy plugin's messages and model state (the throwaway
``ddp_zero1``), FSDP2's padded shards, and the links measured between rounds (the wait for the slowest rank,
FSDP2's own host path). Moved out of the fast tier (tests/unit): each spends seconds on two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayvit.config import load_config
from rayvit.measure.links import fit_link, worker_benchmark
from rayvit.measure.timers import wait_probe
from rayvit.projection import comms, memory
from rayvit.projection.hardware_profile import with_measured_links
from rayvit.projection.profiles import cpu_profile
from rayvit.strategies import STRATEGIES
from rayvit.strategies.costs import chunk_rows
from rayvit.strategies.shapes import vit_tensors

from helpers_activation_checkpointing import SMALL, losses_and_slope, modelled_saved
from helpers_ddp_zero1 import SHORT, DDPZero1
from helpers_two_ranks import flag_apart, spied, two_ranks

DEFAULT = Path(__file__).resolve().parents[2] / "experiments/configs/cpu_default.yaml"

# -- activation checkpointing -------------------------------------------------------------------------------


def _two_rank_runs(rank):
    import torch

    torch.set_num_threads(1)
    out = {}
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        for mode in ("none", "block"):
            cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"model.activation_checkpointing={mode}",
                                        "parallel.num_workers=2", *SMALL])
            out[(strategy, mode)] = losses_and_slope(cfg)
    return out


@pytest.mark.slow
def test_at_two_ranks_checkpointing_trains_the_same_and_keeps_what_the_projection_says(tmp_path):
    ranks = two_ranks(tmp_path, _two_rank_runs)
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        for rank in ranks:
            none, block = rank[(strategy, "none")], rank[(strategy, "block")]
            assert block[0] == pytest.approx(none[0], rel=1e-5), strategy
            for mode, (_, slope) in (("none", none), ("block", block)):
                cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"model.activation_checkpointing={mode}",
                                            "parallel.num_workers=2", *SMALL])
                assert modelled_saved(cfg) == pytest.approx(slope, rel=0.10), (strategy, mode, slope)


# -- a strategy plugin (tests/helpers_ddp_zero1.py) --------------------------------------------------------


def _step(rank: int) -> dict:
    """On one of two ranks: the (kind, bytes) of every all-reduce and broadcast of the third step (DDP has
    rebuilt its buckets by then), and the model-state bytes this rank holds. torch's own all-reduce hook
    sends DDP's fp32 buckets through ``dist.all_reduce``, where they can be seen."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from rayvit.worker import Session

    STRATEGIES[DDPZero1.name] = DDPZero1           # the registry line, in this process
    session = Session(load_config(DEFAULT, ["parallel.strategy=ddp_zero1", *SHORT]))
    session.model.register_comm_hook(None, default_hooks.allreduce_hook)
    sent: list = []

    def record(name, args, kwargs):
        tensor = args[0] if args else kwargs["tensor"]
        sent.append((name, tensor.numel() * tensor.element_size()))

    flags: list = []
    try:
        for _ in range(3):
            sent.clear()
            with spied(record, "all_reduce", "broadcast"), flag_apart(sent, flags):
                session.clear_grads()
                session.train_step()
        return {"sent": sorted(sent), "state": session.model_state_bytes(), "flags": flags}
    finally:
        session.close()


@pytest.mark.slow
def test_at_two_ranks_it_sends_and_holds_what_its_cost_model_says(monkeypatch, tmp_path):
    monkeypatch.setitem(STRATEGIES, DDPZero1.name, DDPZero1)      # the registry line, for this test
    ranks = two_ranks(tmp_path, _step)
    cfg = load_config(DEFAULT, ["parallel.strategy=ddp_zero1", "parallel.num_workers=2", *SHORT])
    projected = sorted((m.kind, m.bytes) for m in comms.step_messages(cfg, 2))
    for r in ranks:
        assert r["flags"] == [[("all_reduce", 8)]] * 3        # the finite-loss flag, after each step's clock
        assert [k for k, _ in r["sent"]] == [k for k, _ in projected]
        assert sum(b for _, b in r["sent"]) == sum(b for _, b in projected)
    assert [s.total for s in memory.model_state(cfg, 2, per_rank=True)] == [r["state"] for r in ranks]


# -- FSDP2's shards ---------------------------------------------------------------------------------------


def _fsdp2_shards(rank):
    import torch

    from rayvit.worker import Session

    torch.set_num_threads(1)
    cfg = load_config(DEFAULT, ["parallel.strategy=fsdp", "parallel.num_workers=2", "train.steps=2",
                                "train.warmup_steps=1"])
    session = Session(cfg)
    try:
        from torch.distributed.fsdp import FSDPModule

        names = {id(p): n for n, p in session.model.named_parameters()}
        out = {}
        for module in session.model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for p in group.fsdp_params:
                        out[names[id(p.sharded_param)]] = (tuple(p.sharded_size), tuple(p.padded_sharded_param_size))
        return out
    finally:
        session.close()


@pytest.mark.slow
def test_fsdp2_shards_at_two_gloo_ranks_are_what_the_projection_counts(tmp_path):
    ranks = two_ranks(tmp_path, _fsdp2_shards)
    cfg = load_config(DEFAULT, ["parallel.strategy=fsdp"])
    tensors = {t.name: t for t in vit_tensors(cfg.model)}
    assert set(ranks[0]) == set(tensors)
    for rank, shards in enumerate(ranks):
        for name, (sharded, padded) in shards.items():
            t = tensors[name]
            assert sharded[0] == chunk_rows(t.shape[0], 2, rank) and padded[0] == chunk_rows(t.shape[0], 2, 0), name
    assert ranks[0]["pos_embed"][1] == (33, 64)                      # 65 rows -> 2 x 33, not 2 x (1, 65, 64)


# -- the links measured between rounds --------------------------------------------------------------------


def _links_with_waits(rank):
    import torch

    torch.set_num_threads(1)        # as a sweep's workers: see _links_with_curves_and_paths
    read = wait_probe(torch.device("cpu"), repeats=10)
    links = worker_benchmark({"sizes": [2 ** 14, 2 ** 18], "repeats": 3, "host_waits": [1e-3, 3e-3]})
    return read, links


def _links_with_curves_and_paths(rank):
    import torch

    from rayvit.measure.timers import wait_curve

    # One thread per rank, as a sweep's workers have (cpus_per_worker): two ranks of two OpenMP threads on
    # two cores spin on each other, and the 10-ms segments' matmuls then took up to 50 s.
    torch.set_num_threads(1)
    curve = wait_curve(torch.device("cpu"), seconds_each=0.05)
    cfgs = [load_config(DEFAULT, [f"parallel.strategy={s}"]).to_dict() for s in ("ddp", "fsdp")]
    links = worker_benchmark({"sizes": [2 ** 14, 2 ** 18], "repeats": 3, "strategy_configs": cfgs,
                              "host_waits": [[[2e-3, 1e-3], [10e-3, 2e-3]], [[2e-3, 3e-3], [10e-3, 4e-3]]]})
    from rayvit.measure.paths import PATH_PROBES

    # bf16 gathers from fp32 shards, with the LayerNorm groups of their own that `mixed` adds.
    mixed = PATH_PROBES["fsdp"](load_config(DEFAULT, ["parallel.strategy=fsdp", "precision.mode=mixed",
                                                         "precision.dtype=bf16"]), torch.device("cpu"))
    return curve, links, mixed


@pytest.mark.slow
def test_links_carry_the_wait_curve_read_between_rounds_and_fsdps_own_path(tmp_path):
    """Between rounds the workers read the wait after 2 and 10 ms of compute; the links average those
    readings, keep each kind's transfer latency apart, and measure FSDP2's host path per collective (a
    strategy without one, DDP, gets none)."""
    (curve, links, mixed), (_, nothing, _) = two_ranks(tmp_path, _links_with_curves_and_paths)
    assert [g for g, _ in curve] == [2e-3, 10e-3] and all(w >= 0 for _, w in curve) and nothing == {}
    assert [g for g, _ in links["host_wait_curve"]] == [2e-3, 10e-3]
    assert [w for _, w in links["host_wait_curve"]] == pytest.approx([2e-3, 3e-3])
    assert links["host_wait_s"] == pytest.approx(2e-3)
    assert set(links["collective_path_s"]) == {"fsdp"} and links["collective_path_s"]["fsdp"] > 0
    assert mixed > 0
    profile = with_measured_links(cpu_profile(), links)
    for kind, link in links["collectives"].items():
        assert profile.link(kind, 2).latency_s == pytest.approx(link["transfer_latency_s"])
        assert profile.link(kind, 2).wait_s(10e-3) == pytest.approx(3e-3)
    assert profile.collective_path_s == links["collective_path_s"]


@pytest.mark.slow
def test_links_carry_the_wait_read_between_rounds_in_every_latency(tmp_path):
    (read, links), (other, nothing) = two_ranks(tmp_path, _links_with_waits)
    assert read >= 0 and other >= 0 and nothing == {}
    assert links["host_wait_s"] == pytest.approx(2e-3) and links["host_waits_during_rounds"] == [1e-3, 3e-3]
    assert links["host_wait_microbenchmark_s"] >= 0
    for kind, link in links["collectives"].items():
        # The transfer is fitted on the barrier-aligned medians; the wait is added once, to every kind.
        assert link["latency_s"] == pytest.approx(link["transfer_latency_s"] + 2e-3)
        assert link == {**fit_link(link["aligned_points"], kind, 2), "transfer_latency_s": link["transfer_latency_s"],
                        "latency_s": link["latency_s"], "points": link["points"],
                        "aligned_points": link["aligned_points"]}
    profile = with_measured_links(cpu_profile(), links)
    assert profile.link("all_gather", 2).latency_s == pytest.approx(links["collectives"]["all_gather"]["latency_s"])
