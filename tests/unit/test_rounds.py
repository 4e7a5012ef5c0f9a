"""Figures you can repeat: interleaved rounds, medians with intervals, paired ratios, worker groups.

Synthetic step times where the arithmetic is the subject; a real one-process training loop (no Ray)
where the rounds themselves are.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import subprocess
import sys

import pytest

from rayvit import stats
from rayvit.config import load_study
from rayvit.results import RunResult
from rayvit.studies.derived import add_derived, rows_of
from rayvit.studies.outcome import Outcome
from rayvit.studies.plan import plan, worker_groups
from rayvit.studies.sweep import sweep_table
from rayvit.worker.rounds import measure_rounds, round_order

from helpers_cli import CONFIGS
from helpers_data import config
from helpers_results import make_result


# -- the interleaving order -------------------------------------------------------------------------

def test_rounds_rotate_so_every_run_takes_every_position():
    assert round_order(3, 3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert round_order(3, 4)[3] == [0, 1, 2]
    assert round_order(1, 3) == [[0], [0], [0]]
    order = round_order(4, 4)
    for run in range(4):
        assert sorted(r.index(run) for r in order) == [0, 1, 2, 3]


# -- the interval arithmetic -------------------------------------------------------------------------

def test_blocks_cover_every_timed_step():
    assert stats.cut([0.1] * 15, 5) == [(5, pytest.approx(0.5))] * 3
    # A short tail joins the last block; a short round gets blocks of fewer steps.
    assert [b[0] for b in stats.cut([0.1] * 17, 5)] == [5, 5, 7]
    assert [b[0] for b in stats.cut([0.1] * 4, 5)] == [2, 2]
    assert stats.cut([0.1], 5) == [(1, 0.1)]
    assert stats.cut([], 5) == [] and stats.cut([float("nan"), 0.2], 5) == [(1, 0.2)]


def test_median_over_rounds_with_an_interval_that_holds_it():
    rounds = [stats.cut([0.10] * 15), stats.cut([0.11] * 15), stats.cut([0.20] * 15)]
    rate = stats.estimate(rounds, lambda s: 16 / s)
    assert rate.median == pytest.approx(16 / 0.11) and rate.rounds == 3
    # Resampling rounds reaches the slow round's and the fast round's rates, no further.
    assert rate.lo == pytest.approx(16 / 0.20) and rate.hi == pytest.approx(16 / 0.10)
    # Seeded: the same measurements give the same interval.
    assert stats.estimate(rounds, lambda s: 16 / s) == rate
    # Identical rounds have no spread.
    same = stats.estimate([stats.cut([0.1] * 10)] * 3, lambda s: 16 / s)
    assert same.lo == same.median == same.hi == pytest.approx(160)
    assert stats.estimate([[], []], lambda s: s) is None


def test_noisy_blocks_widen_the_interval_of_one_round():
    rng = random.Random(1)
    quiet = [stats.cut([0.1 * (1 + 0.01 * rng.random()) for _ in range(30)])]
    noisy = [stats.cut([0.1 * (1 + 0.5 * rng.random()) for _ in range(30)])]
    width = {name: (e.hi - e.lo) / e.median for name, e in
             (("quiet", stats.estimate(quiet, lambda s: 1 / s)), ("noisy", stats.estimate(noisy, lambda s: 1 / s)))}
    assert width["noisy"] > 5 * width["quiet"] > 0


def test_paired_ratio_cancels_what_both_sides_of_a_round_share():
    # Round 2 ran on a busy machine: both strategies slowed by 2x. Within each round B is 1.25x A.
    a = [stats.cut([0.100] * 10), stats.cut([0.200] * 10), stats.cut([0.101] * 10)]
    b = [stats.cut([0.080] * 10), stats.cut([0.160] * 10), stats.cut([0.081] * 10)]
    rate = lambda s: 1 / s  # noqa: E731
    paired = stats.paired_ratio(b, a, rate, rate)
    assert paired.median == pytest.approx(1.25, rel=0.01)
    assert paired.hi - paired.lo < 0.02
    assert paired.verdict(1.0) == "above"
    # Unpaired, the busy round's spread shows up in the ratio.
    unpaired = stats.unpaired_ratio(b, a, rate, rate)
    assert unpaired.hi - unpaired.lo > 10 * (paired.hi - paired.lo)
    # Rounds either side lacks are left out.
    assert stats.paired_ratio(b[:2] + [[]], a, rate, rate).rounds == 2


def test_an_interval_holding_the_reference_is_noise():
    est = stats.Estimate(1.03, 0.97, 1.10, 3)
    assert est.verdict(1.0) == "within noise" and est.text(".2f", "x") == "1.03x (0.97-1.10)"
    assert stats.Estimate(0.67, 0.61, 0.72, 3).verdict(1.0) == "below"
    # The rule's edge: an interval that touches the reference holds it.
    assert stats.Estimate(1.05, 1.0, 1.10, 3).verdict(1.0) == stats.WITHIN_NOISE
    assert stats.Estimate(0.95, 0.90, 1.0, 3).verdict(1.0) == stats.WITHIN_NOISE


def test_a_measurement_that_sees_less_widens_its_interval_and_keeps_the_rule():
    """The screen's few steps in one process are never taken as surer than +-5%: the interval widens to
    that floor (never narrows), and the same beyond-noise rule then decides."""
    tight = stats.Estimate(1.03, 1.02, 1.04, 3)
    assert tight.verdict() == stats.ABOVE
    wide = tight.widened(0.05)
    assert (wide.median, wide.rounds) == (1.03, 3)
    assert wide.lo == pytest.approx(1.03 * 0.95) and wide.hi == pytest.approx(1.03 * 1.05)
    assert wide.verdict() == stats.WITHIN_NOISE
    already = stats.Estimate(1.5, 1.1, 1.9, 3)
    assert already.widened(0.05) == already              # wider than the floor: unchanged


def _result(strategy, seconds_per_round, world_size=2, steps=10):
    """A round's result as the loop returns it: step times and the figures they give."""
    r = make_result(strategy, world_size, 1.0, 16 / seconds_per_round)
    r.step_times = [seconds_per_round] * steps
    r.metrics.update(train_flops_per_image=1e9, peak_tflops=2.0)
    return r


