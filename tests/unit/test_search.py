"""The Tune search: validation, the constraint and divergence logic, a CLI search end to end, ASHA.

One local Ray instance for the module, started without the dashboard on purpose: Ray Train's own
placement-group cleaner then cannot work, so the ASHA test shows that rayvit's release of stopped trials'
groups is what keeps later trials from starving.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import sys

import pytest


from rayvit import stats
from rayvit.config import load_study
from rayvit.errors import ConfigError
from rayvit.results import RunResult
from rayvit.studies.outcome import Outcome, Verdict
from rayvit.studies.plan import Point, plan_search
from rayvit.studies.search.judge import accuracy_excess, best_outcome, judge, time_to_accuracy

from helpers_cli import CONFIGS, REPO, QUICK, SEARCH_CPU



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


def test_cli_bad_input_exits_2_without_starting_ray(tmp_path, monkeypatch, capsys):
    # experiments/search.py's own main, in this process (a subprocess would spend seconds importing).
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    import search as search_cli

    assert search_cli.__file__ == str(REPO / "experiments" / "search.py")
    assert search_cli.main(["--set", "search.space={foo.bar: [1]}"]) == 2
    assert "unknown key 'foo.bar'" in capsys.readouterr().err
    assert not (tmp_path / "m.db").exists()      # nothing was recorded: it stopped before MLflow
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_default_search_spans_the_studys_accuracy_risks_and_the_optimizer():
    plan = plan_search(load_study(SEARCH_CPU))
    assert 12 <= plan.num_trials <= 24
    # Both of the study's accuracy risks are in the space: full half precision and a bigger image.
    assert "pure" in plan.space["precision.mode"] and max(plan.space["model.image_size"]) > plan.base.model.image_size
    assert plan.base.precision.dtype == "bf16"
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

    from rayvit.studies.search.trials import EXCESS_KEY
    from rayvit.studies.search.tuner import optuna_searcher

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


# -- the screen: order, prune, stop (synthetic step times, the real decision code) ------------------

def screened(label, setting, step_s, rounds=2, steps=6, jitter=0.02, study=None):
    """A setting's screen with chosen step times: ``steps`` per round, alternating +-jitter around ``step_s``."""
    from rayvit.studies.search.screen import Screened

    study = study or load_study(SEARCH_CPU)
    cfg = study.run.replace(setting)
    times = [[step_s * (1 + (jitter if i % 2 else -jitter)) for i in range(steps)] for _ in range(rounds)]
    return Screened(label, dict(setting), cfg, step_times=times)


def test_screen_orders_by_screened_objective_and_prunes_what_cannot_beat_the_baseline():
    from rayvit.studies.search.screen import screen

    base = screened("baseline", {"precision.mode": "fp32", "optim.impl": "loop"}, 0.070)
    cands = [screened("t01", {"precision.mode": "fp32", "optim.impl": "fused"}, 0.058),       # 1.21x
             screened("t02", {"precision.mode": "fp32", "optim.impl": "foreach"}, 0.069),     # 1.01x: noise
             screened("t03", {"precision.mode": "amp", "optim.impl": "fused"}, 1.40),         # 0.05x: emulated bf16
             screened("t04", {"precision.mode": "fp32", "model.image_size": 40}, 0.080),      # more FLOPs/image
             screened("t05", {"precision.mode": "pure", "optim.impl": "loop"}, 1.2, rounds=1, steps=1)]
    report = screen(base, cands, "tflops_per_chip", device="cpu", native_bf16=False)
    by = {c.label: c for c in report.candidates}
    # 40 px: 1.56x the FLOPs per image in 1.14x the time -> 1.37x TFLOPS; fused 1.21x; foreach 1.01x, which
    # the screen cannot tell from the baseline (never surer than +-5%): trained too, best screened first.
    assert [c.label for c in report.order] == ["t04", "t01", "t02"]
    assert by["t04"].ratio.median == pytest.approx(1.366, rel=0.02) and by["t04"].ratio.lo > 1
    assert by["t02"].ratio.lo < 1 < by["t02"].ratio.hi
    # 20x slower on a CPU without bf16 instructions: one step decides it, and the reason says why.
    assert by["t03"].decision == "screened out"
    assert by["t03"].reason.startswith("0.05x the baseline on this cpu: no native bf16")
    assert by["t05"].decision == "screened out" and by["t05"].ratio.median < 0.1
    # The same bf16 settings on a CPU with native bf16 and faster steps are trained.
    fast = screen(base, [screened("t03", {"precision.mode": "amp", "optim.impl": "fused"}, 0.045)],
                  "tflops_per_chip", device="cpu", native_bf16=True)
    assert fast.order[0].label == "t03" and fast.order[0].note == ""


