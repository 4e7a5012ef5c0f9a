"""``rayvit project``: what it refuses (and says why), what it states, where its files go, ``--json``."""

from __future__ import annotations

import json

import pytest

from rayvit.cli import main
from rayvit.projection.profiles import PROFILES

STUDY = ["--config", "study_a100"]
KEYS = {"hardware", "chips", "strategy", "images_per_sec_per_chip", "tflops_per_chip", "mfu", "scaling_efficiency",
        "memory_bytes_per_rank", "fits", "max_batch"}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def project(capsys, *args) -> tuple[int, str, str]:
    code = main(["project", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("chips", [["-8"], ["0"], ["8", "-1"]])
def test_chip_counts_below_one_are_refused(capsys, chips):
    code, out, err = project(capsys, *STUDY, "--chips", *chips)
    assert code == 2 and "--chips" in err and "1 or more" in err and out == ""


def test_a_missing_measured_file_is_named(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "result.json"
    code, _, err = project(capsys, *STUDY, "--measured", str(missing))
    assert code == 2 and str(missing) in err and "no such file" in err and "Traceback" not in err


def test_strategies_without_ddp_are_projected_against_the_ddp_it_adds(capsys):
    code, out, _ = project(capsys, *STUDY, "--hardware", "h100-sxm", "--chips", "8", "--set", "sweep.strategies=fsdp")
    rows = [line.split() for line in out.splitlines() if line.startswith("8 ")]
    assert code == 0 and [r[1] for r in rows] == ["ddp", "fsdp", "fsdp"]


def test_help_lists_every_hardware_profile(capsys):
    with pytest.raises(SystemExit):
        main(["project", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in [*PROFILES, "cpu"]:
        assert name in text


def test_v100_with_bf16_is_warned_about(capsys):
    _, out, _ = project(capsys, *STUDY, "--hardware", "v100-32gb", "--chips", "8", "--set", "precision.dtype=bf16")
    assert "V100 has no bf16 tensor cores" in out and "15.7 TFLOPS" in out and "precision.dtype=fp16" in out
    _, out, _ = project(capsys, *STUDY, "--hardware", "v100-32gb", "--chips", "8")
    assert "no bf16 tensor cores" not in out


def test_scaling_efficiency_states_its_reference_and_vs_ddp_is_blank_where_ddp_does_not_fit(capsys):
    # Batch 100 on an A100 40 GB: DDP's replicated state does not leave room; FSDP's does.
    code, out, _ = project(capsys, *STUDY, "--hardware", "a100-40gb", "--chips", "8", "16",
                           "--set", "train.batch_size=100")
    assert code == 0 and "scaling eff. = per-chip img/s / the same strategy's at 8 chip(s)" in out
    rows = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if r and r[0] in ("8", "16")}
    assert "OOM" in rows[("8", "ddp")] and "fits" in rows[("8", "fsdp")]
    assert rows[("8", "fsdp")][6] == "-" and "DDP does not fit at that count" in out
    # ... and a row that does not fit says what would make it fit.
    assert "ddp at 8 chips does not fit" in out and "parallel.strategy=fsdp" in out


def test_above_100_percent_scaling_is_explained():
    from rayvit.config import load_config
    from rayvit.projection.project_output import footnotes
    from rayvit.projection.performance import project_grid
    from rayvit.projection.profiles import get_profile

    cfg = load_config("rayvit/configs/study_a100.yaml")
    points = project_grid(cfg, [8, 16], [cfg], get_profile("h100-sxm"))
    assert not any("above 100%" in line for line in footnotes(points, [8, 16]))
    points[-1].scaling_efficiency = 1.02
    assert any("above 100%" in line and "shrink" in line for line in footnotes(points, [8, 16]))


def test_nvl_profiles_show_their_bridge_and_the_study_line_needs_the_studys_setting(capsys):
    _, out, _ = project(capsys, *STUDY, "--hardware", "h100-nvl", "--chips", "8")
    assert "intra-node busbw 48 GB/s" in out and "within 2 chips busbw 225 GB/s" in out
    assert "Published (ViT-H/16 on A100s" not in out                 # vit_h16, but not on A100
    _, out, _ = project(capsys, *STUDY, "--hardware", "a100-80gb", "--chips", "8")
    assert "Published (ViT-H/16 on A100s" in out
    _, out, _ = project(capsys, *STUDY, "--hardware", "a100-80gb", "--chips", "8", "--set", "model.name=vit_l16")
    assert "Published (ViT-H/16 on A100s" not in out


def test_files_go_under_rayvit_home_and_never_over_an_earlier_projection(capsys, home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    custom = ["--set", "model.name=custom", "--set", "model.hidden_dim=256", "--set", "model.depth=4",
              "--set", "model.num_heads=4", "--set", "model.mlp_dim=512", "--set", "model.patch_size=16"]
    for _ in range(2):
        assert project(capsys, *STUDY, "--hardware", "h100-sxm", "--chips", "8", *custom)[0] == 0
    files = sorted(p.name for p in (home / "projections").iterdir())
    assert files == ["projection-custom-d256x4h4p16-h100-sxm-2.png", "projection-custom-d256x4h4p16-h100-sxm.png"]
    assert not (tmp_path / "results").exists()
    out_dir = tmp_path / "mine"
    assert project(capsys, *STUDY, "--hardware", "h100-sxm", "--chips", "8", "--out-dir", str(out_dir))[0] == 0
    assert [p.name for p in out_dir.iterdir()] == ["projection-vit_h16-h100-sxm.png"]


def test_json_prints_one_record_per_row(capsys, home):
    code, out, _ = project(capsys, *STUDY, "--hardware", "h100-sxm", "a100-80gb", "--chips", "8", "16", "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(records) == 2 * 2 * 4 and all(KEYS <= set(r) for r in records)
    assert {r["hardware"] for r in records} == {"h100-sxm", "a100-80gb"}
    for r in records:
        assert r["images_per_sec_per_chip"] > 0 and 0 < r["mfu"] < 1 and isinstance(r["fits"], bool)
        if r["chips"] == 8:
            assert r["scaling_efficiency"] == 1.0
    assert not (home / "projections").exists()          # --json writes no figure unless --out-dir is given
