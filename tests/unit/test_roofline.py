"""The projection's physics: GEMMs against a published matmul table, chips against each other, attention
kernels, NCCL's latency terms, the wait for the slowest of N chips, and FSDP2's padding rule at large N (at
2 real gloo ranks: tests/system/test_projection_at_two_ranks.py)."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest

from rayvit.config import load_config, load_study
from rayvit.projection import comms, nccl, roofline
from rayvit.strategies.costs import chunk_rows
from rayvit.projection.performance import (contention_s, expected_max, exposed_communication, message_time,
                                          project, project_grid)
from rayvit.projection.profiles import cpu_profile, get_profile
from rayvit.strategies.shapes import vit_tensors


ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "experiments/configs/study_a100.yaml"
DEFAULT = ROOT / "experiments/configs/cpu_default.yaml"


def tflops(chip, b, m, n, k) -> float:
    return 2.0 * b * m * n * k / roofline.gemm_seconds(chip, m, n, k, batch=b) / 1e12


def test_gemm_shapes_against_xlas_measured_h100_table():
    """XLA's measured sm_90 bf16 matmul table (xla/service/gpu/model/matmul_interpolator_data.h), burst
    clocks: the model at sustained clocks runs each shape at a similar fraction of its measured rate
    (0.85 = the sustained/burst ratio), within 25%: the shape dependence (short K, few tiles) is the
    table's."""
    h100 = roofline.chip_for(get_profile("h100-sxm"), "bf16")
    table = [((1, 4096, 4096, 4096), 783), ((4, 4096, 1024, 1024), 674), ((4, 4096, 4096, 512), 620),
             ((1, 4096, 4096, 256), 392), ((1, 2048, 2048, 2048), 632), ((2, 2048, 4096, 1024), 679),
             ((1, 4096, 512, 512), 239), ((1, 1024, 2048, 2048), 524), ((1, 4096, 1024, 512), 344)]
    for shape, measured in table:
        assert tflops(h100, *shape) / (0.849 * measured) == pytest.approx(1.0, abs=0.25), shape


def test_tile_and_wave_quantisation_and_the_memory_floor():
    a100 = roofline.chip_for(get_profile("a100-80gb"), "bf16")
    big = tflops(a100, 1, 8192, 8192, 8192)
    assert 0.7 < big / 312 < 0.81                                  # MAMF x sustained clock, at best
    # One row past a tile: a whole extra row of tiles, and here (the last wave was full) an extra wave.
    assert roofline.gemm_seconds(a100, 2049, 4096, 4096) > 1.1 * roofline.gemm_seconds(a100, 2048, 4096, 4096)
    # Short K reaches less of the peak than long K at the same output.
    assert tflops(a100, 1, 4096, 4096, 256) < 0.8 * tflops(a100, 1, 4096, 4096, 4096)
    # A GEMM that streams more bytes than it computes runs at memory speed.
    thin = roofline.gemm_seconds(a100, 65536, 8, 8)
    assert thin >= (65536 * 8 * 2 + 64 * 2 + 65536 * 8 * 2) / a100.memory_bw
    # Misaligned contiguous dimensions (not multiples of 16 bytes) run a slower kernel ...
    assert roofline.gemm_seconds(a100, 4096, 4096, 4095) > 1.5 * roofline.gemm_seconds(a100, 4096, 4096, 4096)
    assert roofline.gemm_seconds(a100, 4096, 4095, 4096) > 1.5 * roofline.gemm_seconds(a100, 4096, 4096, 4096)
    # ... the strided one (rows of a row-major A) is not among cuBLAS's conditions: only its tiles count.
    assert roofline.gemm_seconds(a100, 4095, 4096, 4096) == roofline.gemm_seconds(a100, 4096, 4096, 4096)
    # A weight gradient reads both operands along their features: its reduced K (the tokens) is free.
    assert roofline.gemm_seconds(a100, 4096, 4096, 4095, contiguous=(4096, 4096)) < \
        1.01 * roofline.gemm_seconds(a100, 4096, 4096, 4096, contiguous=(4096, 4096))


