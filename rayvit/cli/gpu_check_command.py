"""``rayvit gpu-check``: its options, turned into :class:`rayvit.gpu_check.GpuCheckOptions` for
:func:`rayvit.gpu_check.check_gpu`; its description is :mod:`rayvit.gpu_check`'s docstring."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Sequence

from rayvit.cli.options import described_parser

if TYPE_CHECKING:
    from rayvit.gpu_check.ladder_runs import GpuCheckOptions


def gpu_check_parser(prog: str) -> argparse.ArgumentParser:
    import rayvit.gpu_check

    parser = described_parser(prog, rayvit.gpu_check.__doc__, "")
    parser.add_argument("--model", choices=["vit_l16", "vit_h16"], default="vit_l16",
                        help="ladder model (default vit_l16; vit_h16 is the study's, with ~2.1x its FLOPs per image)")
    parser.add_argument("--compile", action="store_true", help="also check a torch.compile'd training run")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="ladder batch per GPU (default 32, the study's 256 over 8 GPUs)")
    parser.add_argument("--steps", type=int, default=20, help="ladder steps per rung (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="of which untimed warm-up steps (default 5)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                        help="the ladder's half type (default bf16; the study's A100 runs used fp16)")
    parser.add_argument("--baseline-precision", choices=["amp", "fp32"], default="amp",
                        help="the baseline rung's precision (default amp)")
    parser.add_argument("--no-ladder", action="store_true", help="run the checks only")
    parser.add_argument("--quick", action="store_true",
                        help="fewer precision checks, shorter runs and ladder (--steps 10 --warmup 3): within 3 minutes")
    parser.add_argument("--list", action="store_true", help="print the checks and ladder it would run, then exit")
    parser.add_argument("--out", default="results/gpu_check.json", help="JSON file (default %(default)s)")
    return parser


def parse_options(argv: Sequence[str], prog: str = "rayvit gpu-check") -> tuple[GpuCheckOptions, bool]:
    """The options as :class:`rayvit.gpu_check.GpuCheckOptions`, and whether ``--list`` was given; bad
    combinations exit with status 2, as argparse does."""
    from rayvit.gpu_check import GpuCheckOptions

    parser = gpu_check_parser(prog)
    args = parser.parse_args(argv)
    if args.quick:
        # Explicit --steps/--warmup win; the quick ladder's defaults are shorter.
        if "--steps" not in argv:
            args.steps = 10
        if "--warmup" not in argv:
            args.warmup = 3
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be >= 0 and below --steps")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the compile rung's first step compiles, outside the timing")
    if args.batch_size < 1:
        parser.error("--batch-size must be positive")
    listing = args.list
    del args.list
    return GpuCheckOptions(**vars(args)), listing


def gpu_check(argv: Sequence[str], prog: str = "rayvit gpu-check") -> int:
    from rayvit.gpu_check import check_gpu, list_plan

    options, listing = parse_options(list(argv), prog)
    if listing:
        list_plan(options)
        return 0
    return check_gpu(options)
