"""rayvit inside a Ray user's own code: the README's examples run as written (their own ``TorchTrainer``,
their own ``Tuner`` with strict metric checking, the A/B helper, the MLflow pivot), and entry points that
had to start Ray themselves leave the caller's process as they found it.

These tests start Ray themselves (a fresh process, or rayvit's own local instance): no caller's
instance may be running, so they stay out of conftest's shared block.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import ray

from rayvit.config import load_config, load_study
from rayvit.studies.sweep import run_sweep
from rayvit.trainer import fit

from helpers_cli import REPO, cli_env
from helpers_process import ProcessSnapshot

SECTION = "## Using rayvit in your own Ray pipeline"


def readme_examples() -> str:
    """The section's Python blocks, in order, as one script (later blocks use earlier names)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))


def test_a_users_process_left_as_found_and_the_readme_examples_run_as_written(tmp_path, monkeypatch):
    """No Ray running: fit() and a sweep (fit_group inside) each start a local instance and stop it when
    they return, with the environment, loggers, threads, excepthook and signal handlers as they were.
    Then, in a fresh Python, the README section's examples as written, the pivot reading that sweep's
    store. Tune's strict metric checking is its default and stays on."""
    env = cli_env(tmp_path)
    for key in ("RAYVIT_HOME", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(key, env[key])
    assert not ray.is_initialized()
    before = ProcessSnapshot()
    result = fit(load_config("cpu_default", ["train.steps=6", "train.warmup_steps=2"]))
    assert result["tflops_per_chip_lo"] <= result["tflops_per_chip"] <= result["tflops_per_chip_hi"]
    assert not ray.is_initialized() and before.differences() == []
    report = run_sweep(load_study("cpu_default", ["sweep.strategies=ddp,fsdp", "sweep.rounds=1", "train.steps=8",
                                                  "train.warmup_steps=2"]),
                       experiment="cpu_default", out=lambda line: None, ray_log="quiet")
    assert report.exit_code == 0
    assert not ray.is_initialized() and before.differences() == []

    script = readme_examples()
    assert "TuneReportCallback" in script and "search_runs" in script and "compare(" in script
    assert "TUNE_DISABLE_STRICT_METRIC_CHECKING" not in script
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout

    def after(label: str) -> list[str]:
        return out[out.index(label) + len(label):].splitlines()[0].split()

    # make_trainer: the headline figures, their interval and the final accuracy in result.metrics.
    tflops, lo, hi, mfu, accuracy = (float(v) for v in after("TFLOPS per chip, its interval, MFU, accuracy:"))
    assert 0 < lo <= tflops <= hi and 0 < mfu < 1 and 0 < accuracy <= 1
    # Its final checkpoint is the trained model, read back as one plain model.
    kind, parameters, _ = after("trained model:")
    assert kind == "VisionTransformer" and int(parameters) > 0
    assert float(after("images/s per chip:")[0]) > 0               # a hand-built TorchTrainer's result
    # The caller's own Ray Dataset of encoded photographs, decoded by rayvit, its input wait measured.
    assert 0 <= float(after("own dataset:")[0]) <= 1
    # Tune, strict: the best trial by tflops_per_chip, with its final accuracy.
    impl, best_tflops, best_accuracy = after("best:")
    assert impl in ("loop", "foreach") and float(best_tflops) > 0 and 0 < float(best_accuracy) <= 1
    # The A/B: a paired ratio inside its interval, with a verdict.
    assert "loop: " in out and "foreach's images_per_sec_per_chip" in out
    median, low, high, *verdict = after("A/B:")
    assert float(low) <= float(median) <= float(high) and " ".join(verdict) in ("higher", "lower", "within noise")
    # The pivot: that sweep's figures, both strategies at 1 and 2 chips (as numbers, in order).
    pivot = out[out.index(f"per-chip TFLOPS, sweep {report.name!r}:"):].splitlines()
    assert pivot[1].split() == ["tags.strategy", "ddp", "fsdp"]
    rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]] for line in pivot[3:5]}
    figures = {(o.point.world_size, o.point.series): o.result["tflops_per_chip"] for o in report.outcomes}
    assert list(rows) == [1, 2]
    for chips, values in rows.items():
        assert values == pytest.approx([figures[(chips, "ddp")], figures[(chips, "fsdp")]], rel=1e-3, abs=1e-6)