def test_screen_interval_is_never_narrower_than_its_noise_floor_and_failed_screens_are_trained():
    from rayvit.studies.search.screen import NOISE_FLOOR, screen

    base = screened("baseline", {"precision.mode": "fp32"}, 0.070, jitter=0.0)
    same = screened("t01", {"optim.impl": "fused"}, 0.0665, jitter=0.0)        # 1.05x, no jitter at all
    broken = screened("t02", {"optim.impl": "foreach"}, 0.05)
    broken.step_times, broken.error = [], "RuntimeError: CUDA out of memory"
    slower = screened("t03", {"optim.impl": "loop", "precision.mode": "amp"}, 0.0770, jitter=0.0)   # 0.91x
    report = screen(base, [same, broken, slower], "tflops_per_chip")
    assert same.ratio.lo <= same.ratio.median * (1 - NOISE_FLOOR) + 1e-12
    assert same.trained                                      # 1.05x (1.00-1.10): may still beat the baseline
    assert slower.decision == "screened out" and slower.ratio.hi < 1.0 and slower.reason == "0.91x the baseline on this cpu"
    assert broken.trained and "CUDA out of memory" in broken.reason and report.order[-1] is broken
    # Not above the baseline, though within its noise: the baseline's own objective already exceeds it.
    close = screened("t04", {"optim.impl": "foreach"}, 0.0714, jitter=0.0)                # 0.98x (0.93-1.03)
    screen(base, [close], "tflops_per_chip")
    assert close.decision == "screened out" and close.ratio.hi > 1.0
    assert close.reason.startswith("screened 0.98x (0.93-1.03) the baseline: not above it")


@pytest.mark.parametrize("gib,profile", [(79.2, "a100-80gb"), (39.4, "a100-40gb")])
def test_the_screen_projects_with_the_profile_of_the_device_it_timed(monkeypatch, gib, profile):
    """The screen timed its steps on an A100 with 80 GB (CUDA's total_memory: 79.2 GiB): it carries them to
    the trials' 8 GPUs with the 80 GB profile (HBM 2,039 GB/s), as the sweep does, not the 40 GB one, and
    says which; no warning that the memory was unknown. Timing on a GPU needs one: the Ray task's answer is
    given here as :func:`time_steps` returns it there (synthetic step times, the real code after them)."""
    import warnings

    from rayvit.projection.profiles import PROFILES, UnknownMemoryWarning
    from rayvit.studies.search import screen as screening

    plan = plan_search(load_study(CONFIGS / "search_a100.yaml", {"search.space": {"optim.impl": ["foreach", "fused"]}}))
    cfgs = [plan.baseline.cfg] + [p.cfg for p in plan.candidates()]
    steps = [[0.100 + 0.001 * (i % 5) + 0.0002 * (s % 2) for s in range(6)] for i in range(len(cfgs))]
    measured = {"times": [[t, t] for t in steps], "seconds": [1.0] * len(cfgs), "errors": [None] * len(cfgs),
                "device": "A100", "native_bf16": None, "device_memory_bytes": int(gib * 2**30)}
    monkeypatch.setattr(screening, "measure", lambda cfgs, steps, seconds: measured)
    lines: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = screening.run_screen(plan, lines.append)
    assert not [w for w in caught if issubclass(w.category, UnknownMemoryWarning)]
    assert report.profile == profile
    assert f"on A100 ({gib:.0f} GiB: projected to 8 GPUs with the {profile} profile)" in lines[1], lines[1]
    base = report.baseline
    single = stats.seconds_per_step([b for r in screening._blocks(base) for b in r])
    assert base.step_s_offset == pytest.approx(screening.projected_offset(base.cfg, single, PROFILES[profile]))


