"""model.compile without compiling: where each strategy puts torch.compile, and how compile time is counted.

torch.compile is lazy (nothing compiles before the first forward), so these build real sessions and stay
fast; compiled training itself runs in tests/ray (2 gloo ranks per strategy, and ``rayvit bench``).
"""

import os

import pytest
import torch
from torch._dynamo.eval_frame import OptimizedModule

from rayvit.cli import main
from rayvit.config import load_config
from rayvit.results import CONDITION_KEYS, METRIC_KEYS, RunResult
from rayvit.worker import Session, run_figures
from rayvit.worker.compiling import compile_overhead_s
from helpers_results import make_result

TINY = ["train.batch_size=4", "model.depth=2"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fairscale_oss"])
def test_each_strategy_compiles_where_its_library_supports_it(strategy):
    # Where torch.compile goes, whatever compiles it: the eager backend spares the process Inductor's set-up.
    session = Session(load_config(overrides=TINY + [f"parallel.strategy={strategy}", "model.compile=true",
                                                    "model.compile_backend=eager"]))
    try:
        vit = session.strategy.unwrap(session.model)
        if strategy == "ddp":
            # The DDP-wrapped model compiled whole (DDPOptimizer splits it at the buckets); blocks untouched.
            assert isinstance(session.forward, OptimizedModule) and session.forward._orig_mod is session.model
            assert type(session.model).__name__ == "DistributedDataParallel"
            assert not any(isinstance(b, OptimizedModule) for b in vit.blocks)
        else:
            # Each block compiled before the wrapper saw it; the loop calls the wrapped model itself.
            assert session.forward is session.model
            assert all(isinstance(b, OptimizedModule) for b in vit.blocks)
        if strategy == "fsdp":
            from torch.distributed.fsdp import FSDPModule

            # fully_shard went onto the compiled block: its hooks run outside the compiled graph.
            assert all(isinstance(b, FSDPModule) for b in vit.blocks)
        # The optimizer holds the same parameters as without compile (weight decay decided as before).
        eager = Session(load_config(overrides=TINY + [f"parallel.strategy={strategy}"]))
        try:
            shapes = lambda s: [[tuple(p.shape) for p in g["params"]] for g in s.optimizer.param_groups]  # noqa: E731
            assert shapes(session) == shapes(eager)
        finally:
            eager.close()
    finally:
        session.close()


def test_without_compile_nothing_is_compiled():
    session = Session(load_config(overrides=TINY + ["parallel.strategy=fsdp"]))
    try:
        assert session.forward is session.model
        assert not any(isinstance(m, OptimizedModule) for m in session.model.modules())
        assert run_figures.compile_time_s(session) == 0.0
    finally:
        session.close()


def test_compile_time_is_what_warm_up_steps_took_beyond_a_timed_step():
    assert compile_overhead_s([30.2, 0.9], [0.2, 0.3, 0.2]) == pytest.approx(30.0 + 0.7)
    assert compile_overhead_s([0.1], [0.2, 0.2]) == 0.0        # a quick warm-up step costs nothing
    assert "compile_time_s" in METRIC_KEYS
    # Over rounds: the largest, the cold compile (later rounds of one worker may hit warm caches).
    rounds = []
    for t in (40.0, 2.0):
        r = make_result("fsdp", 2, 0.5, 10.0)
        r.metrics["compile_time_s"], r.step_times = t, [0.1] * 5
        rounds.append(r)
    assert RunResult.of_rounds(rounds).metrics["compile_time_s"] == 40.0
    assert "compile_time_s" not in RunResult.of_rounds([make_result("fsdp", 2, 0.5, 10.0)]).metrics


def test_bench_keeps_compiling_out_of_the_timing(capsys):
    assert main(["bench", "--warmup", "0", "--compare", "model.compile=false,true"]) == 2
    assert "needs --warmup >= 1" in capsys.readouterr().err
    assert main(["bench", "--warmup", "0", "model.compile=true"]) == 2
    assert "needs --warmup >= 1" in capsys.readouterr().err
    assert main(["bench", "--compare", "model.compile=false,true", "parallel.strategy=fairscale_fsdp",
                 "parallel.use_gpu=true"]) == 2
    assert "does not support torch.compile" in capsys.readouterr().err
    assert torch.compiler.is_compiling() is False


def test_every_compiled_run_compiles_from_empty_caches_and_leaves_the_process_as_it_was(monkeypatch):
    """Four compiled runs in one process, as in a worker group's round: before, the second strategy ran
    the first's graphs and the fourth (ddp again) compiled nothing. The eager backend runs dynamo's part
    of compiling in seconds (Inductor's own is in tests/ray's compiled runs and ``rayvit bench``)."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from rayvit.worker import train

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/a/users/own/triton")       # a user's setting, kept
    settings = lambda: (inductor_config.fx_graph_remote_cache, inductor_config.autotune_remote_cache,  # noqa: E731
                        functorch_config.enable_remote_autograd_cache, dynamo_config.automatic_dynamic_remote_pgo)
    before = settings()
    dirs: list[list[str]] = []
    results = []
    for strategy in ("ddp", "fsdp", "fairscale_oss", "ddp"):
        cfg = load_config(overrides=TINY + [f"parallel.strategy={strategy}", "model.compile=true",
                                            "model.compile_backend=eager", "train.steps=3", "train.warmup_steps=1"])
        seen: list[str] = []
        results.append(train(cfg, on_step=lambda s, _seen=seen: _seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])))
        dirs.append(seen)
    graphs = [r.metrics["compile_graphs"] for r in results]
    assert all(g > 0 for g in graphs) and graphs[3] == graphs[0], graphs
    assert all(r.conditions["compile_cold"] is True and r.metrics["compile_time_s"] >= 0 for r in results)
    # Each run compiled in a cache directory of its own, removed after it; the process is as it was.
    assert all(len(set(d)) == 1 for d in dirs) and len({d[0] for d in dirs}) == 4
    assert not any(os.path.exists(d[0]) for d in dirs)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.environ["TRITON_CACHE_DIR"] == "/a/users/own/triton"
    assert settings() == before


def test_a_run_may_reuse_the_caches_and_says_so():
    from rayvit.worker import train

    cfg = load_config(overrides=TINY + ["model.compile=true", "model.compile_backend=eager", "model.compile_cold=false",
                                        "train.steps=2", "train.warmup_steps=1"])
    result = train(cfg)
    assert result.conditions["compile_cold"] is False and result.metrics["compile_graphs"] > 0
    assert "compile_cold" not in train(cfg.replace({"model.compile": False})).conditions
    assert {"compile_cold"} <= set(CONDITION_KEYS) and {"compile_graphs", "compile_time_s"} <= set(METRIC_KEYS)
