"""Checks of the activation model against what autograd and the allocator actually hold.

- :func:`saved_bytes_per_image` (any device): bytes of the distinct storages autograd saves for backward
  during one forward of the ViT, per image: exactly what the analytic activation count describes.
- :func:`saved_bytes_slope` (any device, any strategy, 1 or more ranks): the same inside a training
  session's wrapped model, per image as a slope over two batch sizes.
- :func:`allocator_check` (CUDA): ``torch.cuda.max_memory_allocated`` over a training step at two batch
  sizes; the slope per image is compared with the modelled activations per image, the peak with the
  modelled total (state + activations + transient). ``experiments/gpu_check.py`` runs it.
"""

from __future__ import annotations

from typing import Any

from rayvit.config_schema import Config


def saved_bytes_per_image(cfg: Config, device, batch: int = 4) -> float:
    """Distinct storages saved for backward by one forward of ``cfg``'s model (in its precision), per image."""
    import torch

    from rayvit.models import build_model
    from rayvit.training.precision import Precision
    from rayvit.strategies import strategy_class

    precision = Precision(cfg.precision, device, strategy_class(cfg.parallel.strategy).owns_mixed_precision)
    model = precision.prepare_model(build_model(cfg.model).to(device))
    images = torch.randn(batch, 3, cfg.model.image_size, cfg.model.image_size, device=device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:           # weights are model state, not activations
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision.autocast():
        logits = model(precision.cast_inputs(images))
        torch.nn.functional.cross_entropy(logits.float(), torch.zeros(batch, dtype=torch.long, device=device))
    return sum(seen.values()) / batch


def saved_bytes_slope(session, batches: tuple[int, int] = (2, 6)) -> float:
    """Bytes autograd saves per image in one forward of a training ``Session``'s wrapped model (its
    strategy, precision and activation checkpointing), as the slope over two batch sizes: what does not
    grow with the batch (weights, FSDP's gathered parameters) cancels. Every rank of a group calls it."""
    import torch

    saved = {}
    for batch in batches:
        size = session.cfg.model.image_size
        images = torch.randn(batch, 3, size, size, device=session.device)
        seen: dict[int, int] = {}

        def pack(t):
            # Keyed by the storage itself, not its address: FSDP frees a block's gathered parameters after
            # its forward, and the next block's may be allocated at the same address.
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), session.precision.autocast():
            logits = session.forward(session.precision.cast_inputs(images))
        del logits
        saved[batch] = sum(seen.values())
    lo, hi = batches
    return (saved[hi] - saved[lo]) / (hi - lo)


def allocator_check(cfg: Config, device, batches: tuple[int, int] = (8, 24), steps: int = 3) -> dict[str, Any]:
    """Peak allocated bytes of a DDP training step at two batch sizes against the memory model (CUDA)."""
    import gc

    import torch

    from rayvit.projection.memory import memory
    from rayvit.worker import Session

    peaks = {}
    for batch in batches:
        session = Session(cfg.replace({"train.batch_size": batch, "parallel.num_workers": 1}), device)
        try:
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(steps):
                session.clear_grads()
                session.train_step()
            peaks[batch] = torch.cuda.max_memory_allocated(device)
        finally:
            session.close()
            del session
            gc.collect()
            torch.cuda.empty_cache()
    lo, hi = batches
    slope = (peaks[hi] - peaks[lo]) / (hi - lo)
    model = memory(cfg, 1, batch=lo)
    return {"measured_per_image": slope, "modelled_per_image": model.activations_per_image,
            "ratio_per_image": slope / model.activations_per_image,
            "measured_peak": peaks[lo], "modelled_peak": model.total, "ratio_peak": peaks[lo] / model.total,
            "batches": list(batches)}