def test_a_points_figures_are_medians_over_its_rounds_with_intervals():
    rounds = [_result("fsdp", s) for s in (0.10, 0.12, 0.11)]
    point = RunResult.of_rounds(rounds, [(0, 1), (1, 0), (2, 2)])
    m = point.metrics
    assert m["rounds"] == 3 and m["timed_steps"] == 30
    assert m["images_per_sec_per_chip"] == pytest.approx(16 / 0.11)
    assert m["images_per_sec_per_chip_lo"] == pytest.approx(16 / 0.12)
    assert m["images_per_sec_per_chip_hi"] == pytest.approx(16 / 0.10)
    assert m["images_per_sec"] == pytest.approx(2 * 16 / 0.11)
    assert m["tflops_per_chip"] == pytest.approx(1e9 * 16 / 0.11 / 1e12)
    assert m["mfu"] == pytest.approx(m["tflops_per_chip"] / 2.0)
    assert (m["step_time_mean_s_lo"], m["step_time_mean_s"], m["step_time_mean_s_hi"]) == pytest.approx((0.10, 0.11, 0.12))
    assert [(r["round"], r["slot"]) for r in point.rounds] == [(0, 1), (1, 0), (2, 2)]
    assert RunResult.from_dict(point.to_dict()).rounds == point.rounds
    with pytest.raises(ValueError):
        RunResult.of_rounds([])


