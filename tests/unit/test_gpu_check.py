"""experiments/gpu_check.py outside a GPU: its help, and a clear refusal (no traceback) without CUDA.

The check itself needs a GPU and is never run here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_check.py"


def _run_file(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _run(*args: str) -> subprocess.CompletedProcess:
    """The script's own ``main``, in this process (a subprocess spends a second or more importing), with
    what it prints and its exit status as a subprocess would give them."""
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = script.main(list(args))
        except SystemExit as e:                 # argparse: --help, bad arguments
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess([str(SCRIPT), *args], code, out.getvalue(), err.getvalue())


def test_help_lists_the_checks_and_options():
    proc = _run_file("--help")                  # the file itself, run as a user runs it
    assert proc.returncode == 0, proc.stderr
    for text in ("--model", "vit_h16", "--compile", "--out", "nccl", "flash", "fairscale_fsdp", "ladder",
                 "--quick", "--list", "layernorm", "reduce", "decay"):
        assert text in proc.stdout


def test_list_names_every_case_without_a_gpu():
    full = _run("--list")
    assert full.returncode == 0, full.stderr
    for case in ("strategy fairscale_fsdp fp32", "strategy fairscale_fsdp amp-fp16",
                 "strategy fairscale_fsdp mixed-fp16 +clip", "strategy fairscale_fsdp pure-fp16 +clip",
                 "layernorm fp32 ddp mixed-bf16", "layernorm fp32 fsdp mixed-bf16",
                 "layernorm fp32 fairscale_fsdp mixed-fp16", "reduce ddp mixed-bf16 ->fp32",
                 "reduce fsdp pure-bf16 ->fp32", "reduce fairscale_fsdp mixed-fp16 ->half",
                 "decay fairscale_fsdp flat params", "precision pure-fp16", "7-full_half/w1",
                 "state bytes fairscale_fsdp mixed-fp16 after eval", "free memory per round (fairscale_fsdp in a group)",
                 "final model fairscale_fsdp mixed-fp16 after eval", "final model fsdp mixed-bf16 after eval",
                 "nan on one rank (2 GPUs)", "collective counts (nccl, 1 rank)", "out of step on one rank (2 GPUs)",
                 "recompute dtype fairscale_fsdp amp-bf16", "recompute dtype fairscale_fsdp mixed-bf16",
                 "activation checkpointing fairscale_fsdp mixed-bf16"):
        assert case in full.stdout
    assert "compile" not in full.stdout            # torch.compile only with --compile
    compiled = _run("--list", "--quick", "--compile")
    assert compiled.returncode == 0, compiled.stderr
    for case in ("compile ddp amp-bf16", "compile fsdp mixed-bf16", "compile cold in every run", "8-compile/w1"):
        assert case in compiled.stdout
    refused = _run("--list", "--compile", "--warmup", "0")
    assert refused.returncode == 2 and "--compile needs --warmup >= 1" in refused.stderr
    quick = _run("--list", "--quick")
    assert quick.returncode == 0, quick.stderr
    assert "10 steps, 3 warm-up" in quick.stdout and "precision pure-fp16" not in quick.stdout
    assert "strategy fairscale_fsdp pure-fp16 +clip" in quick.stdout
    assert len(quick.stdout.splitlines()) < len(full.stdout.splitlines())


def _gpu_check_module():
    import rayvit.gpu_check

    return rayvit.gpu_check


def test_dtype_checks_run_on_cpu_where_their_strategies_do():
    """The layernorm and reduce cases' own code (hooks, spies, verdicts), on CPU for ddp and fsdp."""
    check = _gpu_check_module()
    cpu = torch.device("cpu")
    facts = check.check_layer_norm_fp32(cpu, "fsdp", "bf16", steps=2)
    assert facts.startswith("LayerNorm weight fp32, output fp32, grad fp32; matmuls bf16")
    assert check.check_reduce_dtype(cpu, "ddp", "mixed", "bf16", "half", steps=1).startswith(
        "reduced in bf16/fp32")          # half buckets in bf16, the fp32 LayerNorm bucket in fp32
    assert check.check_reduce_dtype(cpu, "fsdp", "pure", "bf16", "fp32", steps=1).startswith("reduced in fp32")
    assert check.check_recompute_dtype(cpu, "ddp", "amp", "bf16", steps=1) == (
        "8 block matmuls (4 blocks x 1 steps x forward + recompute) in bf16; gradients finite")


def test_the_collective_count_cases_run_on_cpu_over_gloo():
    """What the ranks compare after each run grows by one per collective as it is issued (gloo here, NCCL on
    a GPU); the two-rank case needs two GPUs."""
    check = _gpu_check_module()
    cpu = torch.device("cpu")
    assert check.check_collective_counts(cpu) == (
        "gloo: {'0': 0} before, {'0': 3} with 3 all-reduces issued, {'0': 3} once they completed")
    assert not torch.distributed.is_initialized()
    with pytest.raises(check.NotCheckable, match="needs two ranks over NCCL"):
        check.check_out_of_step(cpu)


def test_a_check_that_cannot_fail_on_this_machine_reports_n_a_never_pass():
    """FairScale's reduce dtype cannot show at one rank (it sends nothing and forces fp32): without two
    GPUs that case is N/A, printed so, and not a failure of the run."""
    from functools import partial

    check = _gpu_check_module()
    lines: list[str] = []
    for reduce in ("fp32", "half"):
        result = check.run_check(f"reduce fairscale_fsdp mixed-fp16 ->{reduce}", partial(
            check.check_reduce_dtype, torch.device("cpu"), "fairscale_fsdp", "mixed", "fp16", reduce), lines.append)
        assert result["ok"] is None and result["detail"].startswith("not checkable on one GPU")
    assert all(line.startswith("  N/A ") for line in lines) and not any("PASS" in line for line in lines)
    # A real failure is still a failure.
    failed = check.run_check("reduce ddp", partial(check.check_reduce_dtype, torch.device("cpu"), "ddp", "mixed",
                                                   "bf16", "fp32", steps=0), lines.append)
    assert failed["ok"] is False and lines[-1].startswith("  FAIL")


def test_bad_arguments_exit_2():
    proc = _run("--steps", "3", "--warmup", "3")
    assert proc.returncode == 2
    assert "--warmup" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal path cannot be seen")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--out", str(out))
    assert proc.returncode == 2
    assert "no GPU to check" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()
