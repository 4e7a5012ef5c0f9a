"""``rayvit``: one command for every entry point.

    rayvit sweep   [--config F] [--set k=v ...]     scaling sweeps and the optimization ladder
    rayvit project [--config F] [--hardware P ...]  projected throughput and memory per chip, nothing runs
    rayvit plan    [--config F] [--hardware P ...]  what to run, on what, at what cost per epoch; nothing runs
    rayvit search  [--config F] [--set k=v ...]     Ray Tune: fastest setting within the accuracy budget
    rayvit bench   [k=v ...] [--compare k=a,b]      single-process A/B timing of the training step
    rayvit gpu-check [--quick] [--list]             what only a GPU can tell, with the ladder's TFLOPS and MFU
    rayvit to-parquet SRC DST                       image folder -> parquet shards for data.name=parquet
    rayvit bench-data data.path=P [k=v ...]         the input pipeline's images/s per CPU core on your files

``experiments/scaling.py`` and ``experiments/search.py`` are the same commands as files, for
``ray job submit -- python experiments/scaling.py``. Exit status: 0 done, 1 a point or trial failed,
2 nothing could start (bad config, unreachable store or cluster, missing cluster token, cluster too
small, checkpoints without shared storage on a multi-node cluster), 130 interrupted (a search: 143 on
SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from rayvit.config import SHIPPED_CONFIGS as CONFIGS, config_path
TRACKING_HELP = ("tracking store: tracking.uri if set, else $MLFLOW_TRACKING_URI, else "
                 "sqlite:///~/.rayvit/mlflow.db ($RAYVIT_HOME moves it)")

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
  %(prog)s --project --config experiments/configs/study_a100.yaml --hardware a100-40gb h100-sxm

{TRACKING_HELP}. Sweep names are unique per experiment; reusing one resumes that sweep."""

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


PROJECT_DESCRIPTION = """Project a sweep's per-chip throughput and memory onto chips you have not rented; nothing runs.

For each chip count and strategy of the config's sweep (ddp, fsdp and hsdp with and without
reshard_after_forward, fairscale_oss, fairscale_fsdp, as the config allows) it prints step time, images/s and TFLOPS per chip,
MFU, the ratio to DDP, scaling efficiency, the dominant term (compute, exposed communication, optimizer),
memory per rank, whether the point fits the chip and the largest batch that fits; then a memory breakdown
and a PNG of projected TFLOPS per chip against chips. Compute comes from --measured, else the
op-level roofline of the chip (matmuls at their shape's achievable rate, memory-bound operations at
memory bandwidth); links, memory and the spread of chips' speed from the hardware profile
(rayvit/projection/profiles.py; docs/projection.md says where every figure comes from). Rows that do not
fit are followed by what would make them fit. sweep.strategies need not name ddp: every strategy is
compared with DDP, which the projection adds. With sweep.mode=ladder: the study's ladder rung by rung,
each against the baseline, beside the study's published figures. Neither Ray nor torch.distributed is
started. Same as `rayvit sweep --project`."""

PROJECT_EXAMPLES = """examples:
  %(prog)s --config experiments/configs/study_a100.yaml                 # 8-64 A100 40 GB (p4d)
  %(prog)s --config experiments/configs/study_a100.yaml --hardware a100-80gb h100-sxm h200
  %(prog)s --config experiments/configs/study_a100.yaml --measured results/gpu_check.json
  %(prog)s --measured result.json       # CPU: a 1-worker point's result.json (an artifact of its MLflow run)
  %(prog)s --config study_a100.yaml --json --hardware h100-sxm > rows.jsonl   # one JSON record per row
  %(prog)s --config study_a100 --hardware cluster/example_cluster.yaml        # a cluster you describe
  %(prog)s --config study_a100 --set sweep.mode=ladder --set precision.mode=amp --chips 8 64   # the ladder"""


def _config_options(parser: argparse.ArgumentParser, default_config: Path, what: str = "YAML config",
                    example: str = "train.steps=10") -> None:
    parser.add_argument("--config", default=str(default_config), type=config_path,
                        help=f"{what}: a file, or the name of one rayvit ships (default: "
                             f"{default_config.name}, as in experiments/configs)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config value, e.g. --set {example} (repeatable)")


