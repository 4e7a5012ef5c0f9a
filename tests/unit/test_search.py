"""The Tune search: validation, the constraint and divergence logic, a CLI search end to end, ASHA.

One local Ray instance for the module, started without the dashboard on purpose: Ray Train's own
placement-group cleaner then cannot work, so the ASHA test shows that rayvit's release of stopped trials'
groups is what keeps later trials from starving.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


from rayvit.config import ConfigError, load_study
from rayvit.results import RunResult
from rayvit.studies.judge import (Verdict, accuracy_excess, best_outcome, judge, time_to_accuracy)
from rayvit.studies.plan import Point, plan_search
from rayvit.studies.runner import Outcome

from shared import REPO, QUICK, SEARCH_CPU



def search_cfg(**overrides):
    return load_study(SEARCH_CPU, {**QUICK, **overrides})


def run_result(val_accuracy, tflops=0.02, evals=(), step_time=0.1, steps=10):
    """A RunResult with chosen figures, as the trainer returns it (input for the pure judging functions)."""
    metrics = {"tflops_per_chip": tflops, "images_per_sec": 100.0, "val_accuracy": val_accuracy,
               "final_loss": 0.5}
    history = [{"step": s, "loss": 1.0, "lr": 1e-3, "step_time_s": step_time} for s in range(steps)]
    return RunResult(metrics, {"model": "custom"}, history, [dict(e) for e in evals])


# -- validation: bad input fails before anything starts --------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ({"search.space": {}}, "search.space is empty"),
    ({"search.space": {"precision.modee": ["amp"]}}, "unknown key 'precision.modee'"),
    ({"search.space": {"bogus.key": [1]}}, "unknown key 'bogus.key'"),
    ({"search.space": {"train.steps": [10, 20]}}, "cannot be searched"),
    ({"search.space": {"precision.mode": []}}, "empty list"),
    ({"search.space": {"model.image_size": [30]}}, "divisible by model.patch_size"),
    ({"search.baseline": {}}, "needs a baseline"),
    ({"search.baseline": {"train.batch_size": 8}}, "baseline key"),
    ({"data.name": "synthetic"}, "real dataset"),
    ({"search.objective": "time_to_accuracy"}, "train.eval_every"),
])
def test_bad_input_is_refused_before_any_trial(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_search(search_cfg(**overrides))


def test_cli_bad_input_exits_2_without_starting_ray(tmp_path):
    env = {**os.environ, "RAYVIT_HOME": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}
    proc = subprocess.run([sys.executable, "experiments/search.py", "--set", "search.space={foo.bar: [1]}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown key 'foo.bar'" in proc.stderr
    assert not (tmp_path / "m.db").exists()      # nothing was recorded: it stopped before MLflow


def test_default_search_spans_6_to_8_bf16_trials():
    plan = plan_search(load_study(SEARCH_CPU))
    assert 6 <= plan.num_trials <= 8
    # Both of the study's accuracy risks are in the space: full half precision and a bigger image.
    assert "pure" in plan.space["precision.mode"] and max(plan.space["model.image_size"]) > plan.base.model.image_size
    assert plan.base.precision.dtype == "bf16" and {s["precision.mode"] for s in plan.settings} <= {"amp", "mixed", "pure"}
    assert plan.baseline.cfg.precision.mode == "fp32" and plan.baseline.cfg.optim.impl == "loop"
    assert plan.baseline.cfg.model.image_size == plan.base.model.image_size


# -- the constraint and the objective ---------------------------------------------------------------

def test_constraint_is_absolute_accuracy_points_below_the_baseline():
    cfg = search_cfg(**{"search.max_accuracy_drop": 0.02}).search
    assert judge("done", run_result(0.90), 0.91, cfg).feasible
    assert judge("done", run_result(0.89), 0.91, cfg).feasible           # exactly the allowed drop
    assert judge("done", run_result(0.95), 0.91, cfg).feasible           # better than the baseline
    v = judge("done", run_result(0.88), 0.91, cfg)
    assert not v.feasible and "3.0 points below" in v.reason and v.objective == pytest.approx(0.02)
    assert v.accuracy_drop == pytest.approx(0.03)
    # The constraint value the Optuna sampler sees: <= 0 feasible.
    assert accuracy_excess(run_result(0.90), 0.91, 0.02) <= 0 < accuracy_excess(run_result(0.88), 0.91, 0.02)
    assert not judge("done", run_result(float("nan")), 0.91, cfg).feasible


def test_diverged_stopped_and_failed_trials_are_infeasible_with_a_reason():
    cfg = search_cfg().search
    v = judge("diverged", None, 0.9, cfg, error="...\nDivergedError: loss is nan at step 3; the run diverged")
    assert not v.feasible and v.reason.startswith("diverged") and "loss is nan" in v.reason
    v = judge("stopped", None, 0.9, cfg, last={"step": 20, "loss": 2.2})
    assert not v.feasible and v.reason == "stopped early by ASHA at step 20 (loss 2.2)"
    assert not judge("failed", None, 0.9, cfg, error="boom").feasible


def test_time_to_accuracy_and_best_feasible():
    evals = [{"step": 5, "val_accuracy": 0.5}, {"step": 10, "val_accuracy": 0.93}]
    assert time_to_accuracy(run_result(0.93, evals=evals, step_time=0.2), 0.9) == pytest.approx(2.0)
    assert time_to_accuracy(run_result(0.93, evals=evals), 0.95) is None
    cfg = search_cfg(**{"search.objective": "time_to_accuracy", "train.eval_every": 5})
    v = judge("done", run_result(0.93, evals=evals), 0.93, cfg.replace({"search.target_accuracy": 0.95}).search)
    assert not v.feasible and "never reached" in v.reason

    def outcome(label, feasible, objective):
        return Outcome(Point(0, label, label, 1, cfg.run), "done", verdict=Verdict(feasible, "", objective, 0.0))
    outcomes = [outcome("a", True, 1.0), outcome("b", False, 9.0), outcome("c", True, 3.0)]
    assert best_outcome(outcomes, "max").point.key == "c"         # the infeasible faster one is not chosen
    assert best_outcome(outcomes, "min").point.key == "a"
    assert best_outcome([outcome("x", False, 1.0)], "max") is None


# -- divergence, for real ---------------------------------------------------------------------------


# -- a search end to end through the CLI ------------------------------------------------------------


# -- the default search's outcome, at the user's level ----------------------------------------------


# -- ASHA: early-stopped trials must not starve later ones ------------------------------------------


def test_optuna_sampler_gets_the_accuracy_constraint_not_a_folded_objective():
    from ray import tune

    from rayvit.studies.search import EXCESS_KEY, optuna_searcher

    cfg = search_cfg(**{"search.algorithm": "optuna"})
    searcher = optuna_searcher(cfg.search, cfg.run.train.seed, "max")
    assert searcher.set_search_properties(None, None, {"precision.mode": tune.choice(["amp", "pure"])})
    for trial_id, excess in (("a", 0.03), ("b", -0.01)):
        assert searcher.suggest(trial_id)["precision.mode"] in ("amp", "pure")
        searcher.on_trial_result(trial_id, {"loss": 2.0, "step": 10})     # workers' reports: no objective
        searcher.on_trial_complete(trial_id, {"tflops_per_chip": 0.02, EXCESS_KEY: excess})
    first, second = searcher._ot_study.trials
    assert first.values == [0.02] and first.constraints == {EXCESS_KEY: 0.03}     # objective untouched
    assert second.constraints == {EXCESS_KEY: -0.01}
