"""``rayvit project`` and ``rayvit plan``: the projection's commands. Nothing runs: neither Ray nor
torch.distributed starts, and torch is imported only where the ``cpu`` profile times this host's matmul."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from rayvit.cli.options import config_options, described_parser, guarded
from rayvit.config import SHIPPED_CONFIGS as CONFIGS

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
started. (It replaced `rayvit sweep --project`.)"""

PROJECT_EXAMPLES = """examples:
  %(prog)s --config experiments/configs/study_a100.yaml                 # 8-64 A100 40 GB (p4d)
  %(prog)s --config experiments/configs/study_a100.yaml --hardware a100-80gb h100-sxm h200
  %(prog)s --config experiments/configs/study_a100.yaml --measured results/gpu_check.json
  %(prog)s --measured result.json       # CPU: a 1-worker point's result.json (an artifact of its MLflow run)
  %(prog)s --config study_a100.yaml --json --hardware h100-sxm > rows.jsonl   # one JSON record per row
  %(prog)s --config study_a100 --hardware cluster/example_cluster.yaml        # a cluster you describe
  %(prog)s --config study_a100 --set sweep.mode=ladder --set precision.mode=amp --chips 8 64   # the ladder"""

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


def project_parser(prog: str) -> argparse.ArgumentParser:
    parser = described_parser(prog, PROJECT_DESCRIPTION, PROJECT_EXAMPLES)
    config_options(parser, CONFIGS / "cpu_default.yaml", "YAML config whose sweep is projected",
                   "model.image_size=256")
    from rayvit.projection.profiles import PROFILES

    group = parser.add_argument_group("projection")
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
    return parser


def project(argv: Sequence[str], prog: str = "rayvit project") -> int:
    args = project_parser(prog).parse_args(argv)
    return guarded(lambda: project_study(args.config, args.overrides, hardware=args.hardware, chips=args.chips,
                                         measured=args.measured, out_dir=args.out_dir, as_json=args.json,
                                         data_rate=args.data_rate, node_cpus=args.node_cpus),
                   "nothing was running")


def project_study(config: str, overrides: list[str], *, hardware: Optional[list[str]] = None,
                  chips: Optional[list[int]] = None, measured: Optional[str] = None, out_dir: Optional[str] = None,
                  as_json: bool = False, data_rate: Optional[str] = None, node_cpus: Optional[float] = None) -> int:
    """The projection table and PNG of a config's sweep, or of its ladder (``sweep.mode=ladder``). Analytic,
    without Ray or torch; only the ``cpu`` profile (this host) times a matmul first, with torch, when no
    measured rate is given."""
    from rayvit.projection import project_output as projection

    study = projection.load(config, overrides)
    hardware = hardware or projection.default_hardware(study)
    rungs = None
    if study.sweep.mode == "ladder":
        from rayvit.studies.plan import derive, ladder_overrides

        rungs = [(rung, derive(study.run, changes, f"ladder rung {rung}")) for rung, changes in ladder_overrides(study)]
    cpu_peaks = None
    if "cpu" in hardware and not measured:
        from rayvit.measure.host import cpu_peaks_for

        cpu_peaks = cpu_peaks_for([cfg for _, cfg in rungs] if rungs else [study.run])
    if rungs:
        projection.run_ladder(study, rungs, hardware=hardware, chips=chips, measured=measured, as_json=as_json,
                              cpu_peaks=cpu_peaks)
        return 0
    projection.run(study, hardware=hardware, chips=chips, measured=measured, out_dir=out_dir, as_json=as_json,
                   data_rate=data_rate, node_cpus=node_cpus, cpu_peaks=cpu_peaks)
    return 0


def plan_parser(prog: str) -> argparse.ArgumentParser:
    parser = described_parser(prog, PLAN_DESCRIPTION, PLAN_EXAMPLES)
    config_options(parser, CONFIGS / "study_a100.yaml", "YAML config whose model, data and search space are "
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
        from rayvit.projection.project_output import default_hardware, load

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

    return guarded(run, "nothing was running")
