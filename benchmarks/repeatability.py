"""Does the default sweep repeat? It runs ``python experiments/scaling.py`` several times, each in a fresh
MLflow store and rayvit home (a fresh local Ray instance too), and prints per point each run's median
and 95% interval, the wall time of each run from the command's start (Ray's start included), and the
checks a scaling study needs before anyone decides on its numbers:

- every run finishes within ``--budget-s`` (default 60 s);
- every multi-worker point's ``speedup_vs_ddp`` median in each run lies within ``--ratio-tolerance``
  (default 10%) of every other run's;
- every multi-worker point's projection (from the run's own 1-worker DDP point, its measured links and
  its strategy's own per-step overhead measured at that strategy's 1-worker point) lies within
  ``--projection-tolerance`` (default 20%) of its measured median.

    python benchmarks/repeatability.py [--runs 3] [--set section.key=value ...]

Figures depend on the machine and on what else runs on it: run it on an otherwise idle machine and say
which CPU the figures came from (``lscpu``). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "experiments" / "scaling.py"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="how many times to run the sweep (default 3)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="passed to every sweep, e.g. --set sweep.rounds=5")
    parser.add_argument("--budget-s", type=float, default=60.0, help="wall-time goal per run (default 60)")
    parser.add_argument("--ratio-tolerance", type=float, default=0.10)
    parser.add_argument("--projection-tolerance", type=float, default=0.20)
    parser.add_argument("--json", help="also write every run's rows to this JSON file")
    args = parser.parse_args(argv)

    print(f"CPU: {cpu_name()}; {os.cpu_count()} logical CPUs; native bf16: {native_bf16()}")
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            seconds, rows = run_once(Path(tmp), i, args.overrides)
        runs.append({"seconds": seconds, "rows": rows})
        print(f"run {i + 1}/{args.runs}: {seconds:.1f} s from the command's start")
    print_points(runs)
    failures = checks(runs, args)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1, default=str))
    print("\n" + ("every check passed" if not failures else f"{len(failures)} check(s) failed"))
    return 1 if failures else 0


def run_once(root: Path, index: int, overrides: list[str]) -> tuple[float, list[dict[str, Any]]]:
    """One default sweep as a user runs it; its rows (results.parquet) and each point's projection."""
    import pyarrow.parquet as pq
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{root}/mlflow.db", RAYVIT_HOME=str(root / "home"))
    cmd = [sys.executable, str(SCRIPT), "--name", f"repeat-{index + 1}"]
    for override in overrides:
        cmd += ["--set", override]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"run {index + 1} failed with status {proc.returncode}")
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    (parent,) = client.search_runs([exp.experiment_id], "tags.`rayvit.kind` = 'sweep'")
    rows = pq.read_table(client.download_artifacts(parent.info.run_id, "results.parquet", str(root))).to_pylist()
    projected = {c.data.tags["rayvit.point"]: c.data.metrics.get("projected_images_per_sec_per_chip")
                 for c in client.search_runs([exp.experiment_id], "tags.`rayvit.kind` = 'point'")}
    for row in rows:
        row["projected_images_per_sec_per_chip"] = projected.get(row["point"])
        row.pop("round_step_times", None)
    return seconds, rows


def print_points(runs: list[dict]) -> None:
    from rayvit.formats import fmt
    from rayvit.studies.runner import with_interval

    points = list(dict.fromkeys(r["point"] for run in runs for r in run["rows"]))
    print(f"\n{'point':<18} {'run':>3}  {'img/s/chip (95% CI)':<24} {'vs DDP (95% CI)':<20} {'verdict':<20} "
          f"{'projected img/s':>15}")
    for key in points:
        for i, run in enumerate(runs):
            r = next((x for x in run["rows"] if x["point"] == key), None)
            if r is None or r["status"] not in ("done", "reused"):
                print(f"{key:<18} {i + 1:>3}  {'(not measured)'}")
                continue
            print(f"{key:<18} {i + 1:>3}  {with_interval(r, 'images_per_sec_per_chip', '.1f'):<24} "
                  f"{with_interval(r, 'speedup_vs_ddp', '.2f', 'x'):<20} {r.get('verdict') or '-':<20} "
                  f"{fmt(r.get('projected_images_per_sec_per_chip'), '.1f'):>15}")


def checks(runs: list[dict], args) -> list[str]:
    failures = []
    print("\nchecks:")
    for i, run in enumerate(runs):
        ok = run["seconds"] <= args.budget_s
        print(f"  {'ok ' if ok else 'BAD'} run {i + 1} took {run['seconds']:.1f} s (goal: at most {args.budget_s:.0f} s)")
        failures += [] if ok else [f"run {i + 1} time"]
    multi = sorted({r["point"] for run in runs for r in run["rows"] if r["world_size"] > 1})
    for key in multi:
        rows = [next((x for x in run["rows"] if x["point"] == key), {}) for run in runs]
        medians = [r.get("speedup_vs_ddp") for r in rows]
        if all(isinstance(m, float) for m in medians) and not key.startswith("ddp/"):
            spread = max(medians) / min(medians) - 1
            ok = spread <= args.ratio_tolerance
            print(f"  {'ok ' if ok else 'BAD'} {key}: speedup_vs_ddp medians {', '.join(f'{m:.2f}' for m in medians)} "
                  f"differ by at most {spread:.0%} (goal: {args.ratio_tolerance:.0%})")
            failures += [] if ok else [f"{key} speedup"]
        for i, r in enumerate(rows):
            measured, projected = r.get("images_per_sec_per_chip"), r.get("projected_images_per_sec_per_chip")
            if not measured or not projected:
                print(f"  BAD {key} run {i + 1}: no projection")
                failures.append(f"{key} projection {i + 1}")
                continue
            error = projected / measured - 1
            ok = abs(error) <= args.projection_tolerance
            print(f"  {'ok ' if ok else 'BAD'} {key} run {i + 1}: projected {projected:.1f} img/s/chip against the "
                  f"measured median {measured:.1f}: {error:+.0%} (goal: within {args.projection_tolerance:.0%})")
            failures += [] if ok else [f"{key} projection {i + 1}"]
    walls = [run["seconds"] for run in runs]
    print(f"  wall times: {', '.join(f'{w:.1f}' for w in walls)} s (median {median(walls):.1f} s)")
    return failures


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def native_bf16() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return ", ".join(found) if found else "no (AVX2-class: bf16 is emulated)"


if __name__ == "__main__":
    sys.exit(main())
