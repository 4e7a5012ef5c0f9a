"""model.compile without compiling: where each strategy puts torch.compile, and how compile time is counted.

torch.compile is lazy (nothing compiles before the first forward), so these build real sessions and stay
fast; compiled training itself runs in tests/ray (2 gloo ranks per strategy, and ``rayvit bench``).
"""

import pytest
import torch
from torch._dynamo.eval_frame import OptimizedModule

from rayvit.cli import main
from rayvit.config import load_config
from rayvit.results import METRIC_KEYS, RunResult
from rayvit.worker import Session
from rayvit.worker.loop import compile_overhead_s
from shared import make_result

TINY = ["train.batch_size=4", "model.depth=2"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fairscale_oss"])
def test_each_strategy_compiles_where_its_library_supports_it(strategy):
    session = Session(load_config(overrides=TINY + [f"parallel.strategy={strategy}", "model.compile=true"]))
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
        assert session.compile_time_s() == 0.0
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
