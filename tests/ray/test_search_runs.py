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
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import ray
from mlflow import MlflowClient

from rayvit.config import load_config, load_study
from rayvit.studies.outcome import is_divergence
from rayvit.studies.search import run_search, screen
from rayvit.studies.search.judge import judge
from rayvit.studies.search.trials import ERROR_KEY, STATUS_KEY, trial_trainable
from rayvit.trainer import TrainingError, fit

from helpers_cli import REPO, QUICK, SEARCH_CPU, TINY_MODEL, cli_env
from helpers_process import ProcessSnapshot



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


def _actors(class_name):
    """Ids of every actor of ``class_name`` this module's instance has had, live or dead, from its GCS (the
    state API needs the dashboard, which this instance runs without)."""
    from ray._private.state import actors

    return sorted(k for k, a in actors().items() if a["ActorClassName"] == class_name)


def search_cfg(**overrides):
    return load_study(SEARCH_CPU, {**QUICK, **overrides})


def test_nan_loss_stops_the_trial_cleanly_and_reads_as_diverged(local_ray):
    # An absurd learning rate overflows the weights at the first step: the next loss is NaN/inf.
    study = search_cfg(**{"optim.lr": 1e30, "parallel.num_workers": 1})
    cfg = study.run
    # The plain run and the Tune trial below (one worker each, on this module's 2 CPUs) are independent
    # and mostly wait on Ray Train's start-up: the plain run goes in a thread while the trial runs.
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(fit, cfg)
        # Inside a Tune trial the same divergence is reported as a result, not raised as a trial error.
        [result] = _diverging_trial(study, local_ray)
        with pytest.raises(TrainingError) as caught:
            plain.result(timeout=300)
    assert is_divergence(caught.value)
    assert not is_divergence(TrainingError("ddp x 2 workers failed: RuntimeError: out of memory"))

    assert result.error is None
    assert result.metrics[STATUS_KEY] == "diverged" and "diverged" in result.metrics[ERROR_KEY]
    v = judge("diverged", None, 0.9, study.search, error=result.metrics[ERROR_KEY])
    assert not v.feasible and v.reason.startswith("diverged")


def _diverging_trial(study, root):
    from ray import tune

    cfg = study.run
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trial_trainable, base=cfg.to_dict(), search_name="div",
                                                 search=dataclasses.asdict(study.search), baseline_accuracy=0.9),
                            {"CPU": 0, "node:__internal_head__": 0.001}),
        run_config=tune.RunConfig(storage_path=str(root / "tune"), verbose=0))
    return list(tuner.fit())


def test_screen_times_each_setting_in_a_ray_task_on_one_trial_worker(local_ray):
    base = search_cfg().run
    cfgs = [base.replace({"precision.mode": "fp32"}), base.replace({"optim.impl": "fused"}),
            base.replace({"precision.mode": "amp"})]
    measured = screen.measure(cfgs, steps=3, max_seconds=1.0)
    assert measured["device"] == "cpu" and measured["native_bf16"] in (True, False)
    assert measured["errors"] == [None, None, None]
    # Every setting timed in round 1, at most 3 steps a round, each a positive duration.
    for rounds in measured["times"]:
        assert 1 <= len(rounds) <= screen.ROUNDS and all(1 <= len(r) <= 3 and min(r) > 0 for r in rounds)
    assert len(measured["times"][0]) == screen.ROUNDS          # the reference gets every round


def _wait_for(proc, lines, marker, timeout):
    """Read ``proc``'s stdout into ``lines`` until a line contains ``marker``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return True
    return False


def _search_interrupted_in_its_first_trial(argv: list[str], tmp_path) -> tuple[int, str, str]:
    """experiments/search.py run as a user runs it, interrupted with SIGINT during its first trial: its exit
    status, what it printed and its stderr.

    The interrupted run attaches to this module's instance (the resume runs on it too) rather than starting
    a local instance of its own beside it: the CLI's default path, a local instance of its own, is
    test_sweep_runs.py's default sweep. The instance's token is Ray's default one for local instances,
    ~/.ray/auth_token, which the CLI finds there too."""
    env = {**cli_env(tmp_path), "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"],
           "RAYVIT_HOME": os.environ["RAYVIT_HOME"], "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, "experiments/search.py", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[str] = []
    try:
        # A trial's live step line: the trial is training on its workers.
        assert _wait_for(proc, lines, "[t01/2] t01: step", 240), "\n".join(lines) + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "\n".join(lines) + "\n" + out, err


def _search_parent(client: MlflowClient, exp):
    """The search's own MLflow run (the trials' parent)."""
    [parent] = client.search_runs([exp.experiment_id],
                                  "tags.`rayvit.kind` = 'search' and tags.`rayvit.sweep` = 'decisive'")
    return parent


def _resumed_in_this_process(argv: list[str]) -> int:
    """experiments/search.py's own ``main`` resuming the search by name, on this module's Ray instance."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import search as search_cli
    finally:
        sys.path.pop(0)
    return search_cli.main(argv)