def test_screened_order_trains_best_first_and_stops_once_a_feasible_trial_beats_every_remaining_screen():
    from ray.tune.search import Searcher

    from rayvit.studies.search.search_session import SearchSession, registered, session_named
    from rayvit.studies.search.trials import FEASIBLE_KEY, TRIAL_KEY
    from rayvit.studies.search.tuner import Entry, ScreenedOrder

    lines = []
    session = SearchSession("order-test", plan_search(load_study(SEARCH_CPU)), lines.append)
    with registered(session):
        entries = [Entry("t04", {"model.image_size": 40}, stats.Estimate(1.37, 1.25, 1.45, 3)),
                   Entry("t01", {"optim.impl": "fused"}, stats.Estimate(1.21, 1.10, 1.30, 3)),
                   Entry("t07", {"precision.mode": "pure"}, stats.Estimate(1.10, 0.98, 1.20, 3)),
                   Entry("t06", {"optim.impl": "foreach"}, stats.Estimate(1.08, 1.02, 1.14, 3)),
                   Entry("t09", {"precision.mode": "amp"}, None)]        # not screened: always trained
        order = ScreenedOrder("order-test", entries, baseline_objective=0.040, mode="max", prune=True)
        assert order.suggest("a") == {"model.image_size": 40, TRIAL_KEY: "t04"}
        # t04 is infeasible (accuracy): it moves nothing; the next best screened setting runs.
        order.on_trial_complete("a", {FEASIBLE_KEY: float("nan")})
        assert order.suggest("b")[TRIAL_KEY] == "t01"
        # t01 feasible, measured 1.15x the baseline: it exceeds t07's screened 1.10x (the stop rule) and the
        # top of t06's screened interval (1.14x): neither is trained.
        order.on_trial_complete("b", {FEASIBLE_KEY: 0.046})
        assert order.suggest("c")[TRIAL_KEY] == "t09"
        assert order.suggest("d") == Searcher.FINISHED
        skipped = session.skipped
        assert list(skipped) == ["t07", "t06"]
        assert "t01's measured 1.15x already exceeds it" in skipped["t07"]
        assert "cannot beat t01's measured 1.15x even at the top of the screen's interval" in skipped["t06"]
        assert skipped["t07"].startswith("screened 1.10x (0.98-1.20) the baseline")
        assert any(line.startswith("[t06/") and "not trained" in line for line in lines)
        # A resumed search counts its finished trials from the start; with pruning off nothing is left out.
        resumed = ScreenedOrder("order-test", entries[1:], 0.040, "max", prune=True, finished={"t04": 1.15})
        assert resumed.suggest("x")[TRIAL_KEY] == "t01" and resumed.suggest("y")[TRIAL_KEY] == "t09"
        unpruned = ScreenedOrder("order-test", entries, 0.040, "max", prune=False, finished={"t04": 9.0})
        assert [unpruned.suggest(i)[TRIAL_KEY] for i in "vwxyz"] == ["t04", "t01", "t07", "t06", "t09"]
    assert session_named("order-test") is None        # the search's state is gone with the search


def test_the_screen_and_the_trials_stop_by_one_rule():
    """The stop rule against the baseline (before the trials) and against the best trial (during them)
    is one function: the same screened ratio against the same reference gets the same decision."""
    from rayvit.studies.search.screen import stop_reason

    close = stats.Estimate(0.98, 0.93, 1.03, 3)
    assert stop_reason(close, 1.0) == "screened 0.98x (0.93-1.03) the baseline: not above it"
    assert stop_reason(close, 0.97, "t01") is None and stop_reason(close, 0.99, "t01").endswith("already exceeds it")
    assert stop_reason(stats.Estimate(1.02, 0.97, 1.07, 3), 1.0) is None
    assert "cannot beat it" in stop_reason(stats.Estimate(0.95, 0.90, 1.0, 3), 1.0)
    assert stop_reason(stats.Estimate(1.15, 1.1, 1.2, 3), 1.15, "t01").endswith("already equals it")


