"""GPU check: everything rayvit does only on CUDA, and the study's optimization ladder, on one GPU.

    rayvit gpu-check                      # ViT-L/16 ladder, within 8 minutes on one H100/H200
    rayvit gpu-check --quick              # fewer checks, a shorter ladder: within 3 minutes
    rayvit gpu-check --list               # the checks it would run (no GPU needed)
    rayvit gpu-check --model vit_h16      # the study's ViT-H/16
    rayvit gpu-check --compile            # also torch.compile: DDP and FSDP2 runs, the ladder's compile rung

Checks, each PASS or FAIL with its reason, or N/A where this machine cannot tell (a check that cannot
fail here is never reported as passed):
  nccl         a one-rank NCCL process group all-reduces a CUDA tensor
  precision    fp32, and amp / mixed / pure in bf16 and fp16: a small ViT trains (rayvit.worker.train),
               its loss is finite and falls
  strategies   fsdp (PyTorch FSDP2), fairscale_fsdp (fp32, amp, mixed and pure fp16, with FairScale's own
               gradient clipping) and fairscale_oss at world size 1, same criteria
  hsdp         FSDP2 on a 2-D (replicate, shard) mesh over NCCL in mixed bf16: on two GPUs as 1x2 (equal to
               FSDP) and 2x1 (the shards' fp32 all-reduce across replicas on FSDP2's own stream); on one
               GPU as a 1x1 mesh against FSDP
  layernorm    under mixed, for ddp, fsdp and fairscale_fsdp: LayerNorm weights and outputs fp32 while the
               matmuls run in half (forward hooks), and the norms' gradients fp32
  reduce       the dtype gradients are reduced in (parallel.reduce_dtype): DDP's hook seen on the wire,
               FSDP2's reduce buffer; FairScale's reduce-scatters on two GPUs over NCCL (at one rank
               FairScale sends nothing and forces fp32: N/A on a one-GPU machine)
  decay        fairscale_fsdp weight decay over sharded flat parameters, two gloo ranks sharing the GPU:
               matrices decay, the rest does not
  flash        torch.backends.cuda.flash_sdp_enabled(); SDPA in bf16 runs with only the flash backend
               allowed, for raw tensors and for the ViT's attention in both layouts; and whether SDPA's
               own choice was a flash kernel (profiler)
  recompute    activation checkpointing under bf16 (fairscale_fsdp amp and mixed, fsdp amp): each block's
               matmuls in bf16 in the forward and again in the recompute (FairScale's wrapper enters fp16
               autocast around it), gradients finite; fairscale_fsdp mixed-bf16 checkpointed trains
  memory       per precision level: torch.cuda.max_memory_allocated's growth per image of batch against
               rayvit.projection's activation model (within -25%/+33%), and the peak against its total
  compile      (--compile) model.compile under DDP (amp-bf16, the wrapped model compiled) and FSDP2 (mixed-bf16,
               each block compiled before sharding): same criteria, and compile time recorded
  nvml         a training run's NVML sampler reports utilisation and power over its timed window, and
               peak allocated <= reserved memory, per rank and as the run's figures
  profile      the hardware profile the in-sweep projection picks for this GPU (its name and memory
               size): a GPU profile, never the CPU one, holding the device's memory
  decode       data.decode=gpu: nvJPEG (torchvision.io.decode_jpeg, batched) crops of the sample
               photographs match the CPU decoder's (N/A without torchvision), with both paths' rates
  state        fairscale_fsdp and fsdp: model state per rank the same with and without
               reshard_after_forward, with and without a validation split (an evaluation's forward)
  final model  fairscale_fsdp and fsdp: after training and the final evaluation, the model a run's final
               checkpoint holds (its shards consolidated, or gathered onto rank 0) equals the strategy's
               own full state
  rounds       ddp, fairscale_fsdp and fsdp in one group's rounds: free device memory after each run the
               same in round 2 as in round 1 (FairScale's process groups made before round 1); a NaN loss
               on one of two ranks (NCCL, two GPUs) ends that run on both, and the rounds go on; NCCL's
               count of issued collectives (what ranks compare after each run) grows as they are issued;
               a run after which one of two ranks (two GPUs) issued one collective more ends the group
  (--compile)  two compiled runs in one process: both compile the same graphs from empty caches
Then the ladder (rayvit.studies.plan.plan_ladder) at world size 1: baseline (DDP, amp or fp32, token
classifier, batch-first, loop AdamW, 224 px) -> +mixed precision -> +FSDP -> +MTA optimizer ->
+pooled classifier -> +batch-second -> +256 px -> +full half precision, with per-chip TFLOPS, MFU
and each rung's ratio to the baseline. At one GPU FSDP has nothing to shard across: its rung shows
the wrapper's own cost, not the multi-GPU gain.

Everything goes to a JSON file (--out). Exit status: 0 all passed, 1 a check or rung failed, 2 no CUDA
or bad arguments. Not run by CI or the tests (they need no GPU); run it by hand on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

# The study's ViT-H/16 ratios to its DDP baseline (A100s), printed beside ours for orientation.
STUDY_RATIOS = {"batch_second": 1.51, "image_256": 1.86, "full_half": 2.18}

from rayvit.gpu_check.cases import (NotCheckable, check_activation_memory, check_fairscale_weight_decay,  # noqa: E402,F401
                                    check_flash, check_layer_norm_fp32, check_nccl, check_nvml_sampler,
                                    check_profile, check_reduce_dtype, check_training)
from rayvit.gpu_check.cases import one_line  # noqa: E402
from rayvit.gpu_check.decode import check_gpu_decode  # noqa: E402,F401
from rayvit.gpu_check.hsdp_cases import check_hsdp  # noqa: E402,F401
from rayvit.gpu_check.ladder_runs import free_device_memory, ladder_config, run_ladder  # noqa: E402,F401
from rayvit.gpu_check.checkpoints import check_final_model  # noqa: E402
from rayvit.gpu_check.recompute import check_recompute_dtype  # noqa: E402,F401
from rayvit.gpu_check.group_cases import (check_cold_compile, check_collective_counts, check_group_memory,  # noqa: E402,F401
                                     check_nan_on_one_rank, check_out_of_step, check_state_after_evaluation)


def parse_args(argv: Optional[list[str]] = None, prog: str = "rayvit gpu-check") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = parser.parse_args(argv)
    if args.quick:
        # Explicit --steps/--warmup win; the quick ladder's defaults are shorter.
        given = argv if argv is not None else sys.argv[1:]
        if "--steps" not in given:
            args.steps = 10
        if "--warmup" not in given:
            args.warmup = 3
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be >= 0 and below --steps")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the compile rung's first step compiles, outside the timing")
    if args.batch_size < 1:
        parser.error("--batch-size must be positive")
    return args


def no_cuda_reason() -> Optional[str]:
    """Why this process cannot use CUDA, or None when it can."""
    import os

    import torch

    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build. Install a CUDA build of torch on a "
                f"machine with an NVIDIA GPU, e.g. `pip install torch` there.")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device{hint}. "
                f"Check `nvidia-smi` and the driver.")
    return None



def plan_checks(device, *, quick: bool, compile_: bool) -> list[tuple[str, Callable[[], str]]]:
    """Every functional check, in order, as (name, function); ``--quick`` drops the fp16 twins and
    shortens the training runs."""
    steps = 15 if quick else 30
    train = partial(check_training, device, steps=steps)
    checks: list[tuple[str, Callable[[], str]]] = [("nccl all-reduce (1 rank)", partial(check_nccl, device))]
    levels = [("fp32", "bf16")] + [(mode, dtype) for mode in ("amp", "mixed", "pure") for dtype in ("bf16", "fp16")]
    if quick:
        levels = [("fp32", "bf16"), ("amp", "bf16"), ("mixed", "bf16"), ("mixed", "fp16"), ("pure", "bf16")]
    for mode, dtype in levels:
        name = f"precision {mode}" + ("" if mode == "fp32" else f"-{dtype}")
        checks.append((name, partial(train, {"precision.mode": mode, "precision.dtype": dtype})))
    # Each sharded strategy in fp32 and the half levels it supports (OSS cannot hold an fp32 master copy;
    # FairScale FSDP: fp32, amp, mixed and pure fp16, the study's library and half type; its clip too).
    strategies = [("fsdp", "fp32", "bf16", {}), ("fsdp", "mixed", "bf16", {}), ("hsdp", "mixed", "bf16", {}),
                  ("fairscale_fsdp", "fp32", "fp16", {}), ("fairscale_fsdp", "amp", "fp16", {}),
                  ("fairscale_fsdp", "mixed", "fp16", {"optim.grad_clip": 1.0}),
                  ("fairscale_fsdp", "mixed", "bf16", {}),
                  ("fairscale_fsdp", "pure", "fp16", {"parallel.reduce_dtype": "half", "optim.grad_clip": 1.0}),
                  ("fairscale_oss", "fp32", "bf16", {}), ("fairscale_oss", "amp", "bf16", {"optim.grad_clip": 1.0})]
    for strategy, mode, dtype, extra in strategies:
        name = f"strategy {strategy} {mode}{'' if mode == 'fp32' else '-' + dtype}{' +clip' if extra.get('optim.grad_clip') else ''}"
        checks.append((name, partial(train, {"parallel.strategy": strategy, "precision.mode": mode,
                                             "precision.dtype": dtype, **extra})))
    for strategy, dtype in (("ddp", "bf16"), ("fsdp", "bf16"), ("fairscale_fsdp", "fp16")):
        checks.append((f"layernorm fp32 {strategy} mixed-{dtype}", partial(check_layer_norm_fp32, device, strategy, dtype)))
    reduces = [("ddp", "mixed", "bf16", "fp32"), ("ddp", "mixed", "bf16", "half"), ("ddp", "pure", "fp16", "fp32"),
               ("fsdp", "mixed", "bf16", "fp32"), ("fsdp", "pure", "bf16", "fp32"), ("hsdp", "mixed", "bf16", "fp32"),
               ("fairscale_fsdp", "mixed", "fp16", "fp32"), ("fairscale_fsdp", "mixed", "fp16", "half")]
    for strategy, mode, dtype, reduce in reduces:
        checks.append((f"reduce {strategy} {mode}-{dtype} ->{reduce}",
                       partial(check_reduce_dtype, device, strategy, mode, dtype, reduce)))
    checks += [("hsdp 2-D mesh over NCCL", partial(check_hsdp, device)),
               ("decay fairscale_fsdp flat params", partial(check_fairscale_weight_decay, device)),
               ("flash attention (SDPA)", partial(check_flash, device)),
               ("nvml sampler (util, power, memory)", partial(check_nvml_sampler, device)),
               ("projection hardware profile", partial(check_profile, device)),
               ("data.decode=gpu (nvJPEG crops)", partial(check_gpu_decode, device))]
    for mode in ("fp32", "amp", "mixed", "pure"):
        checks.append((f"activation memory {mode}", partial(check_activation_memory, device, mode)))
    # Activation checkpointing: FSDP2 (torch's wrapper before fully_shard), FairScale FSDP (FairScale's own
    # wrapper inside its FSDP, which only a GPU runs), and the memory it saves against the model.
    for strategy, dtype in (("fsdp", "bf16"), ("fairscale_fsdp", "fp16"), ("fairscale_fsdp", "bf16")):
        checks.append((f"activation checkpointing {strategy} mixed-{dtype}", partial(
            train, {"parallel.strategy": strategy, "precision.mode": "mixed", "precision.dtype": dtype,
                    "model.activation_checkpointing": "block"})))
    # Each recompute in the run's half dtype: FairScale's wrapper enters fp16 around it, so bf16 tells.
    for strategy, mode in (("fairscale_fsdp", "amp"), ("fairscale_fsdp", "mixed"), ("fsdp", "amp")):
        checks.append((f"recompute dtype {strategy} {mode}-bf16", partial(
            check_recompute_dtype, device, strategy, mode, "bf16")))
    checks.append(("activation memory mixed, checkpointed", partial(
        check_activation_memory, device, "mixed", {"model.activation_checkpointing": "block"})))
    checks += worker_group_checks(device)
    if compile_:
        for strategy, mode in (("ddp", "amp"), ("fsdp", "mixed")):
            checks.append((f"compile {strategy} {mode}-bf16", partial(
                train, {"model.compile": True, "parallel.strategy": strategy, "precision.mode": mode,
                        "precision.dtype": "bf16"})))
        checks.append(("compile cold in every run", partial(check_cold_compile, device)))
    return checks


def worker_group_checks(device) -> list[tuple[str, Callable[[], str]]]:
    """The cases of a worker group's runs: state per rank and the final model after an evaluation, free memory per
    round, one rank's failure, collectives out of step."""
    checks: list[tuple[str, Callable[[], str]]] = []
    for strategy, mode, dtype in (("fairscale_fsdp", "mixed", "fp16"), ("fsdp", "mixed", "bf16")):
        for what, check in (("state bytes", check_state_after_evaluation), ("final model", check_final_model)):
            checks.append((f"{what} {strategy} {mode}-{dtype} after eval",
                           partial(check, device, strategy, mode, dtype)))
    checks.append(("free memory per round (fairscale_fsdp in a group)", partial(check_group_memory, device)))
    checks.append(("nan on one rank (2 GPUs)", partial(check_nan_on_one_rank, device)))
    checks.append(("collective counts (nccl, 1 rank)", partial(check_collective_counts, device)))
    checks.append(("out of step on one rank (2 GPUs)", partial(check_out_of_step, device)))
    return checks