def _check_resumed_printout(printed: str) -> bool:
    """What the resumed search printed: the baseline reused, live progress, then the verdicts. Whether t01
    won (its TFLOPS interval lies above the baseline's)."""
    assert "[baseline] reused" in printed and "[baseline] training" not in printed
    # Live progress, then the verdicts.
    assert "[t01/2] t01: step" in printed
    assert "[t01/2] impl=fused image_size=32: FEASIBLE" in printed
    rejected = next(line for line in printed.splitlines() if line.startswith("[t02/2] impl=fused image_size=40:"))
    assert "infeasible" in rejected and "points below the baseline" in rejected
    assert "2 trial(s) (2 trained now), 1 feasible" in printed
    # The winner is t01 only if its TFLOPS interval lies above the baseline's; else the baseline stays.
    t01 = next(line for line in printed.splitlines() if line.startswith("[t01/2] impl=fused image_size=32:"))
    beyond = "beyond noise" in t01
    assert beyond or "within noise of the baseline" in t01 or "below the baseline" in t01
    if beyond:
        assert "Best: t01 (impl=fused image_size=32)" in printed
    else:
        assert "No trial beat the baseline beyond noise" in printed
    assert "Configuration for experiment" not in printed and "tensorboard" not in printed.lower()
    return beyond


def _check_finished_record(client: MlflowClient, exp):
    """The resumed search's MLflow record: finished, the baseline and both trials as finished children with
    their verdicts, figures and intervals, the search's artifacts. The parent run."""
    parent = _search_parent(client, exp)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                                       "and attributes.status = 'FINISHED'")
    assert sorted(c.data.tags["rayvit.trial"] for c in children) == ["baseline", "t01", "t02"]
    for child in children:
        assert child.data.tags["feasible"] in ("true", "false") and child.data.tags["reason"]
        if child.data.tags["rayvit.trial"] != "baseline":
            assert child.data.params["trial.optim.impl"] == "fused"
            assert child.data.params["trial.model.image_size"] in ("32", "40")
        assert child.data.metrics["tflops_per_chip"] > 0 and 0 <= child.data.metrics["val_accuracy"] <= 1
        assert child.data.metrics["tflops_per_chip_lo"] <= child.data.metrics["tflops_per_chip"] <= \
            child.data.metrics["tflops_per_chip_hi"]
    baseline = next(c for c in children if c.data.tags["rayvit.trial"] == "baseline")
    assert baseline.data.tags["precision"] == "fp32" and baseline.data.params["optim.impl"] == "loop"
    assert parent.data.metrics["baseline_val_accuracy"] == pytest.approx(baseline.data.metrics["val_accuracy"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"search_trials.parquet", "search_trials.txt", "accuracy_vs_throughput.png",
            "best_config.yaml"} <= artifacts
    return parent


def test_cli_search_interrupted_then_resumed_picks_the_faster_setting_within_budget(local_ray, tmp_path, capsys):
    # The default config's decisive pair: the fused optimizer at 32 px (the baseline's arithmetic, so its
    # accuracy) and at 40 px (more TFLOPS per chip, 4-5 points less accuracy at this budget: rejected).
    # The screen is off here (the grid order, every setting trained), so what is asserted does not rest on
    # timings. First the search is interrupted with SIGINT during its first trial; then resumed by name.
    best_path = tmp_path / "best.yaml"
    sets = ["search.space={optim.impl: [fused], model.image_size: [32, 40]}", "search.screen=false"]
    argv = ["--name", "decisive", "--output", str(best_path)] + [a for s in sets for a in ("--set", s)]
    code, printed, err = _search_interrupted_in_its_first_trial(argv, tmp_path)
    assert code == 130, printed + err
    assert "interrupted after 0 of 2 trials; no best config written; resume with --name decisive" in err
    interrupted = next(line for line in printed.splitlines() if line.startswith("[t01/2] impl=fused image_size=32:"))
    assert "interrupted" in interrupted and "ASHA" not in printed
    assert "Tuner.restore" not in printed + err and "No trial beat" not in printed
    assert not best_path.exists()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("rayvit-search")
    parent = _search_parent(client, exp)
    assert parent.info.status == "KILLED"
    killed = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                                     "and tags.`rayvit.trial` = 't01'")
    assert [(r.info.status, r.data.tags["status"]) for r in killed] == [("KILLED", "interrupted")]

    # Resumed in this process (this module's Ray instance): the baseline is reused, the trials train.
    assert _resumed_in_this_process(argv) == 0
    beyond = _check_resumed_printout(capsys.readouterr().out)
    parent = _check_finished_record(client, exp)

    # The written best config is the winner (or the baseline) and loads as a config ...
    best = load_config(best_path)
    assert parent.data.tags["best_trial"] == ("t01" if beyond else "baseline")
    assert (best.optim.impl, best.model.image_size) == (("fused", 32) if beyond else ("loop", 32))
    assert best.model.hidden_dim == 128 and load_study(best_path).search.space == {}

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
    cfg = search_cfg(**TINY_MODEL, **{"model.depth": 2, "train.batch_size": 32,      # the shape it was built on
                                      "search.space": {"optim.name": ["adamw", "sgd", "adam"]},
                        "search.baseline": {"precision.mode": "fp32", "optim.impl": "loop"}, "search.asha": True,
                        "search.screen": False,
                        "search.asha_grace_steps": 10, "search.asha_reduction_factor": 5,
                        "search.max_accuracy_drop": 1.0, "search.name": "asha"})
    watchers_before = _actors("PreemptionWatcher")
    before = ProcessSnapshot()
    report = run_search(cfg, out=lambda line: None)
    assert before.differences() == []            # Tune's and rayvit's settings were the search's alone
    # This driver's instance is its own ray.init(): the trials' runs started no preemption watcher, as the
    # driver's own fits do not (Tune hands the driver's Ray Train variables to its trial processes).
    assert _actors("TrainController") and _actors("PreemptionWatcher") == watchers_before
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