# -- the noise-aware verdict (real intervals from RunResult.of_rounds over chosen step times) -------

def timed_result(step_s, jitter, accuracy=0.9, steps=40):
    rng = random.Random(1)          # the same noise for every call: results differ by step_s alone
    times = [step_s * (1 + rng.uniform(-jitter, jitter)) for _ in range(steps)]
    metrics = {"tflops_per_chip": 1e9 * 32 / step_s / 1e12, "images_per_sec_per_chip": 32 / step_s,
               "images_per_sec": 64 / step_s, "step_time_s": step_s, "train_flops_per_image": 1e9,
               "val_accuracy": accuracy, "final_loss": 0.5}
    conditions = {"batch_per_chip": 32, "world_size": 2, "model": "custom"}
    return RunResult.of_rounds([RunResult(metrics, conditions, step_times=times)])


def test_a_trial_beats_the_baseline_only_when_their_ratios_interval_lies_above_one():
    from rayvit.studies.search.judge import versus_baseline

    base = timed_result(0.070, jitter=0.25)
    assert base.metrics["tflops_per_chip_lo"] < base.metrics["tflops_per_chip"] < base.metrics["tflops_per_chip_hi"]
    beats, text = versus_baseline(timed_result(0.050, jitter=0.25), base, "tflops_per_chip", "max")
    assert beats and text.startswith("1.40x the baseline, beyond noise")
    beats, text = versus_baseline(timed_result(0.068, jitter=0.25), base, "tflops_per_chip", "max")
    assert not beats and "within noise of the baseline" in text          # 1.03x, intervals overlap
    beats, text = versus_baseline(timed_result(0.068, jitter=0.0), timed_result(0.070, jitter=0.0),
                                  "tflops_per_chip", "max")
    assert beats                                                          # the same 1.03x, no noise at all
    beats, text = versus_baseline(timed_result(0.10, jitter=0.25), base, "tflops_per_chip", "max")
    assert not beats and "below the baseline" in text
    # The rule is rayvit.stats' one, the sweep's and the screen's: the ratio of the two runs (separate runs:
    # unpaired) with its 95% interval, against 1.0.
    for step_s in (0.050, 0.068, 0.0665, 0.10):
        trial = timed_result(step_s, jitter=0.25)
        ratio = stats.compare(trial, base, "tflops_per_chip", paired=False)
        assert versus_baseline(trial, base, "tflops_per_chip", "max")[0] == (ratio.verdict(1.0) == stats.ABOVE)
    # 1.05x: the two runs' own intervals still overlap, but the interval of their ratio lies above 1.0.
    trial = timed_result(0.0665, jitter=0.25)
    assert trial.metrics["tflops_per_chip_lo"] < base.metrics["tflops_per_chip_hi"]
    beats, text = versus_baseline(trial, base, "tflops_per_chip", "max")
    assert beats and text.startswith("1.05x the baseline, beyond noise") and "95% interval 1.0" in text
    # Results without step times (recorded before they were kept): the figures as they are.
    bare = RunResult(dict(trial.metrics), dict(trial.conditions))
    assert versus_baseline(bare, base, "tflops_per_chip", "max") == (
        True, "1.05x the baseline (no intervals: figures compared as they are)")


def test_best_outcome_beyond_noise_keeps_the_baseline_when_the_fastest_trial_is_within_noise():
    cfg = load_study(SEARCH_CPU).run

    def outcome(label, objective, beats):
        return Outcome(Point(0, label, label, 2, cfg), "done", verdict=Verdict(True, "", objective, 0.0, beats))
    base = outcome("baseline", 1.0, None)
    assert best_outcome([base, outcome("t01", 1.04, False)], "max", beyond_noise=True) is base
    assert best_outcome([base, outcome("t01", 1.04, False)], "max").point.key == "t01"
    picked = best_outcome([base, outcome("t01", 1.30, False), outcome("t02", 1.2, True)], "max", beyond_noise=True)
    assert picked.point.key == "t02"


# -- statuses and reasons ---------------------------------------------------------------------------

