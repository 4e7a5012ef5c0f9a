"""Projected against measured per-chip throughput for the default CPU sweep's 2-worker points.

    python benchmarks/projection_vs_measured.py [--set section.key=value ...]

Runs the default sweep (experiments/configs/cpu_default.yaml: ddp, fsdp, fairscale_oss at 1 and 2
workers, gloo) through ``rayvit.studies.sweep.run_sweep`` into a throw-away MLflow store: the 1-worker points
and the 2-worker points, the first of which also runs the gloo collective microbenchmark on its workers
after training, in one run. Then it projects every point
from the DDP 1-worker measurement plus the measured links (``rayvit.projection``) and prints projected
and measured images/s per chip side by side with the error. Goal: every 2-worker point within 20%.
Nothing is fitted to the 2-worker measurements: they are only compared against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "experiments" / "configs" / "cpu_default.yaml"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--json", help="also write the comparison to this JSON file")
    args = parser.parse_args(argv)
    from rayvit.config import load_study

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        cfg = load_study(CONFIG, ["sweep.name=projection-benchmark", *args.overrides])
        rows = run(cfg, tmp)
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    bad = [r for r in rows if r["chips"] > 1 and abs(r["error"]) > 0.20]
    print(f"\n{sum(r['chips'] > 1 for r in rows) - len(bad)} of {sum(r['chips'] > 1 for r in rows)} "
          f"multi-worker points within 20% of their projection")
    return 1 if bad else 0


def run(cfg, tmp: str) -> list[dict]:
    import mlflow

    from rayvit.projection import insweep
    from rayvit.projection.profiles import describe_links as describe
    from rayvit.studies.sweep import run_sweep

    report = run_sweep(cfg, experiment="projection-benchmark")
    path = mlflow.MlflowClient().download_artifacts(report.parent_run_id, "links.json", tmp)
    links = json.loads(Path(path).read_text())
    print("\n" + describe(links))
    rows = []
    for i, outcome in enumerate(report.outcomes):
        if not outcome.ok:
            rows.append({"point": outcome.point.key, "chips": outcome.point.world_size, "error": float("nan")})
            continue
        proj = insweep.project_outcome(outcome, report.outcomes, links)
        measured = outcome.result.metrics["images_per_sec_per_chip"]
        rows.append({"point": outcome.point.key, "chips": outcome.point.world_size,
                     "measured_img_s": measured, "projected_img_s": proj.images_per_sec_per_chip,
                     "error": proj.images_per_sec_per_chip / measured - 1,
                     "measured_step_ms": 1e3 * outcome.point.cfg.train.batch_size / measured,
                     "projected_step_ms": proj.step_s * 1e3, "compute_ms": proj.compute_s * 1e3,
                     "exposed_comm_ms": proj.exposed_comm_s * 1e3, "optimizer_ms": proj.optimizer_s * 1e3,
                     "messages": proj.messages, "note": "; ".join(proj.notes)})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'point':<18} {'measured img/s':>14} {'projected':>10} {'error':>7}   {'step ms meas/proj':>18}  "
          f"{'compute':>7} {'comm':>6} {'optim':>6} {'msgs':>5}")
    for r in rows:
        if "measured_img_s" not in r:
            print(f"{r['point']:<18} FAILED")
            continue
        print(f"{r['point']:<18} {r['measured_img_s']:>14.1f} {r['projected_img_s']:>10.1f} {r['error']:>+7.1%}   "
              f"{r['measured_step_ms']:>8.1f} / {r['projected_step_ms']:<7.1f}  {r['compute_ms']:>7.1f} "
              f"{r['exposed_comm_ms']:>6.1f} {r['optimizer_ms']:>6.1f} {r['messages']:>5d}"
              + (f"  ({r['note']})" if r["note"] else ""))


if __name__ == "__main__":
    sys.exit(main())
