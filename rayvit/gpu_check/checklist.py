"""The GPU check's list of checks, in order, and how one is run and reported: PASS, FAIL with its traceback,
or N/A where this machine cannot tell (see :mod:`rayvit.gpu_check`)."""

from __future__ import annotations

import time
import traceback
from functools import partial
from typing import Any, Callable

from rayvit.gpu_check.cases import (NotCheckable, check_activation_memory, check_fairscale_weight_decay, check_flash,
                                    check_layer_norm_fp32, check_nccl, check_nvml_sampler, check_profile,
                                    check_reduce_dtype, check_training, one_line)
from rayvit.gpu_check.checkpoints import check_final_model
from rayvit.gpu_check.decode import check_gpu_decode
from rayvit.gpu_check.group_cases import (check_cold_compile, check_collective_counts, check_group_memory,
                                          check_nan_on_one_rank, check_out_of_step, check_state_after_evaluation)
from rayvit.gpu_check.hsdp_cases import check_hsdp
from rayvit.gpu_check.ladder_runs import free_device_memory
from rayvit.gpu_check.recompute import check_recompute_dtype


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
