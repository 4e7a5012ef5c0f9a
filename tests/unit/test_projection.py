"""rayvit.projection: hand-worked arithmetic, exact model-state bytes against the real strategies, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayvit.models import vit_complexity
from rayvit.config import load_config
from rayvit.projection import comms, memory
from rayvit.measure.links import fit_link, host_wait, worker_benchmark
from rayvit.measure.timers import wait_probe
from rayvit.projection.insweep import sweep_profile
from rayvit.projection.performance import ComputeRate, compute_from_measured, project
from rayvit.projection.hardware_profile import Link, with_measured_links
from rayvit.projection.profiles import cpu_profile, get_profile
from rayvit.strategies.shapes import vit_tensors

from shared import COMBOS, reduce_dtype, two_ranks, vit_b16

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "experiments/configs/cpu_default.yaml"
STUDY = ROOT / "experiments/configs/study_a100.yaml"


# ViT-B/16 at 224 px with a 1000-class head and a class token: 86,567,656 parameters in 152 tensors.
P_B16, TENSORS_B16 = 86_567_656, 152
# FSDP2 splits dim 0 in ceil(d0/N)-row chunks padded to equal size: pos_embed (197, 768) becomes 8 x 25 = 200
# rows at 8 ranks (3 rows of padding); the class token (768,) and every other ViT-B/16 dim 0 divide by 8.
PAD_B16 = (200 - 197) * 768


@pytest.mark.parametrize("overrides", [{}, {"model.classifier": "pooled", "model.stem": "conv"},
                                       {"model.name": "vit_b16", "model.image_size": 224}])
def test_tensor_list_is_the_models_parameters_in_order(overrides):
    from rayvit.models import build_model

    cfg = load_config(DEFAULT, overrides)
    real = [(n, tuple(p.shape)) for n, p in build_model(cfg.model).named_parameters()]
    assert [(t.name, t.shape) for t in vit_tensors(cfg.model)] == real
    assert sum(t.numel for t in vit_tensors(cfg.model)) == vit_complexity(cfg.model).params


def test_vit_b16_parameter_count_by_hand():
    d, m, s, c = 768, 3072, 197, 1000
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
    by_hand = (3 * 16 * 16 * d + d) + d + s * d + 12 * block + 2 * d + d * c + c
    assert by_hand == P_B16 == sum(t.numel for t in vit_tensors(vit_b16().model))
    assert len(vit_tensors(vit_b16().model)) == TENSORS_B16


def test_ddp_against_fsdp_communication_volume_at_8_chips():
    n = 8
    ddp = comms.step_messages(vit_b16(), n)
    # DDP: the fp32 gradients once, in 25 MiB buckets (1 MiB first); ring all-reduce moves 2(n-1)/n of them.
    assert sum(m.bytes for m in ddp) == 4 * P_B16
    assert {m.kind for m in ddp} == {"all_reduce"}
    assert comms.bytes_moved_per_rank(ddp, n) == 2 * 7 / 8 * 4 * P_B16 == 605_973_592
    # FSDP (resharding): per unit (12 blocks + the root) gather for forward, gather again for backward,
    # reduce-scatter the gradients: 3 x 13 messages, each moving (n-1)/n of the padded unit.
    fsdp = comms.step_messages(vit_b16(**{"parallel.strategy": "fsdp"}), n)
    padded = P_B16 + PAD_B16
    assert len(fsdp) == 3 * 13
    assert comms.bytes_moved_per_rank(fsdp, n) == pytest.approx(3 * 7 / 8 * 4 * padded)   # 920,137,092
    # Without resharding the backward gathers go: 2 x (n-1)/n, the same volume as DDP's all-reduce.
    keep = comms.step_messages(vit_b16(**{"parallel.strategy": "fsdp", "parallel.reshard_after_forward": False}), n)
    assert len(keep) == 2 * 13
    assert comms.bytes_moved_per_rank(keep, n) == pytest.approx(2 * 7 / 8 * 4 * padded)
    # Mixed precision, fp32 reduction: gathers in half (LayerNorm's 25 x 2 x 768 in fp32), reduce-scatter in
    # fp32: about (2 + 4) bytes per element against DDP's 2 x 4.
    mixed = comms.step_messages(vit_b16(**{"parallel.strategy": "fsdp", "precision.mode": "mixed",
                                           "parallel.reshard_after_forward": False}), n)
    ln = 25 * 2 * 768
    assert comms.bytes_moved_per_rank(mixed, n) == pytest.approx(7 / 8 * ((2 + 4) * padded + 2 * ln))
    # DDP reducing mixed gradients in half: LayerNorm's fp32 gradients still go in fp32, in buckets of their own.
    half = comms.step_messages(vit_b16(**{"precision.mode": "mixed", "parallel.reduce_dtype": "half"}), n)
    assert comms.bytes_moved_per_rank(half, n) == 2 * 7 / 8 * (2 * (P_B16 - ln) + 4 * ln)


def test_amp_gradients_are_reduced_in_fp32_whatever_the_reduce_dtype():
    """Under amp the parameters and their gradients are fp32: every strategy reduces them in fp32."""
    n = 8
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        amp = vit_b16(**{"parallel.strategy": strategy, "precision.mode": "amp", "parallel.reduce_dtype": "half"})
        fp32 = vit_b16(**{"parallel.strategy": strategy})
        assert [m.bytes for m in comms.step_messages(amp, n)] == [m.bytes for m in comms.step_messages(fp32, n)]
    amp = vit_b16(**{"parallel.strategy": "fairscale_fsdp", "parallel.use_gpu": True, "precision.mode": "amp",
                     "parallel.reduce_dtype": "half"})
    assert {m.element_bytes for m in comms.step_messages(amp, n) if m.kind == "reduce_scatter"} == {4}


def test_fsdp2_gathers_and_reduces_fp32_layernorm_groups_of_their_own():
    """Under mixed with fp32 LayerNorm, FSDP2 holds each block's two norms as one group and the final norm as
    another (an FSDP2 group has one dtype): 13 units + 12 + 1 norm groups, each gathered (twice when
    resharding) and reduce-scattered, the norm groups in fp32."""
    n, ln_block = 8, 4 * 768
    for reshard, per_group in ((True, 3), (False, 2)):
        msgs = comms.step_messages(vit_b16(**{"parallel.strategy": "fsdp", "precision.mode": "mixed",
                                              "parallel.reshard_after_forward": reshard}), n)
        assert len(msgs) == per_group * (13 + 12 + 1)
        norm_msgs = [m for m in msgs if "norms" in m.what]
        assert len(norm_msgs) == per_group * 13
        assert {m.bytes for m in norm_msgs if m.what.startswith("blocks.")} == {4 * ln_block}    # fp32
    # Without fp32 LayerNorm the norms travel inside their blocks, in half.
    plain = comms.step_messages(vit_b16(**{"parallel.strategy": "fsdp", "precision.mode": "mixed",
                                           "precision.layer_norm_fp32": False}), n)
    assert len(plain) == 3 * 13


def test_fairscale_fsdp_messages_root_unresharded_layernorm_wrappers_and_its_bucketer():
    n = 8
    cfg = vit_b16(**{"parallel.strategy": "fairscale_fsdp", "parallel.use_gpu": True})
    msgs = comms.step_messages(cfg, n)
    gathers = [m for m in msgs if m.kind == "all_gather"]
    # FairScale never reshards its root (disable_reshard_on_root): 13 gathers for forward, 12 for backward.
    assert [m.phase for m in gathers].count("forward") == 13 and [m.phase for m in gathers].count("backward") == 12
    # fp32 blocks (28.3 MB of gradient) exceed the 25 MiB bucket and go at once; the root's 6 MB waits in
    # the bucket until backward ends.
    reduces = [m for m in msgs if m.kind == "reduce_scatter"]
    assert [m.phase for m in reduces] == ["backward"] * 12 + ["after"]
    assert reduces[-1].what == "bucket: root grads"

    # mixed fp16 with fp32 LayerNorm, fp32 reduction: each of the 25 LayerNorms a wrapper of its own with
    # unflattened parameters, one fp32 gather per tensor in forward only; their fp32 gradients share the
    # bucket with the root's, sent when backward ends.
    mixed = comms.step_messages(cfg.replace({"precision.mode": "mixed", "precision.dtype": "fp16"}), n)
    ln_gathers = [m for m in mixed if m.kind == "all_gather" and ".norm" in "." + m.what]
    assert len(ln_gathers) == 50 and {m.phase for m in ln_gathers} == {"forward"}
    assert {m.bytes for m in ln_gathers} == {768 * 4}
    assert len([m for m in mixed if m.kind == "all_gather"]) == 13 + 50 + 12
    last = mixed[-1]
    assert last.phase == "after" and last.element_bytes == 4 and last.what.count("grads") == 1 + 50
    assert last.bytes == (-(-(P_B16 - 12 * 7_084_800 - 25 * 2 * 768) // n) * n + 50 * 768) * 4


def test_ddp_buckets_exist_at_one_rank_too():
    """The reducer builds its buckets (a second copy of the gradients) at world size 1 as well: the
    transient bytes the projection counts equal the buckets DDP reports, per dtype under mixed."""
    from rayvit.worker import Session

    cfg = load_config(overrides=["parallel.strategy=ddp", "precision.mode=mixed", "model.depth=2"])
    session = Session(cfg)
    try:
        sizes = [int(b) for b in session.model._get_ddp_logging_data()["bucket_sizes"].split(",")]
    finally:
        session.close()
    assert len(sizes) == 2                                   # fp32 LayerNorm apart from the bf16 weights
    assert memory.transient_bytes(cfg, 1) == sum(sizes)
    assert len(comms.step_messages(cfg, 1)) == 2


def test_vit_b16_memory_breakdown_by_hand():
    ddp = memory.model_state(vit_b16(), 8)
    steps = 4 * TENSORS_B16                                   # Adam's fp32 step counter per tensor
    assert (ddp.params, ddp.grads, ddp.masters, ddp.optimizer) == (4 * P_B16, 4 * P_B16, 0, 8 * P_B16 + steps)
    mixed = memory.model_state(vit_b16(**{"precision.mode": "mixed"}), 8, layer_norm_fp32=False)
    assert (mixed.params, mixed.grads, mixed.masters, mixed.optimizer) == \
        (2 * P_B16, 2 * P_B16, 8 * P_B16, 8 * P_B16 + steps)
    # LayerNorm kept in fp32: its 25 norms x 2 x 768 elements stay fp32 and need no master copy.
    ln = 25 * 2 * 768
    kept = memory.model_state(vit_b16(**{"precision.mode": "mixed"}), 8, layer_norm_fp32=True)
    assert (kept.params, kept.masters) == (2 * P_B16 + 2 * ln, 8 * (P_B16 - ln))
    # FSDP at 8: rank 0 holds 1/8 of every tensor, and 25 of pos_embed's 197 rows.
    local = (P_B16 - 197 * 768) // 8 + 25 * 768
    assert local == 10_821_245
    fsdp = memory.model_state(vit_b16(**{"parallel.strategy": "fsdp"}), 8)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (4 * local, 4 * local, 8 * local + steps)
    # Activations per image in bf16 (pure): per block (s=197, h=768, m=3072, 12 heads) 2 LayerNorm inputs,
    # qkv/proj/MLP inputs, q, k, v, the attention output (2 bytes each, in units of s x h), two MLP-wide
    # tensors (GELU in and out), fp32 LayerNorm statistics and log-sum-exp; then stem input, final norm, head.
    s, h, m = 197, 768, 3072
    block = (2 + 3 + 3 + 1) * s * h * 2 + 2 * s * m * 2 + 2 * 2 * s * 4 + 12 * s * 4
    # The head reads the class token's row, a view of the final norm's output: autograd keeps all of it.
    extra = 3 * 224 * 224 * 2 + (s * h * 2 + 2 * s * 4) + (s * h * 2 + 1000 * 4 * 2)
    parts = memory.activation_bytes_per_image(vit_b16(**{"precision.mode": "pure"}))
    assert sum(parts.values()) == 12 * block + extra == 62_795_880


def test_model_state_equals_the_built_strategies_at_world_size_1():
    from rayvit.worker import train

    for strategy, mode in COMBOS:
        cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"precision.mode={mode}", "train.steps=2",
                                    "train.warmup_steps=1", "train.batch_size=4", reduce_dtype(strategy, mode)])
        result = train(cfg)
        measured = result.metrics["model_state_bytes_per_rank"]
        assert memory.model_state(cfg, 1).total == measured, (strategy, mode)
        # Every run states its device's memory (what picks an A100 40 or 80 GB profile): none on CPU.
        assert "device_memory_bytes" in result.conditions and result.conditions["device_memory_bytes"] is None


def test_fsdp_model_state_is_counted_after_the_step_not_after_an_evaluation():
    """Under reshard_after_forward=false an evaluation's forward (no backward) leaves FSDP2's parameters
    gathered, without their gradients: the state a run reports is what the step held, with and without a
    validation split (digits has one), under either setting."""
    from rayvit.worker import train

    seen = {}
    for reshard in (True, False):
        for data in ("digits", "synthetic"):
            cfg = load_config(DEFAULT, ["parallel.strategy=fsdp", f"parallel.reshard_after_forward={reshard}",
                                        f"data.name={data}", "train.steps=2", "train.warmup_steps=1",
                                        "train.batch_size=4"])
            seen[(reshard, data)] = train(cfg).metrics["model_state_bytes_per_rank"]
    assert set(seen.values()) == {memory.model_state(cfg, 1).total}, seen


def test_step_time_by_hand_on_a_two_chip_cpu_profile():
    cfg = load_config(DEFAULT)
    link = Link(busbw=1e9, latency_s=1e-3)
    profile = cpu_profile().replace(intra=link, inter=link, memory_bw=10e9, per_tensor_s={"foreach": 0.0},
                                    shared_host_slowdown=1.25)
    rate = ComputeRate(seconds_per_image=1e-3, source="given")
    p = project(cfg, 2, profile, rate, peak=1e12)
    params = vit_complexity(cfg.model).params
    compute = 16 * 1e-3 * 1.25                         # batch 16, both workers of the host busy
    comm = 1e-3 + 2 * (1 / 2) * 4 * params / 1e9          # one bucket: the whole model is under 1 MiB
    optim = params * (6 * 4 + 4) / 10e9                   # AdamW: 6 state accesses + the gradient read
    assert (p.compute_s, p.exposed_comm_s, p.optimizer_s) == pytest.approx((compute, comm, optim))
    assert p.step_s == pytest.approx(compute + comm + optim)
    assert p.images_per_sec_per_chip == pytest.approx(16 / p.step_s)
    assert p.tflops_per_chip == pytest.approx(vit_complexity(cfg.model).train_flops_per_image * 16 / p.step_s / 1e12)
    assert p.dominant == "compute"
    # With perfect overlap only the last bucket remains exposed: here the only bucket.
    assert project(cfg, 2, profile.replace(overlap=1.0), rate).exposed_comm_s == pytest.approx(comm)


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


# Every name rayvit.training.hardware.accelerator_for_name returns (the PEAK_TFLOPS keys), reached from
# the CUDA device names the chips report, with their memory as CUDA gives it (bytes).
DEVICES = [("Tesla V100-SXM2-16GB", 16.9e9, "V100", "v100-16gb"), ("Tesla V100-SXM2-32GB", 34.1e9, "V100", "v100-32gb"),
           ("NVIDIA A100-SXM4-40GB", 42.3e9, "A100", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", 85.1e9, "A100", "a100-80gb"),
           ("NVIDIA A100 80GB PCIe", 85.1e9, "A100", "a100-80gb"), ("NVIDIA H100 80GB HBM3", 85.0e9, "H100", "h100-sxm"),
           ("NVIDIA H100 PCIe", 85.0e9, "H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", 99.9e9, "H100 NVL", "h100-nvl"),
           ("NVIDIA H200", 150.1e9, "H200", "h200"), ("NVIDIA H200 NVL", 150.1e9, "H200 NVL", "h200-nvl"),
           ("NVIDIA GH200 480GB", 102.0e9, "GH200", "gh200"), ("NVIDIA GH200 144G HBM3e", 153.0e9, "GH200", "gh200-144gb")]


@pytest.mark.parametrize("device_name, memory_bytes, accelerator, profile_name", DEVICES)
def test_every_known_gpu_variant_has_a_profile_of_its_own(device_name, memory_bytes, accelerator, profile_name):
    import warnings

    from rayvit.projection.profiles import profile_for_accelerator
    from rayvit.training.hardware import PEAK_TFLOPS, accelerator_for_name

    assert accelerator_for_name(device_name) == accelerator
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # a known chip is never "unknown"
        profile = profile_for_accelerator(accelerator, memory_bytes)
    assert profile.name == profile_name and profile.accelerator == accelerator
    assert profile.peak_flops("bf16") == PEAK_TFLOPS[accelerator]["bf16"] * 1e12
    assert profile.memory_gib == pytest.approx(memory_bytes / 2 ** 30, rel=0.05)   # the device's size
    # Eight GPUs per node, but a GH200 superchip is a node of its own.
    assert profile.overlap == 0.9 and profile.chips_per_node == (1 if accelerator == "GH200" else 8)
    assert profile.reserved_gib > 0
    # Without a memory size, a chip sold in several sizes falls back to its smallest variant, and says so.
    if accelerator in ("A100", "V100", "GH200"):
        from rayvit.projection.profiles import UnknownMemoryWarning

        with pytest.warns(UnknownMemoryWarning, match="device_memory_bytes"):
            assert profile_for_accelerator(accelerator).accelerator == accelerator
    else:
        assert profile_for_accelerator(accelerator).accelerator == accelerator


def test_every_accelerator_name_is_covered_and_variants_differ():
    from rayvit.projection.profiles import PROFILES, profile_for_accelerator
    from rayvit.training.hardware import PEAK_TFLOPS

    assert {d[2] for d in DEVICES} == set(PEAK_TFLOPS)
    # Every profile but the fabric variants, which a user names (dgx-a100: an A100 80GB on HDR InfiniBand).
    assert {d[3] for d in DEVICES} == set(PROFILES) - {"dgx-a100"}
    assert profile_for_accelerator("A100", 42.3e9).name == "a100-40gb"
    assert profile_for_accelerator("A100", 85.1e9).memory_bw > profile_for_accelerator("A100", 42.3e9).memory_bw
    sxm, pcie, nvl = (get_profile(n) for n in ("h100-sxm", "h100-pcie", "h100-nvl"))
    assert sxm.link("all_reduce", 8).busbw > nvl.link("all_reduce", 8).busbw == pcie.link("all_reduce", 8).busbw
    # The NVL cards' NVLink bridges carry collectives within a bridged pair (H100 NVL) or four (H200 NVL).
    assert nvl.link("all_gather", 2).busbw == 225e9 and nvl.link("all_gather", 4).busbw == 48e9
    assert get_profile("h200-nvl").link("all_gather", 4).busbw == 337.5e9
    assert profile_for_accelerator("cpu").name == profile_for_accelerator(None).name == "cpu"


def test_a_gh200_is_never_read_as_an_h200():
    """'NVIDIA GH200 480GB' contains 'H200': names are compared word by word, so it gets its own entry."""
    from rayvit.accelerators import accelerator_for_name
    from rayvit.projection.profiles import profile_for_accelerator

    assert accelerator_for_name("NVIDIA GH200 480GB") == "GH200"
    assert accelerator_for_name("NVIDIA H200") == "H200" and accelerator_for_name("NVIDIA H200 NVL") == "H200 NVL"
    assert accelerator_for_name("NVIDIA H100 80GB HBM3") == "H100" and accelerator_for_name("NVIDIA L4") is None
    profile = profile_for_accelerator("GH200", 102.0e9)
    assert profile.name == "gh200" and profile.memory_bw == 4000e9 and profile.memory_gib == 96.0


def test_an_unknown_gpu_gets_a_generic_gpu_profile_with_a_warning_never_the_cpu_one():
    from rayvit.projection.profiles import UnknownAcceleratorWarning, profile_for_accelerator

    with pytest.warns(UnknownAcceleratorWarning, match="'NVIDIA L4'"):
        profile = profile_for_accelerator("NVIDIA L4", 24.0 * 2 ** 30)
    assert profile.name == "gpu" and profile.accelerator == "NVIDIA L4" and profile.memory_gib == 24.0
    assert profile.overlap == 0.9 and profile.peak_flops("bf16") is None and profile.reserved_gib > 0

    # In a sweep: the device's memory and the links the microbenchmark measured.
    cfg = load_config(overrides=["parallel.use_gpu=true", "parallel.num_workers=2"])
    links = {"backend": "nccl", "world_size": 2, "nodes": 1, "device_name": "NVIDIA L4",
             "device_memory_bytes": 23.6 * 2 ** 30, "memory_bw": 250e9,
             "collectives": {"all_reduce": {"latency_s": 3e-5, "busbw": 20e9}}}
    with pytest.warns(UnknownAcceleratorWarning):
        profile = sweep_profile(cfg, [{"accelerator": "NVIDIA L4"}], links)
    assert profile.name == "gpu" and profile.memory_gib == pytest.approx(23.6) and profile.memory_bw == 250e9
    assert profile.link("all_reduce", 2).busbw == 20e9
    # A GPU sweep with nothing known about its chip yet is still projected as a GPU.
    with pytest.warns(UnknownAcceleratorWarning):
        assert sweep_profile(cfg, [], None).overlap == 0.9
    assert sweep_profile(cfg, [{"accelerator": "A100"}], {**links, "device_name": "A100",
                                                           "device_memory_bytes": 85.1e9}).name == "a100-80gb"
    # Without links the points' own conditions say which variant they ran on.
    rows = [{"accelerator": "A100", "device_memory_bytes": 85.1e9}]
    assert sweep_profile(cfg, rows, None).name == "a100-80gb"
    assert sweep_profile(cfg, [{"accelerator": "A100", "device_memory_bytes": 42.3e9}], None).name == "a100-40gb"


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


def test_memory_fit_and_largest_batch():
    cfg = load_config(STUDY, ["parallel.strategy=ddp"])
    a100 = get_profile("a100-40gb")
    fits = memory.memory(cfg, 8, a100)
    assert fits.fits and fits.max_batch >= cfg.train.batch_size
    big = memory.memory(cfg, 8, a100, batch=fits.max_batch + 1)
    assert big.fits is False
    assert memory.memory(cfg, 8, a100, batch=fits.max_batch).fits


def test_cli_projects_the_study_without_ray(tmp_path):
    cmd = [sys.executable, "-m", "rayvit", "project", "--config", str(STUDY),
           "--hardware", "a100-40gb", "h100-sxm", "--chips", "8", "64", "--out-dir", str(tmp_path),
           "--set", "train.batch_size=96"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for column in ("chips", "strategy", "step ms", "img/s/chip", "TFLOPS/chip", "MFU", "vs DDP", "scaling eff.",
                   "dominant", "mem GiB/rank", "fits", "max batch"):
        assert column in text
    for label in ("ddp", "fsdp (no reshard)", "fsdp ", "fairscale_fsdp (no reshard)"):
        assert f"  {label}" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("8 ", "64 "))]
    assert len(rows) == 2 * 2 * 4
    assert any("OOM" in r for r in rows) and any("fits" in r for r in rows)  # DDP at 96/chip: 40 GB is too small
    assert (tmp_path / "projection-vit_h16-a100-40gb.png").stat().st_size > 10_000
    assert (tmp_path / "projection-vit_h16-h100-sxm.png").exists()
    assert "FSDP 1.83x DDP" in text


def test_cli_help_explains_projection():
    done = subprocess.run([sys.executable, "-m", "rayvit", "project", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert "--project" in done.stdout and "--hardware" in done.stdout and "a100-40gb" in done.stdout


@pytest.mark.parametrize("mode", ["fp32", "amp", "mixed", "pure"])
def test_activation_model_against_what_autograd_saves(mode):
    import torch

    from rayvit.measure.activation_memory import saved_bytes_per_image

    batch = 4
    cfg = load_config(DEFAULT, [f"precision.mode={mode}", "model.hidden_dim=128", "model.mlp_dim=512"])
    saved = saved_bytes_per_image(cfg, torch.device("cpu"), batch=batch)
    # This branch keeps LayerNorm in the model dtype under `mixed`; autocast's weight copies are per step.
    modelled = sum(memory.activation_bytes_per_image(cfg, layer_norm_fp32=False).values()) \
        + memory.fixed_activation_bytes(cfg) / batch
    assert modelled == pytest.approx(saved, rel=0.10)


def test_each_strategys_own_overhead_is_measured_at_its_smallest_point_and_carried_to_the_others():
    """FSDP2 at one worker runs slower than DDP with no communication at all (its hooks, DTensor dispatch):
    the sweep's projection measures that from the strategy's own smallest point and adds it elsewhere."""
    from rayvit.projection.insweep import project_outcome, strategy_overheads
    from rayvit.studies.plan import Point
    from rayvit.studies.runner import Outcome

    from shared import make_result

    links = {"backend": "gloo", "world_size": 2, "nodes": 1, "memory_bw": 10e9, "shared_host_slowdown": 1.2,
             "collectives": {k: {"latency_s": 1e-3, "busbw": 0.7e9} for k in
                             ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")}}
    rates = {("ddp", 1): 1100.0, ("fsdp", 1): 850.0, ("ddp", 2): 880.0, ("fsdp", 2): 460.0}
    outcomes = []
    for i, ((strategy, n), rate) in enumerate(rates.items()):
        cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"parallel.num_workers={n}"])
        outcomes.append(Outcome(Point(i + 1, f"{strategy}/w{n}", strategy, n, cfg), "done",
                                make_result(strategy, n, 1.0, rate)))
    ddp1, fsdp1, ddp2, fsdp2 = outcomes
    batch = fsdp1.point.cfg.train.batch_size
    profile = sweep_profile(fsdp1.point.cfg, [o.result.row() for o in outcomes], links)
    overheads = strategy_overheads(outcomes, profile, compute_from_measured(ddp1.point.cfg, 1100.0, profile, "ddp/w1"))
    assert overheads["ddp"][0] is ddp1 and overheads["ddp"][1] == pytest.approx(0, abs=1e-9)
    # At one worker FSDP and DDP step the same elements and send nothing: the difference is FSDP's own.
    assert overheads["fsdp"][0] is fsdp1
    assert overheads["fsdp"][1] == pytest.approx(batch / 850 - batch / 1100)
    anchor = project_outcome(fsdp1, outcomes, links)
    assert anchor.images_per_sec_per_chip == pytest.approx(850) and anchor.notes[0].startswith("anchor point")
    two = project_outcome(fsdp2, outcomes, links)
    assert two.overhead_s == pytest.approx(batch / 850 - batch / 1100) and not two.notes
    assert two.step_s == pytest.approx(two.compute_s + two.exposed_comm_s + two.optimizer_s + two.overhead_s)
    assert two.metrics()["projected_overhead_s"] == two.overhead_s
    assert project_outcome(ddp2, outcomes, links).overhead_s == pytest.approx(0, abs=1e-9)
