"""The GPU check's worker-group cases (``rayvit gpu-check``), run on CPU where their strategies run: about
10 s of the small ViT, so out of the fast tier (tests/unit/test_gpu_check.py has the rest)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
def test_worker_group_cases_run_on_cpu_where_their_strategies_do():
    """The state and rounds cases' own code, on CPU for fsdp and ddp (their GPU cases add fairscale_fsdp
    and free device memory): ~10 s of the small ViT, so in the slow tier."""
    import rayvit.gpu_check as check

    cpu = torch.device("cpu")
    assert check.check_state_after_evaluation(cpu, "fsdp", "mixed", "bf16").endswith(
        "B per rank in every run (reshard on/off, with/without a validation split); projected 53,817,728 B")
    assert check.check_group_memory(cpu, ("ddp", "fsdp")) == (
        "after rounds 1/2: ddp 1 process groups; fsdp 1 process groups")
    assert not torch.distributed.is_initialized()
    with pytest.raises(check.NotCheckable, match="needs two ranks over NCCL"):
        check.check_nan_on_one_rank(cpu)
