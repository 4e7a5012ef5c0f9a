"""The Tune search: validation, the constraint and divergence logic, a CLI search end to end, ASHA.

One local Ray instance for the module, started without the dashboard on purpose: Ray Train's own
placement-group cleaner then cannot work, so the ASHA test shows that rayvit's release of stopped trials'
groups is what keeps later trials from starving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest

import ray
from mlflow import MlflowClient

from rayvit.config import load_config, load_study
from rayvit.studies.judge import (is_divergence, judge)
from rayvit.studies.search import ERROR_KEY, STATUS_KEY, run_search, trial_trainable
from rayvit.trainer import TrainingError, fit

from shared import REPO, QUICK, SEARCH_CPU, TINY_MODEL



@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    home = tmp_path_factory.mktemp("rayvit_home")
    saved = {k: os.environ.get(k) for k in ("RAYVIT_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["RAYVIT_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + str(home / "mlflow.db")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield home
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def search_cfg(**overrides):
    return load_study(SEARCH_CPU, {**QUICK, **overrides})


def test_nan_loss_stops_the_trial_cleanly_and_reads_as_diverged(local_ray):
    # An absurd learning rate overflows the weights at the first step: the next loss is NaN/inf.
    study = search_cfg(**{"optim.lr": 1e30, "parallel.num_workers": 1})
    cfg = study.run
    with pytest.raises(TrainingError) as caught:
        fit(cfg)
    assert is_divergence(caught.value)
    assert not is_divergence(TrainingError("ddp x 2 workers failed: RuntimeError: out of memory"))

    # Inside a Tune trial the same divergence is reported as a result, not raised as a trial error.
    from ray import tune

    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trial_trainable, base=cfg.to_dict(), search_name="div",
                                                 search=dataclasses.asdict(study.search), baseline_accuracy=0.9),
                            {"CPU": 0, "node:__internal_head__": 0.001}),
        run_config=tune.RunConfig(storage_path=str(local_ray / "tune"), verbose=0))
    [result] = list(tuner.fit())
    assert result.error is None
    assert result.metrics[STATUS_KEY] == "diverged" and "diverged" in result.metrics[ERROR_KEY]
    v = judge("diverged", None, 0.9, study.search, error=result.metrics[ERROR_KEY])
    assert not v.feasible and v.reason.startswith("diverged")


def test_cli_search_end_to_end_picks_the_faster_setting_within_budget_and_rejects_a_lossy_one(
        local_ray, tmp_path, capsys):
    # The default config's decisive pair (see search_cpu.yaml): bf16 autocast at 32 px and at 40 px. At
    # 100 steps, as at the default's 150, 32 px stays within the budget (80.8% against fp32's 81.1%) and
    # 40 px loses 9.7 points; the accuracies are deterministic (fixed seed). That 32 px amp beats the fp32
    # baseline's TFLOPS is a timing (1.1-1.7x measured here). One search serves the CLI's end-to-end
    # checks (the MLflow record, the written config, scaling.py accepting it) and the default's outcome.
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import search as search_cli
    finally:
        sys.path.pop(0)
    best_path = tmp_path / "best.yaml"
    sets = ["search.space={precision.mode: [amp], model.image_size: [32, 40]}", "train.steps=100"]
    argv = ["--name", "decisive", "--output", str(best_path)] + [a for s in sets for a in ("--set", s)]
    assert search_cli.main(argv) == 0    # in-process: uses this module's Ray instance
    printed = capsys.readouterr().out

    # The live lines and the summary say which setting won and why the other was rejected.
    assert "[t01/2] mode=amp image_size=32: FEASIBLE" in printed
    rejected = next(line for line in printed.splitlines() if line.startswith("[t02/2] mode=amp image_size=40:"))
    assert "infeasible" in rejected and "points below the baseline" in rejected
    assert "2 trials, 1 feasible" in printed and "Best feasible: t01 (mode=amp image_size=32)" in printed
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line
            for line in printed.splitlines() if line.lstrip("* ").startswith(("t01 ", "t02 ", "baseline "))}
    assert rows["t01"].startswith("*") and rows["t01"].rstrip().endswith("within the accuracy budget")
    assert " no " in rows["t02"] and "points below the baseline" in rows["t02"]
    assert "No trial beat the baseline" not in printed
    # Tune's own banner box and its TensorBoard hint stay off the console.
    assert "Configuration for experiment" not in printed and "tensorboard" not in printed.lower()

    # MLflow: one parent run for the search, a child per trial and one for the baseline.
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("rayvit-search")
    [parent] = client.search_runs([exp.experiment_id],
                                  "tags.`rayvit.kind` = 'search' and tags.`rayvit.sweep` = 'decisive'")
    assert parent.info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["rayvit.trial"] for c in children) == ["baseline", "t01", "t02"]
    for child in children:
        assert child.data.tags["feasible"] in ("true", "false") and child.data.tags["reason"]
        assert child.data.params["train.steps"] == "100"
        if child.data.tags["rayvit.trial"] != "baseline":
            assert child.data.params["trial.precision.mode"] == "amp"
            assert child.data.params["trial.model.image_size"] in ("32", "40")
            assert child.data.tags["precision"].startswith(child.data.params["trial.precision.mode"])
        assert child.data.metrics["tflops_per_chip"] > 0 and 0 <= child.data.metrics["val_accuracy"] <= 1
    baseline = next(c for c in children if c.data.tags["rayvit.trial"] == "baseline")
    assert baseline.data.tags["precision"] == "fp32" and baseline.data.params["optim.impl"] == "loop"
    assert parent.data.metrics["baseline_val_accuracy"] == pytest.approx(baseline.data.metrics["val_accuracy"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"search_trials.parquet", "search_trials.txt", "accuracy_vs_throughput.png",
            "best_config.yaml"} <= artifacts

    # The written best config is the best feasible trial, states its gain and loads as a config ...
    best = load_config(best_path)
    feasible = [c for c in children if c.data.tags["feasible"] == "true"]
    top = max(feasible, key=lambda c: c.data.metrics["tflops_per_chip"])
    assert parent.data.tags["best_trial"] == top.data.tags["rayvit.trial"] == "t01"
    assert (best.precision.mode, best.precision.dtype, best.model.image_size) == ("amp", "bf16", 32)
    assert best.train.steps == 100 and best.model.hidden_dim == 256 and load_study(best_path).search.space == {}
    header = best_path.read_text().splitlines()[1]
    assert header.startswith("# Setting: mode=amp image_size=32 (t01)") and "x the baseline's" in header

    # ... and experiments/scaling.py accepts it.
    proc = subprocess.run([sys.executable, "experiments/scaling.py", "--dry-run", "--config", str(best_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "scaling sweep" in proc.stdout and "ddp/w1" in proc.stdout


def test_asha_stopped_trials_release_their_workers(local_ray):
    # SGD at this learning rate learns far slower than Adam(W): ASHA stops it at its one rung (step 10;
    # factor 5 puts the next rung past the budget), while adam, after it, keeps up with adamw and must
    # get the workers' CPUs the stopped trial was holding.
    # ASHA's cutoff at that rung is the 80th percentile of the losses so far, adam's included: adam passes
    # only if its loss is not above adamw's, so the test keeps the tiny model and learning rate it was
    # built on (the scaling default's), not the search default's, where that order is a coin toss.
    cfg = search_cfg(**TINY_MODEL, **{"search.space": {"optim.name": ["adamw", "sgd", "adam"]},
                        "search.baseline": {"precision.mode": "fp32"}, "search.asha": True,
                        "search.asha_grace_steps": 10, "search.asha_reduction_factor": 5,
                        "search.max_accuracy_drop": 1.0, "search.name": "asha"})
    report = run_search(cfg, out=lambda line: None)
    by_name = {o.point.setting["optim.name"]: o for o in report.outcomes}
    assert by_name["sgd"].status == "stopped", by_name["sgd"].verdict.reason
    assert by_name["sgd"].verdict.reason.startswith("stopped early by ASHA at step")
    # The trial after the stopped one ran its whole budget: nothing starved, nothing hung.
    assert by_name["adam"].status == "done" and by_name["adam"].result is not None
    assert by_name["adamw"].status == "done"
    assert not report.failed
    # With the dashboard off, Ray Train's cleaner cannot free the stopped trial's group: rayvit did.
    assert report.released_placement_groups >= 1
    leftover = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    assert leftover == []
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(by_name["sgd"].run_id)
    assert run.info.status == "KILLED" and run.data.tags["feasible"] == "false"
    assert json.loads(client.get_run(report.parent_run_id).data.tags["space"]) == {"optim.name": ["adamw", "sgd", "adam"]}