def test_a_trial_without_its_final_report_is_interrupted_or_asha_stopped_never_guessed():
    from rayvit.studies.search.trials import trial_outcome, trial_status

    assert trial_status({}, None, interrupted=True, asha=False) == "interrupted"
    assert trial_status({}, None, interrupted=True, asha=True) == "interrupted"
    assert trial_status({"step": 20, "loss": 1.0}, None, interrupted=False, asha=True) == "stopped"
    assert trial_status({}, None, interrupted=False, asha=False) == "failed"      # ASHA off: never "by ASHA"
    assert trial_status({"rayvit_status": "done"}, None, interrupted=True, asha=False) == "done"
    plan = plan_search(load_study(SEARCH_CPU))
    setting = plan.settings[0]
    o = trial_outcome(plan, "t01", setting, {}, None, 0.9, interrupted=True)
    assert o.status == "interrupted" and o.verdict.reason.startswith("interrupted: the search was stopped")
    o = trial_outcome(plan, "t01", setting, {}, None, 0.9)
    assert o.status == "failed" and "ended without its final report" in o.verdict.reason
    assert "ASHA" not in o.verdict.reason


def test_sigterm_during_the_trials_stops_them_and_exits_143_sigint_130():
    import signal as signals

    from rayvit.studies.search import SearchInterrupted
    from rayvit.studies.search.search_session import SearchSession, Signals, registered
    from rayvit.studies.search.tuner import InterruptStop

    session = SearchSession("signals-test", plan_search(load_study(SEARCH_CPU)), lambda line: None)
    stopper = InterruptStop(session.name)         # Tune's stopper finds the search's flag by its name
    # Whatever handled SIGTERM before (Python's default, or Ray's own once an earlier test started Ray in
    # this process) handles it again after the search.
    before = signals.getsignal(signals.SIGTERM)
    with registered(session), Signals(session) as caught:
        caught.tune = True
        assert not stopper.stop_all()
        os.kill(os.getpid(), signals.SIGTERM)        # while Tune runs: a flag for the stopper, no exception
        assert session.interrupted == "SIGTERM" and caught.signum == signals.SIGTERM
        assert stopper.stop_all()
        assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"     # Tune's own handler stays off
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signals.SIGINT)     # a second signal: at once
    assert signals.getsignal(signals.SIGTERM) is before
    assert SearchInterrupted("x", signals.SIGTERM).exit_code == 143
    assert SearchInterrupted("x", signals.SIGINT).exit_code == 130


# -- the default space and the cluster search's dry run ---------------------------------------------

def test_default_space_searches_the_optimizer_beside_precision_and_image_size():
    plan = plan_search(load_study(SEARCH_CPU))
    assert plan.space["optim.impl"] == ["loop", "foreach", "fused"]
    assert plan.baseline.cfg.optim.impl == "loop" and plan.baseline.cfg.precision.mode == "fp32"
    assert plan.study.search.screen
    # The baseline's own setting is not a trial of its own.
    assert all(plan.trial(0, "", s).config_hash != plan.baseline.config_hash for s in plan.settings)
    assert len(plan.settings) == len(list(itertools.product(*plan.space.values()))) - 1


def test_cluster_search_dry_run_prints_trials_screen_throughput_and_gpu_hours(capsys, tmp_path, monkeypatch):
    from rayvit.cli import search

    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    assert search(["--dry-run", "--config", str(CONFIGS / "search_a100.yaml")]) == 0
    printed = capsys.readouterr().out
    assert "24 setting(s) by grid + ASHA" in printed and "vit_b16" in printed and "on 8 GPU(s)" in printed
    rows = [line.split() for line in printed.splitlines() if line.strip().startswith(("baseline ", "t01 ", "t24 "))]
    assert [r[0] for r in rows] == ["baseline", "t01", "t24"]
    assert all(float(r[-5]) > 50 for r in rows)          # projected TFLOPS per A100 (column TFLOPS/GPU)
    assert "screen: the baseline and 24 setting(s)" in printed and "one GPU (A100)" in printed
    hours = re.search(r"estimated GPU-hours, every setting trained to its budget: ([\d.]+)", printed)
    assert hours and 1 < float(hours.group(1)) < 100
    assert "with ASHA" in printed and "nothing ran" in printed
    assert not (tmp_path / "m.db").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
