"""Fidelity to the study, in one process on CPU: LayerNorm kept in fp32 under ``mixed``, gradient reduce
dtypes, FairScale FSDP's settings and weight decay over flat shards, and refusals at config load.

What needs two ranks is in ``test_strategies_gloo.py``; what needs CUDA is a case of experiments/gpu_check.py.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rayvit.config import load_config, load_study
from rayvit.errors import ConfigError
from rayvit.models import build_model
from rayvit.studies.plan import plan
from rayvit.training import hardware
from rayvit.worker import Session, run_figures
from rayvit.training.optim import build_optimizer, param_groups
from rayvit.training.precision import Precision
from rayvit.strategies import Strategy, ensure_process_group, strategy_class

from helpers_fairscale import fairscale_fsdp_on_cpu, reference_step, unwrapped_paths

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"
CPU = torch.device("cpu")


# -- refusals at config load --------------------------------------------------------------------------


def test_pure_bf16_with_fairscale_fsdp_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="pure bf16 does not exist"):
        load_config(overrides=["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true",
                               "precision.mode=pure", "precision.dtype=bf16", "parallel.reduce_dtype=half"])
    # The study config's dry run plans every point; its fairscale_fsdp points must refuse pure bf16.
    with pytest.raises(ConfigError, match="fairscale_fsdp at 8 workers.*precision.dtype=fp16"):
        plan(load_study(CONFIGS / "study_a100.yaml", ["precision.mode=pure", "precision.dtype=bf16"]))


@pytest.mark.parametrize("strategy", ["fairscale_fsdp", "fairscale_oss"])
def test_fairscale_pure_cannot_reduce_in_fp32(strategy):
    base = [f"parallel.strategy={strategy}", "parallel.use_gpu=true", "precision.mode=pure",
            "precision.dtype=fp16"]
    with pytest.raises(ConfigError, match="parallel.reduce_dtype=half"):
        load_config(overrides=base + ["parallel.reduce_dtype=fp32"])
    assert load_config(overrides=base + ["parallel.reduce_dtype=half"]).parallel.reduce_dtype == "half"


# -- LayerNorm in fp32 under mixed --------------------------------------------------------------------


def _dtype_spy(model: nn.Module) -> dict[str, set]:
    """Forward hooks: LayerNorm weight/output dtypes, Linear (matmul) weight/output dtypes."""
    seen: dict[str, set] = {"norm_weight": set(), "norm_out": set(), "linear_weight": set(), "linear_out": set()}

    def on_norm(module, inputs, output):
        seen["norm_weight"].add(module.weight.dtype)
        seen["norm_out"].add(output.dtype)

    def on_linear(module, inputs, output):
        seen["linear_weight"].add(module.weight.dtype)
        seen["linear_out"].add(output.dtype)

    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.register_forward_hook(on_norm)
        elif isinstance(m, nn.Linear):
            m.register_forward_hook(on_linear)
    return seen


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mixed_keeps_layer_norm_fp32_while_matmuls_run_in_half(strategy):
    cfg = load_config(overrides=[f"parallel.strategy={strategy}", "precision.mode=mixed",
                                 "precision.dtype=bf16", "train.batch_size=4"])
    session = Session(cfg)
    try:
        inner = session.strategy.unwrap(session.model)
        seen = _dtype_spy(inner)
        session.train_step()
        assert seen["norm_weight"] == {torch.float32} and seen["norm_out"] == {torch.float32}
        assert seen["linear_weight"] == {torch.bfloat16} and seen["linear_out"] == {torch.bfloat16}
        norms = [m for m in inner.modules() if isinstance(m, nn.LayerNorm)]
        from rayvit.models.vit import FP32LayerNorm

        assert norms and all(isinstance(m, FP32LayerNorm) for m in norms)
        grads = [p.grad for m in norms for p in m.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        if strategy == "ddp":
            # Only the half parameters have an fp32 master copy; the fp32 norms are optimized directly.
            half = [p for p in inner.parameters() if p.dtype == torch.bfloat16]
            assert len(session.masters.masters) == len(half) > 0
        assert run_figures.conditions(session, "test")["layer_norm_fp32"] is True
    finally:
        session.close()


def test_layer_norm_fp32_can_be_turned_off_and_is_recorded():
    cfg = load_config(overrides=["precision.mode=mixed", "precision.layer_norm_fp32=false", "train.batch_size=4"])
    session = Session(cfg)
    try:
        seen = _dtype_spy(session.strategy.unwrap(session.model))
        session.train_step()
        assert seen["norm_weight"] == {torch.bfloat16} and seen["norm_out"] == {torch.bfloat16}
        assert run_figures.conditions(session, "test")["layer_norm_fp32"] is False
    finally:
        session.close()


# -- reduce dtypes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, reduce, expected", [
    ("mixed", "fp32", "fp32"), ("mixed", "half", "bf16"), ("pure", "fp32", "fp32"), ("pure", "half", "bf16"),
    ("amp", "half", "fp32"),        # amp's gradients are fp32: reduced in fp32 whatever is asked
])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_run_records_its_reduce_dtype(strategy, mode, reduce, expected):
    cfg = load_config(overrides=[f"parallel.strategy={strategy}", f"precision.mode={mode}",
                                 f"parallel.reduce_dtype={reduce}"])
    strategy_cls = strategy_class(strategy)
    s = strategy_cls(cfg, Precision(cfg.precision, CPU, strategy_cls.owns_mixed_precision), CPU)
    assert hardware.dtype_name(s.reduce_dtype) == expected
    if strategy == "fsdp" and mode != "amp":
        # FSDP2 reduces in its policy's reduce dtype, pure included (today's pure policy was empty).
        assert s.mixed_precision_policy().reduce_dtype == s.reduce_dtype


@pytest.mark.parametrize("reduce, wire", [("fp32", {torch.float32}), ("half", {torch.bfloat16, torch.float32})])
def test_ddp_mixed_sends_half_gradients_in_the_reduce_dtype(monkeypatch, reduce, wire):
    """A spy on the all-reduce DDP's hook calls: what dtype goes over the wire (fp32 buckets: LayerNorm)."""
    sent = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        sent.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    session = Session(load_config(overrides=["precision.mode=mixed", "train.batch_size=4",
                                             f"parallel.reduce_dtype={reduce}"]))
    try:
        session.train_step()
        assert set(sent) == wire
        assert run_figures.conditions(session, "test")["reduce_dtype"] == ("fp32" if reduce == "fp32" else "bf16")
    finally:
        session.close()


