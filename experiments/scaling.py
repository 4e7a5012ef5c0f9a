"""Scaling sweeps (every strategy at every worker count, against DDP) and the optimization ladder.

Locally, with no arguments: a local Ray instance runs the CPU default (a tiny ViT at 1 and 2 workers,
ddp + fsdp + fairscale_oss) in a few minutes. On a cluster:

    ray job submit --working-dir . -- python experiments/scaling.py --config experiments/configs/study_a100.yaml

Results go to MLflow: one experiment per config, a parent run per sweep (curves keyed by chip count,
scaling/ladder PNGs, results.parquet) and a child run per point. The last lines printed say how to
browse them. Exit status: 0 if every point finished, 1 if any failed, 2 if nothing could start
(bad config, unreachable tracking store, cluster too small), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout (or a `ray job submit --working-dir` copy) without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "cpu_default.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scaling.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""examples:
  python experiments/scaling.py                                  # CPU default sweep
  python experiments/scaling.py --dry-run                        # the planned points and their resources
  python experiments/scaling.py --config experiments/configs/ladder_cpu.yaml
  python experiments/scaling.py --set sweep.worker_counts=1,2 --set train.steps=10 --name quick
  python experiments/scaling.py --name quick                     # rerun: finished points are reused
  python experiments/scaling.py --project --config experiments/configs/study_a100.yaml \
      --hardware a100-40gb h100-sxm                              # projected table + PNG, nothing runs

tracking store: tracking.uri if set, else $MLFLOW_TRACKING_URI, else sqlite:///~/.rayvit/mlflow.db
($RAYVIT_HOME moves it). Sweep names are unique per experiment; reusing one resumes that sweep.""")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="YAML config (default: experiments/configs/cpu_default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set sweep.strategies=ddp,fsdp "
                             "--set train.steps=10 (repeatable)")
    parser.add_argument("--name", help="sweep name (the MLflow parent run); an existing name resumes "
                                       "that sweep. Default: sweep.name, else <mode>-<date-time>")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment, else the "
                                             "config file's name)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planned points and the resources each needs, then exit")
    parser.add_argument("--address", help="Ray cluster to attach to (default: $RAY_ADDRESS, as set by "
                                          "`ray job submit`; else a local instance)")
    projection = parser.add_argument_group(
        "projection (no Ray, nothing runs)",
        "--project prints, per chip count and strategy (ddp, fsdp with and without reshard_after_forward, "
        "fairscale_oss, fairscale_fsdp, as the config allows): step time, images/s and TFLOPS per chip, MFU, "
        "ratio to DDP, scaling efficiency, the dominant term (compute, exposed communication, optimizer), "
        "memory per rank, whether it fits the chip, and the largest batch that fits; then writes a PNG of "
        "projected TFLOPS per chip against chips. Compute comes from --measured, else the chip's peak times a "
        "stated efficiency; links and memory from the hardware profile (rayvit/projection/profiles.py).")
    projection.add_argument("--project", action="store_true", help="project the config's sweep instead of running it")
    projection.add_argument("--hardware", nargs="+", default=None, metavar="PROFILE",
                            help="hardware profiles: a100-40gb, a100-80gb, h100-sxm, h200, cpu (default: "
                                 "a100-40gb on GPU configs, cpu otherwise)")
    projection.add_argument("--chips", type=int, nargs="+", help="chip counts (default: sweep.worker_counts)")
    projection.add_argument("--measured", metavar="JSON",
                            help="a single-chip rate: a point's result.json, `python -m rayvit.bench --json` "
                                 "output or experiments/gpu_check.py's JSON (needed for the cpu profile)")
    projection.add_argument("--out-dir", default="results", help="where the PNG goes (default: results/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.project:
        return project(args)
    from rayvit.config import ConfigError, load_config
    from rayvit.sweep import describe_plan, eprint, plan, print_summary, run_sweep
    from rayvit.tracking import TrackingError
    from rayvit.trainer import ClusterTooSmall

    overrides = list(args.overrides) + ([f"sweep.name={args.name}"] if args.name else [])
    try:
        cfg = load_config(args.config, overrides)
        points = plan(cfg)
        if args.dry_run:
            print(f"config: {args.config}")
            print(describe_plan(cfg, points))
            return 0
        experiment = args.experiment or cfg.tracking.experiment or Path(args.config).stem
        report = run_sweep(cfg, experiment=experiment, address=args.address)
    except (ConfigError, TrackingError, ClusterTooSmall) as e:
        eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        eprint("interrupted: the running point and the sweep are marked KILLED; rerun with the same "
               "--name to resume")
        return 130
    print_summary(report)
    return report.exit_code


def project(args: argparse.Namespace) -> int:
    """``--project``: the projection table and PNG; imports neither Ray nor torch.distributed."""
    from rayvit.config import ConfigError, load_config
    from rayvit.projection import cli

    try:
        cfg = load_config(args.config, args.overrides)
        hardware = args.hardware or (["a100-40gb"] if cfg.parallel.use_gpu else ["cpu"])
        cli.run(cfg, hardware=hardware, chips=args.chips, measured=args.measured, out_dir=args.out_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