def run_checks(device, *, compile_: bool, out: Callable[[str], None], quick: bool = False) -> list[dict[str, Any]]:
    """Every functional check, in order; a failure is recorded and the next check runs."""
    checks = plan_checks(device, quick=quick, compile_=compile_)
    results = []
    for name, fn in checks:
        results.append(run_check(name, fn, out))
        free_device_memory(device)
    return results


def run_check(name: str, fn: Callable[[], str], out: Callable[[str], None]) -> dict[str, Any]:
    """One check: ``ok`` True (PASS), False (FAIL, with its traceback) or None (N/A: cannot fail here)."""
    start = time.perf_counter()
    traceback_text = None
    try:
        detail, ok = fn(), True
    except NotCheckable as e:
        detail, ok = str(e), None
    except Exception as e:
        detail, ok = one_line(e), False
        traceback_text = traceback.format_exc()     # in the JSON file; the console gets one line
    seconds = time.perf_counter() - start
    status = {True: "PASS", False: "FAIL", None: "N/A "}[ok]
    out(f"  {status}  {name:<44} {seconds:5.1f} s  {detail}")
    return {"check": name, "ok": ok, "seconds": round(seconds, 2), "detail": detail, "traceback": traceback_text}


def environment(device) -> dict[str, Any]:
    import torch

    from rayvit.training import hardware
    from rayvit.worker.metrics import library_versions

    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                           "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           **library_versions(), "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, accelerator=hardware.accelerator_name(device),
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   cudnn=torch.backends.cudnn.version(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                   mem_efficient_sdp_enabled=torch.backends.cuda.mem_efficient_sdp_enabled())
    return env