def _common(parser: argparse.ArgumentParser, default_config: Path, what: str) -> None:
    _config_options(parser, default_config)
    parser.add_argument("--name", help=f"{what} name (the MLflow parent run); an existing name resumes it")
    parser.add_argument("--address", help="Ray cluster to attach to, host:port of its GCS (default: "
                                          "$RAY_ADDRESS, as set by `ray job submit`; else a local "
                                          "instance). Token clusters: give the token as $RAY_AUTH_TOKEN")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show Ray's worker and controller output as it comes (by default it goes to "
                             "~/.rayvit/logs/<name>.log; warnings and errors still show, once each)")


def sweep_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=SWEEP_DESCRIPTION, epilog=SWEEP_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(parser, CONFIGS / "cpu_default.yaml", "sweep")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment, else the "
                                             "config file's name)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planned points and the resources each needs, then exit")
    _projection_options(parser)
    return parser


def _projection_options(parser: argparse.ArgumentParser, standalone: bool = False) -> None:
    group = parser.add_argument_group("projection" if standalone else "projection (no Ray, nothing runs)",
                                      None if standalone else "--project: what `rayvit project` does (its "
                                      "--help says more); the options below apply to it.")
    if not standalone:
        group.add_argument("--project", action="store_true",
                           help="project the config's sweep instead of running it")
    from rayvit.projection.profiles import PROFILES

    group.add_argument("--hardware", nargs="+", default=None, metavar="PROFILE",
                       help=f"hardware profiles: {', '.join([*PROFILES, 'cpu'])}, or a cluster file you describe "
                            "(.yaml: a base profile and your network, GPUs and CPUs per node, memory, price; "
                            "cluster/example_cluster.yaml) (default: sweep.hardware, else a100-40gb on GPU "
                            "configs, cpu otherwise)")
    group.add_argument("--chips", type=int, nargs="+", help="chip counts, 1 or more (default: sweep.worker_counts)")
    group.add_argument("--measured", metavar="JSON",
                       help="a single-chip rate: a point's result.json (an artifact of its MLflow run), "
                            "`rayvit bench --json` output or "
                            "`rayvit gpu-check`'s JSON (needed for the cpu profile)")
    group.add_argument("--out-dir", default=None,
                       help="where the PNG goes (default: $RAYVIT_HOME/projections, ~/.rayvit/projections); an "
                            "earlier projection's file is never overwritten (-2, -3, ... are added)")
    group.add_argument("--json", action="store_true",
                       help="print one JSON record per projected row (hardware, chips, strategy, "
                            "images_per_sec_per_chip, tflops_per_chip, mfu, scaling_efficiency, memory_bytes_per_rank, "
                            "fits, max_batch, ...) instead of the tables; the PNG only with --out-dir")
    group.add_argument("--data-rate", metavar="JSON|N",
                       help="the input pipeline's images/s per CPU core (`rayvit bench-data --json` output, or a "
                            "number): adds whether each point's node can feed its chips, the cores per chip it "
                            "needs and the epoch time bound by the slower of compute and input")
    group.add_argument("--node-cpus", type=float, metavar="N",
                       help="physical CPU cores per node for --data-rate (default: the profile's instance's vCPUs "
                            "counted as cores, two per core on the GPU profiles; this machine's on cpu)")


def default_hardware(study) -> list[str]:
    """``sweep.hardware`` where the config names one, else a100-40gb on GPU configs and cpu otherwise."""
    if study.sweep.hardware:
        return [study.sweep.hardware]
    return ["a100-40gb"] if study.run.parallel.use_gpu else ["cpu"]


def _project(args: argparse.Namespace) -> int:
    """The projection table and PNG. Analytic, without Ray or torch; only the ``cpu`` profile (this host)
    times a matmul first, with torch, when no measured rate is given."""
    from rayvit.projection import cli as projection

    study = projection.load(args.config, args.overrides)
    hardware = args.hardware or default_hardware(study)
    rungs = None
    if study.sweep.mode == "ladder":
        from rayvit.studies.plan import derive, ladder_overrides

        rungs = [(rung, derive(study.run, changes, f"ladder rung {rung}")) for rung, changes in ladder_overrides(study)]
    cpu_peaks = None
    if "cpu" in hardware and not args.measured:
        from rayvit.measure.host import cpu_peaks_for

        cpu_peaks = cpu_peaks_for([cfg for _, cfg in rungs] if rungs else [study.run])
    if rungs:
        projection.run_ladder(study, rungs, hardware=hardware, chips=args.chips, measured=args.measured,
                              as_json=args.json, cpu_peaks=cpu_peaks)
        return 0
    projection.run(study, hardware=hardware, chips=args.chips, measured=args.measured, out_dir=args.out_dir,
                   as_json=args.json, data_rate=args.data_rate, node_cpus=args.node_cpus, cpu_peaks=cpu_peaks)
    return 0


