"""The repository's paths, and the sweep and search CLIs' settings and environment, for the tests that run
them (``tests/`` is on ``sys.path`` through its conftest)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"

SCRIPT = REPO / "experiments" / "scaling.py"
FEW_STEPS = ["--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.report_every=6"]
SEARCH_CPU = CONFIGS / "search_cpu.yaml"
# Small and quick: every trial trains the same few steps on digits with 2 workers.
QUICK = {"train.steps": 40, "train.report_every": 10, "train.warmup_steps": 5}
# The 64-wide ViT the search default used before it grew to width 256 (bf16 is slower than fp32 on it).
TINY_MODEL = {"model.hidden_dim": 64, "model.mlp_dim": 128, "model.patch_size": 4, "optim.lr": 0.003,
              "optim.impl": "foreach"}


def cli_env(root: Path) -> dict[str, str]:
    """A user's environment for the CLIs, with the MLflow store and rayvit's home under ``root``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{root}/mlflow.db", RAYVIT_HOME=str(root / "home"),
               PYTHONUNBUFFERED="1")
    return env