def list_plan(args: argparse.Namespace) -> None:
    """``--list``: the checks and ladder rungs a run with these arguments would do."""
    from rayvit.studies.plan import plan_ladder

    print("checks:")
    for name, _ in plan_checks(None, quick=args.quick, compile_=args.compile):
        print(f"  {name}")
    if not args.no_ladder:
        print(f"ladder ({args.model}, batch {args.batch_size}, {args.steps} steps, {args.warmup} warm-up):")
        for point in plan_ladder(ladder_config(args)):
            print(f"  {point.key}")


def main(argv: Optional[list[str]] = None, prog: str = "rayvit gpu-check") -> int:
    args = parse_args(argv, prog)
    if args.list:
        list_plan(args)
        return 0
    reason = no_cuda_reason()
    if reason:
        print(f"gpu_check: no GPU to check: {reason}", file=sys.stderr)
        return 2

    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    env = environment(device)
    print(f"gpu_check on {env['device_name']} ({env['memory_gib']} GiB, sm {env['capability']}), torch "
          f"{env['torch_version']}, CUDA {env['cuda']}")
    print("checks:")
    checks = run_checks(device, compile_=args.compile, out=print, quick=args.quick)

    rows: list[dict[str, Any]] = []
    if not args.no_ladder:
        cfg = ladder_config(args)
        print(f"\nladder: {args.model}, batch {args.batch_size}/GPU, {args.steps} steps ({args.warmup} warm-up) "
              f"per rung, baseline {args.baseline_precision}, half type {args.dtype}, 1 GPU")
        rows = run_ladder(cfg, device, out=print)
        print("\nratio to the baseline (the study's ViT-H/16 on A100s in brackets):")
        for row in rows:
            ratio = row.get("relative_throughput")
            study = STUDY_RATIOS.get(row["series"])
            print(f"  {row['series']:<18} " + (f"{ratio:.2f}x" if ratio else "-") +
                  (f"  [{study:.2f}x]" if study else ""))

    failed = [c["check"] for c in checks if c["ok"] is False] + [r["point"] for r in rows if r["status"] != "done"]
    report = {"environment": env, "args": vars(args), "checks": checks, "ladder": rows,
              "failed": failed, "seconds": round(time.perf_counter() - start, 1)}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    unchecked = [c["check"] for c in checks if c["ok"] is None]
    note = f" ({len(unchecked)} not checkable on this machine: {', '.join(unchecked)})" if unchecked else ""
    print(f"\n{'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}{note} in {report['seconds']:.0f} s; "
          f"written to {path.resolve()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