# -- FairScale FSDP: wrapping and weight decay (its forward needs CUDA; wrapping and the step do not) -----


@pytest.fixture
def one_rank():
    owned = ensure_process_group(CPU)
    yield
    if owned:
        dist.destroy_process_group()
        strategy_class("fairscale_fsdp").forget_process_groups()     # FairScale's, made from that group


def test_a_session_that_made_its_process_group_forgets_fairscales_groups_with_it():
    """One-process tools (gpu-check, bench) make and destroy a one-rank group per session: FairScale's
    cached groups go with it, and the next session's FairScale FSDP makes live ones."""
    from fairscale.internal.parallel import get_process_group_cached

    cfg = load_config(overrides=["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true", "model.depth=2"])
    for _ in range(2):
        session = Session(cfg, CPU)
        try:
            assert session.owns_process_group and session.model.process_group is get_process_group_cached()
            dist.all_reduce(torch.ones(1), group=session.model.process_group)     # a live group, each time
        finally:
            session.close()
        assert not hasattr(get_process_group_cached, "_global_group_cache")


FP16_ON_CPU = pytest.mark.filterwarnings("ignore:precision.dtype=fp16 on CPU")


@FP16_ON_CPU
def test_fairscale_fsdp_settings_per_precision(one_rank):
    from fairscale.nn import FullyShardedDataParallel as Wrapper

    _, _, model, _ = fairscale_fsdp_on_cpu(["precision.mode=pure", "precision.dtype=fp16", "parallel.reduce_dtype=half"])
    block = model.blocks[0]
    assert not block.mixed_precision and block.compute_dtype == torch.float16 and block.flatten_parameters
    assert all(p.dtype == torch.float16 for p in model.parameters())

    # mixed at world size 1: fp32_reduce_scatter even with a half reduce dtype (no reduction happens, and
    # only that flag casts the half gradient to the fp32 shard's dtype).
    _, _, model, _ = fairscale_fsdp_on_cpu(["precision.mode=mixed", "precision.dtype=fp16", "parallel.reduce_dtype=half"])
    block = model.blocks[0]
    assert block.mixed_precision and block.compute_dtype == torch.float16 and block.fp32_reduce_scatter
    assert block.flatten_parameters and len(block.params) == 1           # one flat parameter, one all-gather
    norms = [m for m in model.modules() if isinstance(m, Wrapper) and isinstance(Strategy.unwrap(m), nn.LayerNorm)]
    assert len(norms) == 2 * len(model.blocks) + 1
    assert all(not n.mixed_precision and not n.flatten_parameters for n in norms)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_fairscale_flat_parameters_decay_exactly_like_the_unwrapped_model(one_rank, optim):
    """Flat parameters mix decayed matrices with undecayed biases, norms, position embedding and class token."""
    from rayvit.training.optim import owned_parameters

    cfg, strategy, model, optimizer = fairscale_fsdp_on_cpu([f"optim.name={optim}", "optim.weight_decay=0.5", "optim.lr=0.1"])
    assert any(type(p).__name__ == "FlatParameter" for p in model.parameters())
    reference, grads = reference_step(cfg, 0, 1)
    ref_modules = dict(reference.named_modules())
    path_of = unwrapped_paths(model)
    # Each wrapped parameter -> the reference tensors it holds (a flat one lists them in flattening order).
    holds = {}
    for module, name, p in owned_parameters(model):
        parts = getattr(p, "_param_infos", None) or [(None, module, name)]
        holds[id(p)] = (p, [getattr(ref_modules[path_of[id(m)]], n) for _, m, n in parts])
    for p, refs in holds.values():
        p.grad = torch.cat([grads[id(r)].reshape(-1) for r in refs]).view_as(p)
    strategy.optimizer_step(model, optimizer)
    for p, refs in holds.values():
        expected = torch.cat([r.detach().reshape(-1) for r in refs]).view_as(p)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-6)


def test_auto_reduce_dtype_is_fp32_under_mixed_and_half_under_pure():
    """The default (auto) lets every strategy run every level it can, like for like within a sweep: a pure
    config (a search's winner, say) sweeps ddp, fsdp and fairscale_oss, all reducing in half."""
    from rayvit.config import load_study
    from rayvit.strategies.dtypes import reduces_in_half
    from rayvit.studies.plan import plan

    assert load_config().parallel.reduce_dtype == "auto"
    assert not reduces_in_half(load_config(overrides=["precision.mode=mixed"]))
    assert reduces_in_half(load_config(overrides=["precision.mode=pure"]))
    points = plan(load_study(CONFIGS / "cpu_default.yaml", ["precision.mode=pure"]))
    assert {p.cfg.parallel.strategy for p in points} == {"ddp", "fsdp", "fairscale_oss"}
    assert all(reduces_in_half(p.cfg) for p in points)
