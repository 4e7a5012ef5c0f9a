"""rayvit.projection: hand-worked arithmetic, exact model-state bytes against the real strategies, the CLI.
The links it prices collectives with: test_projection_links.py; the GPU profiles: test_projection_gpu_profiles.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayvit.models import vit_complexity
from rayvit.config import load_config
from rayvit.projection import comms, memory
from rayvit.projection.insweep import sweep_profile
from rayvit.projection.performance import ComputeRate, compute_from_measured, project
from rayvit.projection.hardware_profile import Link
from rayvit.projection.profiles import cpu_profile, get_profile
from rayvit.strategies.shapes import vit_tensors

from helpers_projection import COMBOS, reduce_dtype, vit_b16

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

    from helpers_results import make_result

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
