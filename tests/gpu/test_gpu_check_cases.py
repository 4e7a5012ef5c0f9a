"""The GPU check's cases as tests (``rayvit gpu-check --quick``'s list): each runs on one CUDA device,
and the whole folder is skipped without one. CI has no GPU; a machine with one runs ``pytest tests/gpu``."""

import pytest
import torch

from rayvit import gpu_check

if not torch.cuda.is_available():
    pytest.skip(gpu_check.no_cuda_reason() or "no CUDA device", allow_module_level=True)

DEVICE = torch.device("cuda", torch.cuda.current_device())
CASES = dict(gpu_check.plan_checks(DEVICE, quick=True, compile_=False))


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_case(name):
    try:
        detail = CASES[name]()       # raises with its reason when the case fails
    except gpu_check.NotCheckable as e:
        pytest.skip(str(e))          # e.g. FairScale's reduce dtype needs two GPUs
    print(f"{name}: {detail}")
