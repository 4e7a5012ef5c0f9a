"""A search's report: its rows and table, the best config it writes, its records in MLflow.

:mod:`rayvit.studies.search.run` runs the search; this module says what it found: each trial's line
and child run as it is judged, and at the end the table, the best config and the parent run's records.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from rayvit.config import rayvit_home
from rayvit.config_schema import Config
from rayvit.record import plots
from rayvit.record.tables import Column, cell, fmt, format_table, times, write_parquet
from rayvit.studies.outcome import Outcome, Report, last_line
from rayvit.studies.plan import SearchPlan, setting_label
from rayvit.studies.runner import StudyRun, print_where, with_interval
from rayvit.studies.search.judge import best_outcome, speedup
from rayvit.studies.search.screen import ScreenReport, Screened, saved_estimate
from rayvit.studies.search.search_session import SearchSession


@dataclasses.dataclass
class SearchReport(Report):
    """A search's report: the baseline, the best feasible outcome and the config written for it."""

    baseline: Optional[Outcome] = None
    best: Optional[Outcome] = None
    best_config_path: Optional[Path] = None
    objective: str = "tflops_per_chip"
    mode: str = "max"
    released_placement_groups: int = 0
    screen: Optional[ScreenReport] = None
    not_trained: dict[str, str] = dataclasses.field(default_factory=dict)   # label -> why (screen, stop rule)
    saved_seconds: float = 0.0
    saved_device_hours: float = 0.0


def _best_path(output: Optional[str | Path], name: str) -> Path:
    return Path(output) if output else rayvit_home() / "searches" / name / "best_config.yaml"


def _best_header(report: SearchReport, max_drop: float) -> list[str]:
    best, base = report.best, report.baseline
    gain = speedup(best.verdict.objective, base.verdict.objective, report.mode)
    return [
        f"Best feasible setting of rayvit search {report.name!r} (MLflow experiment {report.experiment!r}, "
        f"parent run {report.parent_run_id}).",
        f"Setting: {setting_label(best.point.setting)} ({best.point.key}); {report.objective} = "
        f"{fmt(best.verdict.objective, '.4g')}, {fmt(gain, '.2f')}x the baseline's.",
        f"Validation accuracy {fmt(best.result.metrics.get('val_accuracy'), '.2%')} against the baseline's "
        f"{base.result.metrics['val_accuracy']:.2%} (allowed drop: {max_drop * 100:.1f} points).",
        "Run it: rayvit sweep --config <this file>"]


# --------------------------------------------------------------------------------------------------
# Each outcome as it is judged: its MLflow record and its line


def record_outcome(run: StudyRun, o: Outcome, role: str) -> None:
    """The outcome's verdict as tags and figures; a child run of its own for trials (kind ``point``, so
    a rerun of the search finds its finished trials)."""
    tags = {"rayvit.role": role, "rayvit.trial": o.point.key, "setting": setting_label(o.point.setting),
            "feasible": str(o.verdict.feasible).lower(), "reason": o.verdict.reason[:500], "status": o.status}
    if o.verdict.beats_baseline is not None:
        tags["beats_baseline"] = str(o.verdict.beats_baseline).lower()
    figures = {"objective": o.verdict.objective, "accuracy_drop": o.verdict.accuracy_drop, "trial_seconds": o.seconds}
    if role == "baseline":
        run.tracker.set_tags(o.run_id, tags)
        run.tracker.log_metrics(o.run_id, figures, step=0)
        return
    tags.update({"strategy": o.point.cfg.parallel.strategy, "world_size": o.point.world_size})
    run.record(o, tags, figures, params={f"trial.{k}": v for k, v in o.point.setting.items()})
    if o.status == "interrupted":
        # Stopped by the user, not broken: MLflow's KILLED, as an interrupted sweep point.
        run.tracker.client.set_terminated(o.run_id, status="KILLED")


def progress_line(o: Outcome, plan: SearchPlan) -> str:
    """``[t01/12] impl=fused: FEASIBLE in 41 s; tflops_per_chip ...; why``."""
    v, s = o.verdict, plan.study.search
    figures = ""
    if o.result is not None:
        figures = (f"; {s.objective} {with_interval(o.result.metrics, s.objective, '.4g')}, val accuracy "
                   f"{fmt(o.result.metrics.get('val_accuracy'), '.2%')}")
    took = "reused" if o.status == "reused" else f"in {o.seconds:.0f} s"
    return (f"[{o.point.key}/{plan.num_trials}] {setting_label(o.point.setting)}: "
            f"{'FEASIBLE' if v.feasible else o.status if o.status in ('interrupted',) else 'infeasible'} "
            f"{took}{figures}; {v.reason}")


# --------------------------------------------------------------------------------------------------
# The report at the end


