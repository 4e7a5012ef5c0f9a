"""experiments/gpu_check.py outside a GPU: its help, and a clear refusal (no traceback) without CUDA.

The check itself needs a GPU and is never run here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_checks_and_options():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for text in ("--model", "vit_h16", "--compile", "--out", "nccl", "flash", "fairscale_fsdp", "ladder"):
        assert text in proc.stdout


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