PLAN_DESCRIPTION = """What to run, on which hardware and how many chips, and what an epoch costs; nothing runs.

For the config's model and dataset it projects, on each hardware profile (shipped, or a cluster you describe
in a YAML file) and chip count, every strategy the config allows (ddp, fsdp and hsdp with and without
reshard_after_forward, fairscale_oss, fairscale_fsdp), activation checkpointing off and on, the precisions
and image sizes of the config's search.space, and the batch per chip up to the largest that fits. The
settings that fit are ranked by hours per epoch of the dataset (ImageNet-1K's 1,281,167 images unless the
config's data or --epoch-images says otherwise), or by cost per epoch where every profile has a price; each
row says what dominates its step and why it loses to the row above. Rows that change precision or image
size are marked: `rayvit search` measures what they cost in accuracy. No Ray, no torch (the cpu profile
times this host's matmul unless --measured is given)."""

PLAN_EXAMPLES = """examples:
  %(prog)s --config study_a100                                   # A100 40 GB (p4d) at 8-64 chips
  %(prog)s --config study_a100 --hardware cluster/example_cluster.yaml h100-sxm --chips 8 16 32
  %(prog)s --config search_a100 --hardware a100-80gb --by hours --top 30
  %(prog)s --config study_a100 --json > plan.jsonl               # one JSON record per row, ranked first
  %(prog)s --hardware cpu --chips 2 --measured ddp_w1/result.json fsdp_w1/result.json links.json"""


def plan_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=PLAN_DESCRIPTION, epilog=PLAN_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_options(parser, CONFIGS / "study_a100.yaml", "YAML config whose model, data and search space are "
                    "planned", "model.image_size=256")
    from rayvit.projection.profiles import PROFILES

    parser.add_argument("--hardware", nargs="+", metavar="PROFILE",
                        help=f"hardware profiles: {', '.join([*PROFILES, 'cpu'])}, or cluster files (.yaml) "
                             "(default: sweep.hardware, else a100-40gb on GPU configs, cpu otherwise)")
    parser.add_argument("--chips", type=int, nargs="+", help="chip counts, 1 or more (default: sweep.worker_counts)")
    parser.add_argument("--by", choices=["hours", "cost"],
                        help="rank by hours or by cost per epoch (default: cost where every profile has a price)")
    parser.add_argument("--epoch-images", type=int, metavar="N",
                        help="training images per epoch (default: the config's dataset, else ImageNet-1K)")
    parser.add_argument("--strategies", nargs="+", metavar="NAME", help="only these strategies (default: all)")
    parser.add_argument("--batch-per-chip", type=int, nargs="+", metavar="B",
                        help="only these batch sizes per chip (default: a quarter of the config's up to what fits)")
    parser.add_argument("--measured", nargs="+", metavar="JSON",
                        help="measurements that replace assumptions: points' result.json files (the compute "
                             "rate from DDP's smallest, each strategy's own overhead from its own), a sweep's "
                             "links.json, `rayvit bench --json` or `rayvit gpu-check` output")
    parser.add_argument("--top", type=int, default=15, help="rows to print (default 15)")
    parser.add_argument("--all-batches", action="store_true",
                        help="a row for every batch weighed, not only each setting's best")
    parser.add_argument("--json", action="store_true",
                        help="one JSON record per row (rank, hardware, chips, strategy, batch_per_chip, fits, "
                             "epoch_hours, epoch_cost, dominant, behind, changes_accuracy, ...) instead of the table")
    return parser


def plan(argv: Sequence[str], prog: str = "rayvit plan") -> int:
    args = plan_parser(prog).parse_args(argv)

    def run() -> int:
        from rayvit.projection import plan_output
        from rayvit.projection.cli import load

        study = load(args.config, args.overrides)
        hardware = args.hardware or default_hardware(study)
        cpu_peaks = None
        if "cpu" in hardware and not args.measured:
            from rayvit.measure.host import cpu_peaks_for

            cpu_peaks = cpu_peaks_for([study.run])
        plan_output.run(study, hardware=hardware, chips=args.chips, measured=args.measured,
                        epoch_images=args.epoch_images, strategies=args.strategies, batch_sizes=args.batch_per_chip,
                        by=args.by, top=args.top, as_json=args.json, all_batches=args.all_batches,
                        cpu_peaks=cpu_peaks)
        return 0

    return _guarded(run, "nothing was running")