def finish_report(run: StudyRun, session: SearchSession, output: Optional[str | Path],
                  seconds: float) -> SearchReport:
    """The table, the best feasible setting beyond noise, what the screen saved, the parent run's records."""
    plan, baseline, screened = session.plan, session.baseline, session.screen
    s = plan.study.search
    outcomes = sorted(session.outcomes.values(), key=lambda o: o.point.key)
    best = best_outcome([baseline] + outcomes, plan.mode, beyond_noise=True) or baseline
    not_trained = dict(session.skipped)
    report = SearchReport(run.name, "search", run.experiment, run.uri, run.parent_id, outcomes, [],
                          seconds=seconds, baseline=baseline, best=best, objective=s.objective, mode=plan.mode,
                          released_placement_groups=session.released_placement_groups, screen=screened,
                          not_trained=not_trained)
    if screened is not None and not_trained:
        skipped = [c for c in screened.candidates if c.label in not_trained]
        report.saved_seconds, report.saved_device_hours = saved_estimate(
            skipped, screened.baseline, baseline.seconds if baseline.status == "done" else 0.0,
            plan.base.train.steps, plan.base.parallel.num_workers)
    report.rows = sort_rows(trial_rows(outcomes, baseline, plan.mode, screened, not_trained), plan.mode)
    report.best_config_path = write_best_config(
        plan.study.run if best is baseline else best.point.cfg, _best_path(output, run.name),
        _best_header(report, s.max_accuracy_drop))
    _log_parent_results(run, report)
    return report


# --------------------------------------------------------------------------------------------------
# Rows, the table, the best config


