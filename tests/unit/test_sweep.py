"""Sweep planning, the CLI's early errors, and real sweeps through the CLI into a real MLflow store.

The end-to-end tests run ``experiments/scaling.py`` as a subprocess (a local Ray instance each run, as a
user would) with few steps, then read the sqlite store the runs went to.
"""

from __future__ import annotations

import re
import socket
import sys
import time

import pytest

from rayvit.config import load_study
from rayvit.errors import ConfigError
from rayvit.studies.plan import plan

from helpers_cli import cli_env, CONFIGS, SCRIPT



# -- planning ----------------------------------------------------------------------------------------

def test_scaling_plan_covers_every_strategy_at_every_count_ddp_first():
    cfg = load_study(CONFIGS / "cpu_default.yaml", ["sweep.strategies=fsdp,ddp", "sweep.worker_counts=2,1"])
    points = plan(cfg)
    assert [p.key for p in points] == ["ddp/w1", "fsdp/w1", "ddp/w2", "fsdp/w2"]
    for p in points:
        assert (p.cfg.parallel.strategy, p.cfg.parallel.num_workers) == (p.series, p.world_size)
        # Everything but strategy and workers is the sweep's: same model, batch, data and precision.
        assert p.cfg.model == cfg.run.model and p.cfg.train == cfg.run.train and p.cfg.precision == cfg.run.precision


def test_study_config_plans_8_to_64_gpus():
    points = plan(load_study(CONFIGS / "study_a100.yaml"))
    assert sorted({p.world_size for p in points}) == [8, 16, 32, 64]
    assert {p.series for p in points} == {"ddp", "fsdp", "fairscale_fsdp"}
    c = points[0].cfg
    assert (c.model.hidden_dim, c.model.depth, c.model.patch_size) == (1280, 32, 16) and c.parallel.use_gpu


def test_ladder_is_cumulative_with_bf16_on_cpu():
    cfg = load_study(CONFIGS / "ladder_cpu.yaml")
    points = plan(cfg)
    assert [p.series for p in points] == ["baseline", "mixed_precision", "fsdp", "mta_optimizer",
                                          "pooled_classifier", "batch_second", "image_256", "full_half", "compile"]
    assert {p.world_size for p in points} == {cfg.run.parallel.num_workers}
    state = [(p.cfg.parallel.strategy, p.cfg.precision.mode, p.cfg.optim.impl, p.cfg.model.classifier,
              p.cfg.model.layout, p.cfg.model.image_size) for p in points]
    assert state[0] == ("ddp", "fp32", "loop", "token", "batch_first", 32)
    assert state[3] == ("fsdp", "mixed", "foreach", "token", "batch_first", 32)
    assert state[-1] == ("fsdp", "pure", "foreach", "pooled", "batch_second", cfg.sweep.ladder_image_size)
    assert {p.cfg.precision.dtype for p in points} == {"bf16"}
    # On GPUs the configured half type stays (the study ran fp16).
    gpu = plan(load_study(CONFIGS / "study_a100.yaml", ["sweep.mode=ladder", "precision.mode=amp"]))
    assert {p.cfg.precision.dtype for p in gpu} == {"fp16"} and gpu[-2].cfg.model.image_size == 256
    # A subset of rungs is still cumulative: pooled_classifier carries the skipped rungs' changes.
    two = plan(load_study(CONFIGS / "ladder_cpu.yaml", ["sweep.rungs=baseline,pooled_classifier"]))
    assert [(p.series, p.cfg.parallel.strategy, p.cfg.optim.impl) for p in two] == [
        ("baseline", "ddp", "loop"), ("pooled_classifier", "fsdp", "foreach")]


