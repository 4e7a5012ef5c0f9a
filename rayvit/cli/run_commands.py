"""``rayvit sweep`` and ``rayvit search``: the commands that run on a Ray cluster and record in MLflow.
``experiments/scaling.py`` and ``experiments/search.py`` are the same commands as files, for ``ray job submit``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from rayvit.cli.options import PLAN_POINTER, TRACKING_HELP, described_parser, eprint, guarded, run_options
from rayvit.config import SHIPPED_CONFIGS as CONFIGS

SWEEP_DESCRIPTION = """Scaling sweeps (every strategy at every worker count, against DDP) and the optimization ladder.

Locally, with no arguments: a local Ray instance runs the CPU default (a tiny ViT at 1 and 2 workers,
ddp + fsdp + fairscale_oss) in a few minutes. On a cluster:

    ray job submit --working-dir . -- python experiments/scaling.py --config experiments/configs/study_a100.yaml

Results go to MLflow: one experiment per config, a parent run per sweep (curves keyed by chip count,
scaling/ladder PNGs, results.parquet) and a child run per point. The last lines printed say how to
browse them. Exit status: 0 if every point finished, 1 if any failed, 2 if nothing could start
(bad config, unreachable tracking store, cluster too small), 130 when interrupted."""

SWEEP_EXAMPLES = f"""examples:
  %(prog)s                                  # CPU default sweep
  %(prog)s --dry-run                        # the planned points and their resources
  %(prog)s --config experiments/configs/ladder_cpu.yaml
  %(prog)s --set sweep.worker_counts=1,2 --set train.steps=10 --name quick
  %(prog)s --name quick                     # rerun: finished points are reused

{TRACKING_HELP}. Sweep names are unique per experiment; reusing one resumes that sweep.
To project a sweep onto chips you have not rented, without running it: `rayvit project` (its --help; it
takes the same --config and --set; --project was removed from this command)."""

SEARCH_DESCRIPTION = """Find the fastest precision / image size / optimizer setting whose accuracy stays within budget.

The study's fastest settings (bigger images, full half precision) can cost accuracy. This search trains
a baseline (the reference setting: fp32, the base image size, the baseline optimizer) on a real dataset,
then every setting of the search.space for the same budget, each as a multi-worker Ray Train run
launched from a Ray Tune trial. A setting is feasible when its validation accuracy is at most
search.max_accuracy_drop (absolute: 0.02 = two points) below the baseline's and its loss never went
NaN/inf. The fastest feasible one, by search.objective (tflops_per_chip, images_per_sec or
time_to_accuracy), is written as a config file that `rayvit sweep --config` runs.

Results go to MLflow: a parent run per search (the trials table, an accuracy-against-throughput plot with
the constraint line and the best setting marked, the best config) and a child run per trial (params,
figures, a `feasible` tag and the reason). Rerunning a search of the same name reuses its baseline and
resumes its unfinished trials. Exit status: 0 when the search finished, 1 if a trial failed with an
error (diverged or infeasible trials are results, not errors), 2 if nothing could start (bad config or
search space, unreachable tracking store, cluster too small, baseline without an accuracy), 130 on
SIGINT and 143 on SIGTERM (the trials are stopped and no best config is written).

Before any trial (grid searches, search.screen=true by default) every setting's training step is timed
for a few steps in one process on one device of the kind the trials get; trials then run best
screened first, settings that cannot beat the baseline or the best feasible trial by more than the
screen's noise are not trained, and a trial beats the baseline only when its objective's 95% interval
lies above the baseline's."""

SEARCH_EXAMPLES = f"""examples:
  %(prog)s                                   # CPU default search
  %(prog)s --set search.max_accuracy_drop=0.01 --output best.yaml
  %(prog)s --set 'search.space={{precision.mode: [amp, pure]}}' --name quick
  %(prog)s --set search.algorithm=optuna --set search.num_samples=12
  %(prog)s --set search.asha=true            # stop trials that fall behind early
  %(prog)s --set search.screen=false         # train every setting, in grid order
  %(prog)s --dry-run --config experiments/configs/search_a100.yaml   # trials, screen, projected cost
  rayvit sweep --config best.yaml            # then scale the winner

searchable keys: precision.mode, precision.dtype, model.image_size, optim.name, optim.impl,
model.classifier, model.layout, parallel.strategy (the budget: train.steps, batch and data stay fixed).
{TRACKING_HELP}."""


def sweep_parser(prog: str) -> argparse.ArgumentParser:
    parser = described_parser(prog, SWEEP_DESCRIPTION, SWEEP_EXAMPLES)
    run_options(parser, CONFIGS / "cpu_default.yaml", "sweep")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment, else the "
                                             "config file's name)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planned points and the resources each needs, then exit")
    return parser


def sweep(argv: Sequence[str], prog: str = "rayvit sweep") -> int:
    parser = sweep_parser(prog)
    if "--project" in argv:
        parser.error("--project was removed: `rayvit project` projects a sweep without running it (the same "
                     "--config and --set, with --hardware, --chips, --measured; `rayvit project --help`)")
    args = parser.parse_args(argv)

    def run() -> int:
        from rayvit.config import load_study
        from rayvit.studies.plan import describe_plan, plan
        from rayvit.studies.sweep import print_summary, run_sweep

        study = load_study(args.config, list(args.overrides) + ([f"sweep.name={args.name}"] if args.name else []))
        points = plan(study)
        if args.dry_run:
            print(f"config: {args.config}")
            print(describe_plan(study, points))
            print(PLAN_POINTER.format(config=args.config))
            return 0
        experiment = args.experiment or study.tracking.experiment or Path(args.config).stem
        report = run_sweep(study, experiment=experiment, address=args.address,
                           ray_log="verbose" if args.verbose else "quiet")
        print_summary(report)
        return report.exit_code

    return guarded(run, "the running point and the sweep are marked KILLED; rerun with the same --name to resume")


def search_parser(prog: str) -> argparse.ArgumentParser:
    parser = described_parser(prog, SEARCH_DESCRIPTION, SEARCH_EXAMPLES)
    run_options(parser, CONFIGS / "search_cpu.yaml", "search")
    parser.add_argument("--output", help="where to write the best feasible setting as a config file "
                                         "(default: ~/.rayvit/searches/<name>/best_config.yaml)")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment, else rayvit-search)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the trials, the screening plan, each trial's projected throughput and the "
                             "estimated device-hours, then exit (no Ray, no MLflow, no cluster needed)")
    return parser


def search(argv: Sequence[str], prog: str = "rayvit search") -> int:
    args = search_parser(prog).parse_args(argv)

    def run() -> int:
        from rayvit.config import load_study
        from rayvit.studies.plan import plan_search

        study = load_study(args.config, list(args.overrides) + ([f"search.name={args.name}"] if args.name else []))
        plan = plan_search(study)     # bad input fails here, before Ray or MLflow start
        if args.dry_run:
            from rayvit.studies.search.dryrun import describe_search

            print(f"config: {args.config}")
            print(describe_search(study, plan))
            print(PLAN_POINTER.format(config=args.config))
            return 0
        from rayvit.studies.search import SearchInterrupted, print_summary, run_search

        try:
            report = run_search(study, experiment=args.experiment, output=args.output, address=args.address,
                                ray_log="verbose" if args.verbose else "quiet")
        except SearchInterrupted as e:
            eprint(str(e))
            return e.exit_code
        print_summary(report)
        return report.exit_code

    return guarded(run, "the search's MLflow parent run is marked KILLED; rerun with the same --name to resume")