def _outcome(key, strategy, world_size, seconds):
    from rayvit.studies.plan import Point

    study = load_study(CONFIGS / "cpu_default.yaml")
    cfg = study.run.replace({"parallel.strategy": strategy, "parallel.num_workers": world_size})
    result = RunResult.of_rounds([_result(strategy, s, world_size) for s in seconds])
    return Outcome(Point(1, key, strategy, world_size, cfg), "done", result, run_id=None)


def test_speedup_vs_ddp_is_paired_by_round_and_says_when_it_is_noise():
    outcomes = [_outcome("ddp/w2", "ddp", 2, [0.10, 0.20, 0.10]),
                _outcome("fsdp/w2", "fsdp", 2, [0.125, 0.25, 0.125]),        # 0.8x in every round
                _outcome("fairscale_oss/w2", "fairscale_oss", 2, [0.09, 0.22, 0.10])]
    rows = rows_of(outcomes, "scaling")
    ddp, fsdp, oss = rows
    assert (ddp["speedup_vs_ddp"], ddp["speedup_vs_ddp_lo"], ddp["speedup_vs_ddp_hi"], ddp["verdict"]) == (
        1.0, 1.0, 1.0, "DDP")
    assert fsdp["speedup_vs_ddp"] == pytest.approx(0.8) and fsdp["speedup_vs_ddp_hi"] < 0.81
    assert fsdp["verdict"] == "slower than DDP"
    assert oss["speedup_vs_ddp_lo"] < 1.0 < oss["speedup_vs_ddp_hi"]
    assert oss["verdict"] == "within noise of DDP"
    table = sweep_table(rows, "scaling")
    assert "0.80x (0.80-0.80)" in table and "within noise of DDP" in table and "slower than DDP" in table
    line = next(t for t in table.splitlines() if t.startswith("fsdp/w2"))
    assert f"{fsdp['images_per_sec_per_chip']:.1f} ({fsdp['images_per_sec_per_chip_lo']:.1f}-" in line
    # Rows from older runs carry no rounds: the ratio of medians, and no verdict.
    for row in rows:
        row["round_step_times"] = None
    add_derived(rows, "scaling")
    assert fsdp["speedup_vs_ddp"] == pytest.approx(0.8) and fsdp.get("speedup_vs_ddp_lo") is None
    assert fsdp["verdict"] is None


# -- one worker group per worker count -----------------------------------------------------------------

def test_points_at_one_worker_count_share_a_worker_group():
    points = plan(load_study(CONFIGS / "cpu_default.yaml"))
    assert [[p.key for p in g] for g in worker_groups(points)] == [
        ["ddp/w1", "fsdp/w1", "fairscale_oss/w1"], ["ddp/w2", "fsdp/w2", "fairscale_oss/w2"]]
    assert [len(g) for g in worker_groups(points, share_workers=False)] == [1] * 6
    # The ladder's rungs differ in precision, strategy and image size, and still share their workers.
    ladder = plan(load_study(CONFIGS / "ladder_cpu.yaml"))
    assert [len(g) for g in worker_groups(ladder)] == [len(ladder)]
    # A checkpointing point runs alone (its recovery would retrain the group).
    alone = plan(load_study(CONFIGS / "cpu_default.yaml", ["train.checkpoint_every=5", "sweep.worker_counts=1"]))
    assert [len(g) for g in worker_groups(alone)] == [1, 1, 1]