@pytest.mark.parametrize("name", ["vit_b16", "vit_h14"])
def test_one_more_image_per_chip_never_costs_an_alignment_penalty(name):
    """Batch 32 against 33 (197 or 257 tokens per image: 6,304 against 6,501 or 8,224 against 8,481 token
    rows): the per-image rate moves by tile and wave quantisation only, within 3%."""
    rates = {}
    for b in (32, 33):
        cfg = load_config(None, {"model.name": name, "model.image_size": 224, "model.classifier": "token",
                                 "parallel.use_gpu": True, "precision.mode": "amp", "precision.dtype": "fp16",
                                 "train.batch_size": b})
        rates[b] = project(cfg, 1, get_profile("a100-40gb")).images_per_sec_per_chip
    assert rates[33] / rates[32] == pytest.approx(1.0, abs=0.03), rates


def test_h100_over_a100_is_less_than_the_ratio_of_peaks():
    """Matmuls scale with the tensor-core peak (3.2x) but memory-bound work with bandwidth (1.6x) and the
    H100's sustained clock sits lower under its power limit: a ViT step gains ~2.1-2.5x."""
    cfg = load_config(STUDY, ["precision.dtype=bf16"])
    a100, h100 = get_profile("a100-80gb"), get_profile("h100-sxm")
    ratio = project(cfg, 1, h100).images_per_sec_per_chip / project(cfg, 1, a100).images_per_sec_per_chip
    assert 2.0 < ratio < 2.6
    ct_a = roofline.step_compute(cfg, roofline.chip_for(a100, "bf16"), 32)
    ct_h = roofline.step_compute(cfg, roofline.chip_for(h100, "bf16"), 32)
    assert ct_h.total("memory") / ct_h.seconds > ct_a.total("memory") / ct_a.seconds
    assert 0.35 < project(cfg, 8, a100).mfu < 0.6 and 0.25 < project(cfg, 8, h100).mfu < 0.45


def test_attention_kernel_follows_chip_dtype_and_model_option():
    cfg = load_config(STUDY, ["precision.dtype=bf16"])
    a100 = roofline.chip_for(get_profile("a100-80gb"), "bf16")
    assert roofline.attention_kernel(cfg, a100) == "flash"
    assert roofline.attention_kernel(cfg, roofline.chip_for(get_profile("v100-32gb"), "fp16")) == "efficient"
    assert roofline.attention_kernel(cfg, roofline.chip_for(get_profile("a100-80gb"), "fp32")) == "efficient"
    math_cfg = cfg.replace({"model.attention": "math"})
    assert roofline.attention_kernel(math_cfg, a100) == "math"
    # The explicit path moves the heads x S x S matrix through memory: slower, and it is kept for backward.
    assert project(math_cfg, 8, get_profile("a100-80gb")).step_s > project(cfg, 8, get_profile("a100-80gb")).step_s
    v100 = roofline.step_compute(load_config(STUDY, ["precision.dtype=bf16"]),
                                 roofline.chip_for(get_profile("v100-32gb"), "bf16"), 8)
    assert any("no bf16 tensor cores" in n for n in v100.notes)


def test_math_attention_keeps_the_matrix_the_model_says(tmp_path):
    """model.attention=math on CPU: autograd keeps the fp32 softmax output and its half copy."""
    import torch

    from rayvit.projection import memory
    from rayvit.measure.activation_memory import saved_bytes_per_image

    for mode in ("fp32", "pure"):
        cfg = load_config(DEFAULT, ["model.attention=math", f"precision.mode={mode}"])
        saved = saved_bytes_per_image(cfg, torch.device("cpu"), batch=4)
        modelled = sum(memory.activation_bytes_per_image(cfg, layer_norm_fp32=False).values())
        assert modelled == pytest.approx(saved, rel=0.1)