def trial_rows(outcomes: list[Outcome], baseline: Outcome, mode: str, screened: Optional[ScreenReport] = None,
               not_trained: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """One flat row per setting (baseline first): setting, status, verdict, objective, speedup, screen,
    conditions, figures; settings the screen kept from training are rows too, with why."""
    rows = []
    screens = {c.label: c for c in screened.candidates} if screened is not None else {}
    for o in [baseline] + [o for o in outcomes if o is not baseline]:
        v = o.verdict
        row: dict[str, Any] = {"trial": o.point.key, "setting": setting_label(o.point.setting), "status": o.status,
                               "feasible": v.feasible, "beats_baseline": v.beats_baseline, "reason": v.reason,
                               "objective": v.objective,
                               "speedup_vs_baseline": speedup(v.objective, baseline.verdict.objective, mode),
                               "accuracy_drop": v.accuracy_drop, "run_id": o.run_id,
                               "seconds": round(o.seconds, 1), "error": o.error}
        row.update(_screen_cells(screens.get(o.point.key)))
        row.update({f"set.{k}": val for k, val in o.point.setting.items()})
        if o.result is not None:
            row.update(o.result.row())
        rows.append(row)
    for label, why in (not_trained or {}).items():
        c = screens.get(label)
        if c is None:
            continue
        row = {"trial": label, "setting": setting_label(c.setting), "status": "not trained", "feasible": False,
               "beats_baseline": None, "reason": why, "objective": None, "speedup_vs_baseline": None,
               "accuracy_drop": None, "run_id": None, "seconds": 0.0, "error": None, **_screen_cells(c)}
        row.update({f"set.{k}": val for k, val in c.setting.items()})
        rows.append(row)
    return rows


def _screen_cells(c: Optional[Screened]) -> dict[str, Any]:
    if c is None or c.ratio is None:
        return {"screened_ratio": None, "screened_ratio_lo": None, "screened_ratio_hi": None}
    return {"screened_ratio": c.ratio.median, "screened_ratio_lo": c.ratio.lo, "screened_ratio_hi": c.ratio.hi}


def sort_rows(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Baseline first, then the best objective first; settings without one by their screened ratio."""
    sign = -1.0 if mode == "max" else 1.0
    return sorted(rows, key=lambda r: (r["trial"] != "baseline", r["objective"] is None,
                                       sign * (r["objective"] or 0.0), -(r.get("screened_ratio") or 0.0)))


def search_columns(objective: str, best: Optional[str]) -> list[Column]:
    spec = ".4g" if objective != "time_to_accuracy" else ".1f"

    def verdict(r: dict[str, Any]) -> str:
        if r["status"] == "not trained":
            return "not trained"
        if r["trial"] == "baseline":
            return "baseline"
        if not r["feasible"]:
            return "interrupted" if r["status"] == "interrupted" else "infeasible"
        if r.get("beats_baseline"):
            return "beats baseline"
        return "below baseline" if "below the baseline" in (r["reason"] or "") else "within noise"

    return [
        ("", lambda r: "*" if r["trial"] == best else ""), ("trial", cell("trial")), ("setting", cell("setting")),
        ("screened", lambda r: times(r.get("screened_ratio"))),
        (objective, cell("objective", spec)), ("vs base", lambda r: times(r["speedup_vs_baseline"])),
        ("val acc", cell("val_accuracy", ".2%")), ("drop pts", cell("accuracy_drop", "+.1f", scale=0.01)),
        ("verdict", verdict), ("reason", lambda r: _short_reason(r["reason"])),
    ]


def _short_reason(reason: str) -> str:
    """The table's reason: up to the interval detail (the trial's line and MLflow keep the whole text)."""
    reason = reason or ""
    return reason.split(": ", 1)[0] if "95% interval" in reason else reason


def search_table(rows: list[dict[str, Any]], objective: str, best: Optional[str] = None) -> str:
    """Every setting, baseline first then by objective, with its screen, verdict and why; ``*`` marks the best."""
    return format_table(rows, search_columns(objective, best))


def write_best_config(cfg: Config, path: str | Path, header: list[str]) -> Path:
    """Write ``cfg`` as YAML that ``load_config`` (and ``rayvit sweep --config``) reads back."""
    from rayvit.config import load_config

    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header) + cfg.to_yaml())
    load_config(path)   # what we write must load
    return path


def _log_parent_results(run: StudyRun, report: SearchReport) -> None:
    """On the parent run: the trials table (parquet + text), the accuracy-vs-throughput plot, the best config."""
    best, base = report.best, report.baseline
    s = run.study.search
    run.tracker.log_metrics(report.parent_run_id, {
        f"best_{s.objective}": best.verdict.objective,
        "best_speedup_vs_baseline": speedup(best.verdict.objective, base.verdict.objective, report.mode),
        "best_val_accuracy": best.result.metrics.get("val_accuracy"), "search_seconds": report.seconds}, step=0)
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "search_trials.txt"
        table.write_text(search_table(report.rows, s.objective, best.point.key) + "\n")
        files = [write_parquet(report.rows, Path(tmp) / "search_trials.parquet"), table]
        files.append(plots.search_figure(
            report.rows, Path(tmp) / "accuracy_vs_throughput.png", objective=s.objective,
            baseline_accuracy=base.result.metrics["val_accuracy"], max_accuracy_drop=s.max_accuracy_drop,
            best=best.point.key, title=f"{report.name}: accuracy against {s.objective}"))
        best_copy = Path(tmp) / "best_config.yaml"
        best_copy.write_text(report.best_config_path.read_text())
        files.append(best_copy)
        report.artifacts = run.finish(files, {
            "best_trial": best.point.key, "best_setting": setting_label(best.point.setting),
            "trials": len(report.outcomes), "feasible_trials": sum(o.verdict.feasible for o in report.outcomes),
            "released_placement_groups": report.released_placement_groups}, failed=bool(report.failed))


def print_summary(report: SearchReport, out: Callable[[str], None] = print) -> None:
    """The table of every setting, the best one and its speedup, what the screen saved, where it all went."""
    best, base = report.best, report.baseline
    out("")
    out(search_table(report.rows, report.objective, best.point.key))
    gain = speedup(best.verdict.objective, base.verdict.objective, report.mode)
    feasible = sum(o.verdict.feasible for o in report.outcomes)
    trained = sum(o.status != "reused" for o in report.outcomes)
    out(f"\n{len(report.outcomes)} trial(s) ({trained} trained now), {feasible} feasible, "
        f"{len(report.not_trained)} not trained, in {report.seconds:.0f} s.")
    if report.screen is not None:
        sc = report.screen
        out(f"The screen ({sc.seconds:.0f} s on {sc.device}) kept {len(report.not_trained)} of "
            f"{len(sc.candidates)} settings from training: about {report.saved_seconds / 60:.1f} min of trials, "
            f"{report.saved_device_hours:.3g} device-hours at {base.point.world_size} "
            f"{'GPU' if base.point.cfg.parallel.use_gpu else 'worker'}(s) per trial.")
    if best is base:
        noisy = [o for o in report.outcomes if o.verdict.feasible and o.verdict.beats_baseline is False
                 and (speedup(o.verdict.objective, base.verdict.objective, report.mode) or 0) > 1]
        out("No trial beat the baseline beyond noise within the accuracy budget: the best config is the baseline's"
            + (f" ({', '.join(f'{o.point.key} {speedup(o.verdict.objective, base.verdict.objective, report.mode):.2f}x' for o in noisy)}"
               " within noise of it)." if noisy else "."))
    else:
        out(f"Best: {best.point.key} ({setting_label(best.point.setting)}), {fmt(gain, '.2f')}x the baseline's "
            f"{report.objective}, beyond noise; {best.verdict.reason.split('; ', 1)[-1]}")
    for o in report.failed:
        out(f"ERROR {o.point.key} ({setting_label(o.point.setting)}): {last_line(o.error or '')}")
    out(f"best config: {report.best_config_path}")
    out(f"  run it:  rayvit sweep --config {report.best_config_path}")
    print_where(report, out)
