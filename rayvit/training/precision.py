"""Precision levels, named after the AMP optimisation levels practitioners know.

| mode    | AMP level | weights used in compute | optimizer sees                | loss scaling (fp16) |
| ------- | --------- | ----------------------- | ----------------------------- | ------------------- |
| `fp32`  | O0        | fp32                    | fp32 params, fp32 state       | no                  |
| `amp`   | O1        | fp32, ops autocast      | fp32 params, fp32 state       | yes                 |
| `mixed` | O2        | half                    | fp32 master copy, fp32 state  | yes                 |
| `pure`  | O3        | half                    | half params, half state       | yes                 |

``mixed`` is the study's "more advanced AMP mode"; ``pure`` is its "full FP16". Under the FSDP
strategies the ``mixed`` level is FSDP's own mixed-precision policy (sharded fp32 parameters are the
master copy, unsharded compute parameters are half), so no separate master copy is kept. bf16 needs no
loss scaling.

``mixed`` keeps LayerNorm in fp32 by default (``precision.layer_norm_fp32``), the study's fastest setting
without accuracy loss: LayerNorm parameters stay fp32 (no master copy needed), LayerNorm runs in fp32
(:class:`rayvit.models.vit.FP32LayerNorm`) and the step runs under autocast so that the matmuls fed by
its fp32 output still run in half, as pycls ran its O2 (FairScale FSDP ``mixed_precision`` parameters
inside ``torch.cuda.amp.autocast``, pycls/core/trainer.py ``setup_model`` and ``train_epoch``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rayvit.config_schema import PrecisionConfig
from rayvit.training.optim import local_shard

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_warned_cpu_fp16 = False


class LossScaler:
    """Dynamic loss scaling for fp16 that also works on half-precision gradients (``pure``).

    ``torch.amp.GradScaler`` refuses to unscale fp16 gradients, which is exactly the O3 case, so one small
    scaler serves every fp16 level. Overflow checks are all-reduced: sharded ranks hold different grads.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 200) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide grads by the scale in place; True when every grad on every rank is finite."""
        local = [local_shard(g) for g in grads]
        if local:
            torch._foreach_mul_(local, 1.0 / self.scale)
            norms = torch._foreach_norm(local)
            bad = torch.stack([n.float() for n in norms]).isfinite().logical_not().any().float()
        else:
            bad = torch.zeros(())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        finite = not bool(bad.item())
        if finite:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self.scale *= 2.0
                self._good_steps = 0
        else:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
        return finite


class MasterWeights:
    """fp32 master copies of half-precision model parameters (the ``mixed`` level without FSDP).

    Parameters that are fp32 already (LayerNorm kept in fp32) need no copy: the optimizer updates them
    directly, and ``master_of`` returns them unchanged.
    """

    def __init__(self, model_params: list[torch.nn.Parameter]) -> None:
        self.model_params = [p for p in model_params if p.dtype != torch.float32]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self._by_id = {id(p): m for p, m in zip(self.model_params, self.masters)}

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        return self._by_id.get(id(param), param)

    def grads_to_masters(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        torch._foreach_copy_(self.model_params, self.masters)


class Precision:
    """One precision level, resolved for a device and a parallel strategy."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device, owns_mixed_precision: bool = False) -> None:
        """``owns_mixed_precision``: the parallel strategy applies ``mixed`` itself (FSDP's policies)."""
        self.mode = cfg.mode
        self.dtype_name = cfg.dtype
        self.device = device
        self.half = HALF_DTYPES[cfg.dtype]
        self.strategy_owns_mixed = owns_mixed_precision
        global _warned_cpu_fp16
        if self.mode != "fp32" and self.half is torch.float16 and device.type == "cpu" and not _warned_cpu_fp16:
            _warned_cpu_fp16 = True
            warnings.warn(
                "precision.dtype=fp16 on CPU: legal but very slow (CPUs have no fast fp16 kernels: it runs "
                "several times slower than fp32). Use precision.dtype=bf16 on CPUs.", UserWarning, stacklevel=2)
        self.scaler: Optional[LossScaler] = (
            LossScaler() if self.mode != "fp32" and self.half is torch.float16 else None)
        # rayvit itself keeps LayerNorm in fp32 only under ``mixed`` (fp32 has nothing to keep; amp leaves
        # it to autocast's per-device policy; pure is everything half by definition).
        self.layer_norm_fp32 = self.mode == "mixed" and cfg.layer_norm_fp32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in."""
        return torch.float32 if self.mode == "fp32" else self.half

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the model is stored in before it is wrapped (FSDP's mixed policy casts itself)."""
        if self.mode == "pure" or (self.mode == "mixed" and not self.strategy_owns_mixed):
            return self.half
        return torch.float32

    @property
    def uses_master_weights(self) -> bool:
        return self.mode == "mixed" and not self.strategy_owns_mixed

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast ``model`` to the parameter dtype; under ``mixed`` with fp32 LayerNorm, keep the norms fp32."""
        model = model.to(dtype=self.param_dtype)
        if self.layer_norm_fp32:
            from rayvit.models.vit import keep_layer_norms_fp32

            keep_layer_norms_fp32(model)
        return model

    def cast_inputs(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.compute_dtype if self.mode in ("mixed", "pure") else torch.float32)

    @property
    def uses_autocast(self) -> bool:
        # ``mixed`` with fp32 LayerNorm: autocast runs the matmuls fed by the norms' fp32 output in half.
        return self.mode == "amp" or self.layer_norm_fp32

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.uses_autocast:
            return torch.autocast(self.device.type, dtype=self.half)
        return contextlib.nullcontext()

    def adam_eps(self, eps: float) -> float:
        """fp16 cannot hold 1e-8 (it rounds to 0 and 0/0 follows), so ``pure`` fp16 raises the floor."""
        if self.mode == "pure" and self.half is torch.float16:
            return max(eps, 1e-4)
        return eps

    def describe(self) -> str:
        return self.mode if self.mode == "fp32" else f"{self.mode}-{self.dtype_name}"


def grads_of(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]