def test_the_ladders_last_rung_compiles_on_top_of_every_other():
    points = plan(load_study(CONFIGS / "ladder_cpu.yaml"))
    assert [p.cfg.model.compile for p in points] == [False] * 8 + [True]
    full_half, fused = points[-2].cfg, points[-1].cfg
    assert fused.replace({"model.compile": False}) == full_half       # compile is all the last rung adds
    assert points[-1].key == "8-compile/w2" and points[-1].config_hash != points[-2].config_hash
    # Alone with the baseline it still carries every rung before it (FSDP2, pure bf16, ...).
    two = plan(load_study(CONFIGS / "ladder_cpu.yaml", ["sweep.rungs=baseline,compile"]))
    assert [(p.series, p.cfg.parallel.strategy, p.cfg.precision.mode, p.cfg.model.compile) for p in two] == [
        ("baseline", "ddp", "fp32", False), ("compile", "fsdp", "pure", True)]
    # The study's GPU ladder gets the rung too, and then activation checkpointing on top of everything (a
    # memory rung: what recomputing every block costs once every optimization is in).
    gpu = plan(load_study(CONFIGS / "study_a100.yaml", ["sweep.mode=ladder", "precision.mode=amp"]))
    compiled = next(p for p in gpu if p.series == "compile")
    assert compiled.cfg.model.compile and compiled.cfg.model.activation_checkpointing == "none"
    assert gpu[-1].series == "activation_checkpointing" and gpu[-1].cfg.model.compile
    assert gpu[-1].cfg.replace({"model.activation_checkpointing": "none"}) == compiled.cfg


def test_plan_errors_name_the_problem():
    with pytest.raises(ConfigError, match="must include baseline"):
        plan(load_study(CONFIGS / "ladder_cpu.yaml", ["sweep.rungs=fsdp,full_half"]))
    with pytest.raises(ConfigError, match="fp32 or amp"):
        plan(load_study(CONFIGS / "ladder_cpu.yaml", ["precision.mode=pure"]))
    with pytest.raises(ConfigError, match="fairscale_fsdp at 1 workers: .*needs CUDA"):
        plan(load_study(CONFIGS / "cpu_default.yaml", ["sweep.strategies=ddp,fairscale_fsdp"]))
    with pytest.raises(ConfigError, match="must include ddp"):
        load_study(CONFIGS / "cpu_default.yaml", ["sweep.strategies=fsdp"])


def test_config_hash_tracks_what_a_point_measures():
    base = plan(load_study(CONFIGS / "cpu_default.yaml"))[0]
    renamed = plan(load_study(CONFIGS / "cpu_default.yaml", ["sweep.name=other", "train.max_failures=2"]))[0]
    bigger = plan(load_study(CONFIGS / "cpu_default.yaml", ["train.batch_size=32"]))[0]
    assert base.config_hash == renamed.config_hash != bigger.config_hash


# -- the CLI's errors before anything runs (in process: none of these may start Ray) -----------------

def _main(argv, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import scaling
    finally:
        sys.path.remove(str(SCRIPT.parent))
    code = scaling.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_reports_bad_input_before_running(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    code, _, err = _main(["--config", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "config file not found" in err
    code, _, err = _main(["--set", "sweep.bogus=1"], capsys)
    assert code == 2 and "unknown key 'sweep.bogus'" in err
    code, _, err = _main(["--set", "train.steps=zero"], capsys)
    assert code == 2 and "train.steps='zero' must be an integer" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    code, _, err = _main([], capsys)
    assert code == 2 and f"cannot reach the MLflow tracking server at http://127.0.0.1:{port}" in err
    assert time.monotonic() - start < 15
    import ray
    assert not ray.is_initialized()


def test_dry_run_lists_points_and_resources(capsys):
    code, out, _ = _main(["--dry-run", "--set", "sweep.worker_counts=1,2,4"], capsys)
    assert code == 0
    assert re.search(r"9\s+fairscale_oss/w4\s+fairscale_oss\s+4\s+CPU 4", out)
    assert "largest point needs: CPU 4" in out
    code, out, _ = _main(["--dry-run", "--config", str(CONFIGS / "study_a100.yaml")], capsys)
    assert code == 0 and "GPU 64" in out and "CPU 512" in out


# -- real sweeps through the CLI --------------------------------------------------------------------

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    return root, cli_env(root)


