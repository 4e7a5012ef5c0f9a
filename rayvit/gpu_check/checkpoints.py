"""The GPU check's case about checkpoints: the model a run's final checkpoint holds is the model the
strategy trained, where only a GPU trains it (see :mod:`rayvit.gpu_check`)."""

from __future__ import annotations

from rayvit.gpu_check.cases import small_config


def check_final_model(device, strategy: str, mode: str, dtype: str) -> str:
    """After 4 steps on digits and the final evaluation (a forward without a backward, which leaves
    FairScale's root gathered), the model alone (``checkpoint_io.save_model``, what a ``make_trainer`` run's
    final checkpoint holds), read back by ``load_checkpoint``, equals the strategy's own full state: for
    FairScale FSDP its flat shards consolidated offline against ``state_dict()`` gathered by FairScale
    itself (fp32 under mixed precision); for FSDP2 the gather onto rank 0 against its DTensors' full
    tensors. On CPU FairScale's FSDP cannot run a forward; the CPU tier checks its layout untrained."""
    import tempfile

    import torch

    from rayvit.worker import Session
    from rayvit.worker.checkpoint_io import load_checkpoint, save_model

    cfg = small_config({"parallel.strategy": strategy, "precision.mode": mode, "precision.dtype": dtype,
                        "data.name": "digits"}, steps=4)
    session = Session(cfg, device)
    try:
        for _ in range(4):
            session.clear_grads()
            session.train_step()
        session.evaluate()
        with tempfile.TemporaryDirectory() as folder:
            save_model(session, folder)
            loaded = load_checkpoint(folder).model.state_dict()
        expected = {_plain(k): v.detach().float().cpu() for k, v in _full_state(session).items()}
    finally:
        session.close()
    if set(loaded) != set(expected):
        saved, held = sorted(set(loaded) - set(expected)), sorted(set(expected) - set(loaded))
        raise RuntimeError(f"the saved model's tensors are not the strategy's: only saved {saved[:3]}, "
                           f"only held {held[:3]}")
    worst = max(expected, key=lambda k: (loaded[k] - expected[k]).abs().max().item())
    difference = (loaded[worst] - expected[worst]).abs().max().item()
    if difference > 0:
        raise RuntimeError(f"the saved model differs from the trained one: {worst} by up to {difference:.3g}")
    numel = sum(v.numel() for v in expected.values())
    return f"{len(expected)} tensors, {numel:,} values, equal to the strategy's own full state after the evaluation"


def _full_state(session) -> dict:
    """The strategy's whole model as its library gathers it."""
    if session.cfg.parallel.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in get_model_state_dict(session.model).items()}
    return session.model.state_dict()


def _plain(name: str) -> str:
    """A parameter's name without the wrappers' own path segments (FairScale's, should any remain)."""
    return ".".join(part for part in name.split(".") if part not in ("_fsdp_wrapped_module", "_fpw_module"))