def test_a_run_that_raises_in_its_round_leaves_the_others_measured():
    """Real training in this process: the failing run is recorded with its error after its first round
    and left out of later ones; the others get every round, in rotated slots."""
    ok = config("model.hidden_dim=32", "model.depth=1", "model.num_heads=2", "model.mlp_dim=64",
                "model.patch_size=8", "train.steps=4", "train.warmup_steps=1", "train.batch_size=4")
    broken = ok.replace({"train.fail_at_step": 2})
    seen, between = [], []
    outcomes = measure_rounds([ok, broken, ok.replace({"optim.impl": "foreach"})], 3,
                              on_round=lambda i, r, slot, result, error: seen.append((i, r, slot, error is None)),
                              between_rounds=lambda r: between.append((r, len(seen))))
    assert between == [(0, 3), (1, 5), (2, 7)]          # after each round's last run
    assert outcomes[1]["error"] and "injected fault on rank 0 at step 2" in outcomes[1]["error"]
    assert outcomes[1]["rounds"] == []
    for i in (0, 2):
        assert outcomes[i]["error"] is None and len(outcomes[i]["rounds"]) == 3
        assert all(len(r["step_times"]) == 3 for r in outcomes[i]["rounds"])
    assert outcomes[2]["places"] == [(0, 2), (1, 0), (2, 0)]  # the failed run leaves its slot
    assert seen[:3] == [(0, 0, 0, True), (1, 0, 1, False), (2, 0, 2, True)]
    assert [s[0] for s in seen[3:]] == [2, 0, 2, 0]
    point = RunResult.of_rounds([RunResult.from_dict(r) for r in outcomes[0]["rounds"]], outcomes[0]["places"])
    assert point.metrics["rounds"] == 3 and math.isfinite(point.metrics["images_per_sec_per_chip_lo"])
    # A round's result travels to the driver through the progress board's process, which has no torch:
    # unpickling it there must not import torch (a TorchVersion would, for ~1.3 s of a core, while the
    # group's next run times its steps).
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(outcomes[0]["rounds"][0]),
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_ranks_whose_collective_counts_differ_on_a_group_are_named_out_of_step():
    """The comparison every rank makes after a run (the two-rank case: tests/system/test_rank_failures.py):
    per process group, among the ranks that belong to it (a one-rank group is nobody's business)."""
    from rayvit.worker.agree import out_of_step

    assert out_of_step([{"0": 9, "1": 4}, {"0": 9, "1": 4}]) == ""
    assert out_of_step([{"0": 9, "5": 1}, {"0": 9, "6": 3}]) == ""
    assert out_of_step([{"0": 9, "1": 4}, {"0": 10, "1": 4}, {"0": 9, "1": 5}]) == (
        "process group '0': rank 0 issued 9 collectives, rank 1 10, rank 2 9; "
        "process group '1': rank 0 issued 4 collectives, rank 1 4, rank 2 5")


def test_a_local_instance_starts_no_preemption_watcher_and_a_users_choice_stays(monkeypatch):
    """Ray Train's preemption watcher starts after a group's workers, while its first steps are timed: off
    on a local instance rayvit started (nothing there can be drained), Ray's default elsewhere. The settings
    are returned for the trainer's fit() to apply for its own duration, never written here."""
    from rayvit.launch import torch_trainer as trainer

    cfg = config()
    for name in (trainer.PREEMPTION_WATCHER_ENV, trainer.HEALTH_CHECK_ENV, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)          # restored after the test
    before = dict(os.environ)
    monkeypatch.setattr(trainer, "started_local", lambda: True)
    env = trainer.train_environment(cfg)
    assert env[trainer.PREEMPTION_WATCHER_ENV] == "0"
    assert env[trainer.HEALTH_CHECK_ENV] == "0.5" and trainer.train_environment(cfg, reports=False)[trainer.HEALTH_CHECK_ENV] == "2"
    monkeypatch.setattr(trainer, "started_local", lambda: False)
    env = trainer.train_environment(cfg)
    assert env[trainer.PREEMPTION_WATCHER_ENV] is None          # unset: Ray's default
    assert dict(os.environ) == before
    monkeypatch.setenv(trainer.PREEMPTION_WATCHER_ENV, "1")
    monkeypatch.setenv(trainer.HEALTH_CHECK_ENV, "3")
    monkeypatch.setattr(trainer, "started_local", lambda: True)
    env = trainer.train_environment(cfg)
    assert trainer.PREEMPTION_WATCHER_ENV not in env and trainer.HEALTH_CHECK_ENV not in env   # the user's stay
