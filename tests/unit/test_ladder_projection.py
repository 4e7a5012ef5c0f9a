"""``rayvit project`` with ``sweep.mode=ladder``: the study's rungs projected at 8 and 64 A100s, each against
the baseline, the published figures beside them, what moved in the model's terms; O1's weight casts."""

from __future__ import annotations

import json

import pytest

from rayvit.cli import main
from rayvit.config import load_config
from rayvit.projection import roofline
from rayvit.projection.profiles import get_profile
from rayvit.strategies.shapes import vit_tensors

LADDER = ["--config", "study_a100", "--set", "sweep.mode=ladder", "--set", "precision.mode=amp"]
RUNGS = ["baseline", "mixed_precision", "fsdp", "mta_optimizer", "pooled_classifier", "batch_second", "image_256",
         "full_half", "compile", "activation_checkpointing"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def rows():
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["project", *LADDER, "--chips", "8", "64", "--json"]) == 0
    return [json.loads(line) for line in printed.getvalue().splitlines()]


def test_every_rung_at_8_and_64_a100s_with_its_ratio_to_the_baseline(rows):
    assert [(r["chips"], r["rung"]) for r in rows] == [(n, rung) for n in (8, 64) for rung in RUNGS]
    for n in (8, 64):
        mine = [r for r in rows if r["chips"] == n]
        base = mine[0]
        assert base["strategy"] == "ddp" and base["precision"] == "amp-fp16" and base["optim_impl"] == "loop"
        assert base["ratio_to_baseline"] == 1.0 and base["moved"] is None
        for r in mine[1:]:
            assert r["ratio_to_baseline"] == pytest.approx(r["tflops_per_chip"] / base["tflops_per_chip"])
            assert r["moved"] and r["hardware"] == "a100-40gb"
    by = {(r["chips"], r["rung"]): r for r in rows}
    # The rungs' own changes, cumulative: FSDP's shards from the fsdp rung on, 256 px and pure half after.
    assert by[(8, "fsdp")]["strategy"].startswith("fsdp") and by[(8, "image_256")]["image_size"] == 256
    assert by[(8, "full_half")]["precision"] == "pure-fp16" and by[(8, "pooled_classifier")]["classifier"] == "pooled"


def test_each_rung_moves_the_term_it_is_about(rows):
    by = {(r["chips"], r["rung"]): r for r in rows}
    # Multi-tensor apply: the optimizer's per-tensor launches.
    assert by[(8, "mta_optimizer")]["optimizer_s_per_image"] < 0.5 * by[(8, "fsdp")]["optimizer_s_per_image"]
    # O2: half residuals and no weight casts, less memory-bound time than O1.
    assert by[(8, "mixed_precision")]["memory-bound_compute_s_per_image"] < \
        by[(8, "baseline")]["memory-bound_compute_s_per_image"]
    # FSDP at 64 chips: the exposed all-reduce across nodes is gone.
    assert by[(64, "fsdp")]["communication_s_per_image"] < 0.3 * by[(64, "mixed_precision")]["communication_s_per_image"]
    assert "communication" in by[(64, "fsdp")]["moved"]
    # Activation checkpointing costs its second forward.
    assert by[(8, "activation_checkpointing")]["ratio_to_baseline"] < by[(8, "compile")]["ratio_to_baseline"]
    assert "recompute" in by[(8, "activation_checkpointing")]["moved"]
    # Scaling: DDP loses more from 8 to 64 chips than the sharded stack, so the stack's ratio grows.
    assert by[(64, "batch_second")]["ratio_to_baseline"] > by[(8, "batch_second")]["ratio_to_baseline"]


def test_the_published_figures_sit_beside_their_rungs(rows, capsys):
    by = {(r["chips"], r["rung"]): r for r in rows}
    assert by[(8, "batch_second")]["published_ratio"] == 1.51 and by[(64, "batch_second")]["published_ratio"] == 1.83
    assert by[(8, "image_256")]["published_ratio"] == 1.86 and by[(8, "full_half")]["published_ratio"] == 2.18
    assert by[(8, "fsdp")]["published_ratio"] is None
    assert main(["project", *LADDER, "--chips", "8", "64"]) == 0
    out = capsys.readouterr().out
    assert "published (ViT-H/16 on A100s, against DDP + AMP O1)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("batch_second at 8 chips: projected"))
    assert "published 1.51x" in line and "the gain is" in line and "per image" in line
    assert "ImageNet-1K epoch at 8 chips: baseline" in out and "0.65 h and 0.43 h" in out


def test_a_ladder_needs_the_studys_o1_or_fp32_baseline(capsys):
    assert main(["project", "--config", "study_a100", "--set", "sweep.mode=ladder", "--chips", "8"]) == 2
    assert "the ladder's baseline runs in precision.mode fp32 or amp" in capsys.readouterr().err


def test_o1_casts_every_matmul_weight_each_way_and_o2_does_not():
    a100 = roofline.chip_for(get_profile("a100-40gb"), "fp16")
    amp = load_config("study_a100", {"precision.mode": "amp"})
    casts = [o for o in roofline.step_compute(amp, a100, 32).ops if "cast" in o.name and "weight" in o.name]
    weights = sum(t.numel for t in vit_tensors(amp.model) if not t.norm and len(t.shape) > 1)
    assert [o.phase for o in casts] == ["forward", "backward"] and all(o.bytes == 6 * weights for o in casts)
    mixed = roofline.step_compute(load_config("study_a100"), a100, 32)
    assert not [o for o in mixed.ops if "weight" in o.name and "cast" in o.name]