def test_nccl_latency_grows_with_ranks_and_the_cheaper_algorithm_wins():
    small, large, bw = 64 * 2 ** 10, 4 * 2 ** 30, 200e9
    t8, _ = nccl.collective_seconds("all_reduce", small, 8, 1, "nvlink", bw)
    t128, algo = nccl.collective_seconds("all_reduce", small, 128, 16, "nvlink", bw)
    assert t128 > 3 * t8 and algo.startswith("tree")                 # trees' log2(nodes) hops at scale
    _, algo = nccl.collective_seconds("all_reduce", large, 128, 16, "nvlink", bw)
    assert algo == "ring/simple"                                     # bandwidth-bound: the ring
    ring = nccl.ring_seconds("all_gather", large, 64, 8, "nvlink", bw, "simple")
    assert ring == pytest.approx((8.4 + (63 - 7) * 3.4 + 7 * 9.6) * 1e-6 + 63 / 64 * large / bw)
    assert nccl.collective_seconds("all_reduce", large, 1, 1, "nvlink", bw) == (0.0, "none")


def test_expected_maximum_of_n_normal_draws():
    assert expected_max(1) == 0.0
    assert expected_max(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    rng = random.Random(0)
    for n in (8, 128):
        sampled = sum(max(rng.gauss(0, 1) for _ in range(n)) for _ in range(4000)) / 4000
        assert expected_max(n) == pytest.approx(sampled, abs=0.03)
    assert expected_max(8) == pytest.approx(1.4236, abs=1e-3) and expected_max(128) == pytest.approx(2.5946, abs=1e-3)


def test_scaling_loses_what_the_slowest_chip_and_the_network_cost():
    """With compute-bound DDP on H100 InfiniBand, 8 -> 128 chips loses the slowest chip's lag (the speed
    spread x the growth of E[max of N]) and little more."""
    cfg = load_config(STUDY, ["precision.dtype=bf16"])
    h100 = get_profile("h100-sxm")
    points = project_grid(cfg, [8, 128], [cfg], h100)
    eff = points[-1].scaling_efficiency
    lag = h100.speed_cv * (expected_max(128) - expected_max(8))
    assert 1 - eff == pytest.approx(lag, abs=0.03) and eff < 1 - 0.8 * lag
    assert points[-1].straggler_s > points[0].straggler_s > 0


def test_collectives_hidden_behind_compute_still_slow_it_and_more_so_at_scale():
    """A collective that hides behind backward still costs: the compute beside it runs
    ``overlap_slowdown`` slower, so hidden seconds cost s / (1 + s) of themselves. At 8 -> 128 H100s the
    all-reduce takes longer (more hops, more nodes), and so does what it costs the compute beside it;
    on CPUs nothing overlaps and nothing is charged."""
    cfg = load_config(STUDY, ["precision.dtype=bf16"])
    h100 = get_profile("h100-sxm")
    s = h100.overlap_slowdown
    assert s == pytest.approx(0.189) and contention_s(1.0, h100) == pytest.approx(s / (1 + s))
    for n in (8, 128):
        msgs = comms.step_messages(cfg, n)
        backward = [message_time(m, n, h100) for m in msgs if m.phase == "backward"]
        hidden = sum(backward[:-1])                    # the last reduction waits for all, the rest hides
        roomy = 100 * sum(backward)                    # backward compute long enough to hide them all
        total, exposed = exposed_communication(msgs, n, h100, 0.0, roomy)
        assert total == pytest.approx(sum(message_time(m, n, h100) for m in msgs))
        assert exposed == pytest.approx(backward[-1] + hidden * s / (1 + s))
    points = project_grid(cfg, [8, 128], [cfg], h100)
    without = project_grid(cfg, [8, 128], [cfg], dataclasses.replace(h100, overlap_slowdown=0.0))
    extra = [a.step_s - b.step_s for a, b in zip(points, without)]
    assert 0 < extra[0] < extra[1]
    assert points[-1].scaling_efficiency < without[-1].scaling_efficiency
    assert cpu_profile().overlap_slowdown == 0.0 and cpu_profile().overlap == 0.0


def _published_benchmark():
    import importlib.util
    spec = importlib.util.spec_from_file_location("published_vs_projected",
                                                  ROOT / "benchmarks/published_vs_projected.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bert_rows_carry_bert_heads_at_bert_shapes():
    """BERT's pre-training heads (a dense transform and the 30,528-word decoder over every token, then the
    loss over every token's logits) are costed by the same roofline: their GEMMs carry exactly BERT's
    FLOPs, the logits' passes their bytes, and they take a larger share of a phase-1 step (128 tokens,
    little attention) than of a phase-2 one."""
    bench = _published_benchmark()
    chip = roofline.chip_for(get_profile("a100-40gb"), "fp16")
    tokens, h, v = 64 * 144, 1024, bench.BERT_VOCAB
    ops = bench.bert_heads(chip, tokens, h, 2)
    decoder = [o for o in ops if o.name.startswith("mlm decoder")]
    assert len(decoder) == 3 and sum(o.flops for o in decoder) == pytest.approx(3 * 2 * tokens * h * v)
    logits = [o for o in ops if o.name.startswith("mlm logits")]
    assert sum(o.bytes for o in logits) == pytest.approx(9 * 2 * tokens * v)
    share = {}
    for m in bench.MEASUREMENTS:
        if m.heads is None:
            continue
        run = load_study(None, {**m.overrides, "sweep.strategies": ["ddp"]}, baseline_required=False).run
        with_heads = bench.with_heads(run, get_profile(m.hardware), m.heads)
        plain = roofline.step_compute(run, chip, run.train.batch_size)
        share[m.tokens[0]] = 1 - plain.seconds / (with_heads.seconds_per_image * run.train.batch_size)
    assert set(share) == {128, 512} and share[128] > share[512] > 0.03


def test_published_measurements_within_fifteen_percent_per_chip():
    """Every published table (NeMo ViT-g/14 on DGX A100 and H100 at 8-128 GPUs, BERT-Large phases 1
    and 2 on A100 40GB at 1-8) projects within 15% per chip with the same model and profiles, and within
    4 points of scaling efficiency (docs/projection.md discusses the rows near 3)."""
    bench = _published_benchmark()
    rows = [r for m in bench.MEASUREMENTS for r in bench.compare(m)]
    assert len({r["measurement"] for r in rows}) >= 3
    assert {r["hardware"] for r in rows} >= {"dgx-a100", "h100-sxm", "a100-40gb"}
    worst = max(rows, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) < 0.15, worst
    assert max(abs(r["scaling_points"]) for r in rows) < 4.0


def test_fsdp2_padding_follows_its_chunking_rule_at_large_n():
    """FSDP2 pads each parameter's dim 0 to N chunks of ceil(d0/N) rows (_fsdp_param.py: ``chunks[0]``'s
    size). The gathered bytes the projection sends per FSDP unit are exactly that, at 8 to 512 chips; the
    position embedding no longer multiplies by N (it was (1, S, d): N x S x d at N chips)."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    cfg = load_config(None, ["model.name=vit_h14", "model.image_size=448", "parallel.strategy=fsdp",
                             "parallel.reshard_after_forward=false"])
    tensors = vit_tensors(cfg.model)
    for n in (8, 64, 512):
        root = [t for t in tensors if t.unit == "root"]
        padded = sum(_chunk_with_empty(torch.empty(t.shape, device="meta"), n, 0)[0].numel() * n for t in root)
        gathers = [m for m in comms.step_messages(cfg, n) if m.kind == "all_gather" and m.what.startswith("root")]
        assert gathers[0].bytes == 4 * padded
        pos = next(t for t in tensors if t.name == "pos_embed")
        assert chunk_rows(pos.shape[0], n, 0) * n < pos.shape[0] + n
    assert gathers[0].bytes < 0.02e9                                 # was 2.7 GB at 512 chips



def test_the_gpu_links_benchmark_times_small_messages_too():
    """An fp32 LayerNorm group is ~20 KB: the GPU sizes include 16-64 KiB, so such messages take their
    latency from a measurement, not from an extrapolation of megabyte messages."""
    from rayvit.measure.links import fit_link
    from rayvit.measure.timers import GPU_SIZES

    assert min(GPU_SIZES) <= 64 * 2 ** 10 and any(16 * 2 ** 10 <= s <= 64 * 2 ** 10 for s in GPU_SIZES)
    latency, busbw = 12e-6, 200e9
    points = [[b, latency + comms.bus_factor("all_reduce", 8) * b / busbw] for b in GPU_SIZES]
    fit = fit_link(points, "all_reduce", 8)
    assert fit["latency_s"] == pytest.approx(latency, rel=1e-3) and fit["busbw"] == pytest.approx(busbw, rel=1e-3)