PLAN_POINTER = ("before renting: `rayvit plan --config {config}` ranks strategies, batch sizes, activation "
                "checkpointing, precisions and image sizes by hours and cost per epoch (no cluster needed)")


def search_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=SEARCH_DESCRIPTION, epilog=SEARCH_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(parser, CONFIGS / "search_cpu.yaml", "search")
    parser.add_argument("--output", help="where to write the best feasible setting as a config file "
                                         "(default: ~/.rayvit/searches/<name>/best_config.yaml)")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment, else rayvit-search)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the trials, the screening plan, each trial's projected throughput and the "
                             "estimated device-hours, then exit (no Ray, no MLflow, no cluster needed)")
    return parser


def eprint(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _guarded(run: Callable[[], int], interrupted: str) -> int:
    """Start-up errors (exit 2) and Ctrl-C (exit 130) said in one line each, as a CLI should."""
    from rayvit.errors import BaselineFailed, ClusterTooSmall, ConfigError, ConnectError, TrackingError
    from rayvit.launch.console import quiet_loggers

    quiet_loggers()
    try:
        return run()
    except (ConfigError, TrackingError, ConnectError, ClusterTooSmall, BaselineFailed) as e:
        eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        eprint(f"interrupted: {interrupted}")
        return 130


def sweep(argv: Sequence[str], prog: str = "rayvit sweep") -> int:
    args = sweep_parser(prog).parse_args(argv)

    def run() -> int:
        from rayvit.config import load_study
        from rayvit.studies.plan import describe_plan, plan
        from rayvit.studies.sweep import print_summary, run_sweep

        if args.project:
            return _project(args)
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

    return _guarded(run, "the running point and the sweep are marked KILLED; rerun with the same --name to resume")


def project_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=PROJECT_DESCRIPTION, epilog=PROJECT_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_options(parser, CONFIGS / "cpu_default.yaml", "YAML config whose sweep is projected",
                    "model.image_size=256")
    _projection_options(parser, standalone=True)
    return parser


def project(argv: Sequence[str], prog: str = "rayvit project") -> int:
    """``rayvit project`` = ``rayvit sweep --project``, with a help of its own."""
    args = project_parser(prog).parse_args(argv)
    return _guarded(lambda: _project(args), "nothing was running")


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

    return _guarded(run, "the search's MLflow parent run is marked KILLED; rerun with the same --name to resume")


def bench(argv: Sequence[str], prog: str = "rayvit bench") -> int:
    from rayvit.worker.bench import main as bench_main

    return bench_main(list(argv), prog=prog)


def gpu_check(argv: Sequence[str], prog: str = "rayvit gpu-check") -> int:
    from rayvit.gpu_check import main as gpu_check_main

    return gpu_check_main(list(argv), prog=prog)


def bench_data(argv: Sequence[str], prog: str = "rayvit bench-data") -> int:
    from rayvit.worker.bench_data import main as bench_data_main

    return bench_data_main(list(argv), prog=prog)


def to_parquet(argv: Sequence[str], prog: str = "rayvit to-parquet") -> int:
    from rayvit.data.to_parquet import main as to_parquet_main

    return to_parquet_main(list(argv), prog=prog)


COMMANDS: dict[str, tuple[Callable[..., int], str]] = {
    "sweep": (sweep, "scaling sweeps and the optimization ladder, recorded in MLflow"),
    "project": (project, "project a sweep's per-chip throughput and memory on 8-64 GPUs, without running it"),
    "plan": (plan, "what to run, on what and how many chips, ranked by hours and cost per epoch, without running"),
    "search": (search, "Ray Tune search for the fastest setting within an accuracy budget"),
    "bench": (bench, "single-process A/B timing of the training step (ratios against the first variant)"),
    "gpu-check": (gpu_check, "on one GPU: every precision level and strategy, FairScale FSDP, the ladder's TFLOPS"),
    "to-parquet": (to_parquet, "convert an image folder into parquet shards for data.name=parquet"),
    "bench-data": (bench_data, "the input pipeline's images/s per CPU core on your parquet files (for --data-rate)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(len(name) for name in COMMANDS)
        usage = "usage: rayvit COMMAND [options]   (rayvit COMMAND --help for each)\n\ncommands:\n" + "\n".join(
            f"  {name.ljust(width)}  {about}" for name, (_, about) in COMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            eprint(f"rayvit: unknown command {argv[0]!r}\n\n{usage}")
            return 2
        print(usage)
        return 0 if argv else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
