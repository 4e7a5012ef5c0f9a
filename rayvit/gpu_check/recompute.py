"""The GPU check's activation-checkpointing case: every recompute computes in the run's half dtype (see
:mod:`rayvit.gpu_check`)."""

from __future__ import annotations

import math

from rayvit.gpu_check.cases import dtype_names, trained_session


def check_recompute_dtype(device, strategy: str, mode: str, dtype: str, steps: int = 3) -> str:
    """Every block checkpointed: each block's first MLP matmul computes in the run's half dtype in its
    forward and again in its recompute (two calls per block and step, counted), the loss and gradients
    finite. FairScale's wrapper enters an fp16 autocast around its recompute
    (fairscale/nn/checkpoint/checkpoint_activations.py): under bf16, what would show is fp16 here."""
    import torch

    from rayvit.models.vit import MLP

    calls: list = []

    def spy(session) -> None:
        for m in session.model.modules():
            if isinstance(m, MLP):
                m[0].register_forward_hook(lambda module, args, out: calls.append(out.dtype))

    overrides = {"parallel.strategy": strategy, "precision.mode": mode, "precision.dtype": dtype,
                 "model.activation_checkpointing": "block"}
    session, losses = trained_session(device, overrides, steps, spy)
    try:
        depth = session.cfg.model.depth
        grads = [p.grad for p in session.model.parameters() if p.grad is not None]
        finite = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)
    finally:
        session.close()
    facts = (f"{len(calls)} block matmuls ({depth} blocks x {steps} steps x forward + recompute) in "
             f"{dtype_names(set(calls))}; gradients {'finite' if finite else 'NOT finite'}")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if len(calls) != 2 * depth * steps or set(calls) != {half}:
        raise RuntimeError(f"expected every forward and recompute in {dtype}: {facts}")
    if not (finite and all(math.isfinite(x) for x in losses)):
        raise RuntimeError(f"non-finite loss or gradients ({facts}): {losses}")
    return facts
