"""rayvit as a library, without Ray running: configs by name or dict, the driver-side checks of a trainer,
checkpoints read back into a model, two runs compared, and a caller's process left as it was found."""

from __future__ import annotations

import math
import time

import pytest
import torch

from rayvit import stats
from rayvit.config import as_config, load_config
from rayvit.errors import ConfigError
from rayvit.results import Comparison, RunResult
from rayvit.worker import Session, train
from rayvit.worker import run_figures
from rayvit.worker.checkpoint_io import load_checkpoint, resume, save_model, save_state

from helpers_process import ProcessSnapshot
from helpers_sessions import Counted, checkpointed_after, train_steps

TINY = ["train.steps=4", "train.warmup_steps=1"]


def test_load_config_resolves_the_shipped_config_names_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("cpu_default") == load_config("cpu_default.yaml")
    assert load_config("cpu_default").to_dict() == as_config("cpu_default").to_dict()
    with pytest.raises(ConfigError, match="nor is it one of the configs rayvit ships: cpu_default"):
        load_config("cpu_defualt")


def test_entry_points_take_a_config_or_its_dict_and_refuse_anything_else():
    cfg = load_config("cpu_default", TINY)
    assert as_config(cfg.to_dict()) == cfg and as_config(cfg) is cfg
    assert train(cfg.to_dict())["timed_steps"] == 3
    with pytest.raises(ConfigError, match="model.nmae"):
        as_config({**cfg.to_dict(), "model": {"nmae": "vit_b16"}})
    with pytest.raises(ConfigError, match="expected a rayvit Config"):
        train(42)


def test_train_and_compare_leave_the_callers_process_as_they_found_it():
    from rayvit.worker.bench import compare

    torch.set_num_threads(2)
    before = ProcessSnapshot()
    train(load_config("cpu_default", TINY))
    comparison = compare(load_config("cpu_default", TINY), load_config("cpu_default", [*TINY, "optim.impl=loop"]),
                         rounds=2)
    assert before.differences() == []
    assert comparison.ratio.lo <= comparison.ratio.median <= comparison.ratio.hi


def test_a_session_that_fails_to_build_releases_what_it_made(tmp_path):
    """A setup that fails after the one-rank process group was made (data that cannot be read, the last
    thing a session builds) releases the group, the excepthook it wrapped and the thread count: the next
    session makes and ends a group of its own, and train() leaves the process as it found it."""
    import sys

    import torch.distributed as dist

    broken = load_config("cpu_default", [*TINY, "data.name=parquet", f"data.path={tmp_path / 'missing.parquet'}",
                                         "model.compile=true"])
    torch.set_num_threads(2)
    before = ProcessSnapshot()
    hook = sys.excepthook
    with pytest.raises(ConfigError, match="missing.parquet"):
        Session(broken)
    assert not dist.is_initialized(), "the failed session left its process group"
    assert sys.excepthook is hook and torch.get_num_threads() == 2 and before.differences() == []
    session = Session(load_config("cpu_default", TINY))
    assert session.owns_process_group
    session.close()
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="missing.parquet"):
        train(broken)
    assert not dist.is_initialized() and before.differences() == []


def test_a_trainer_is_checked_on_the_driver_before_any_worker_starts():
    """A typo, a ScalingConfig that disagrees with the config: refused when the trainer is built, in well
    under two seconds, with both values named."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayvit.trainer import loop_config, make_trainer, scaling_config

    cfg = load_config("cpu_default", ["parallel.num_workers=2"])
    start = time.monotonic()
    with pytest.raises(ConfigError, match="num_workers=4 against parallel.num_workers=2"):
        make_trainer(cfg, scaling_config=ScalingConfig(num_workers=4))
    with pytest.raises(ConfigError, match="CPU=2 against parallel.cpus_per_worker=1"):
        make_trainer(cfg, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}))
    with pytest.raises(ConfigError, match="train.setps"):
        make_trainer({**cfg.to_dict(), "train": {"setps": 3}})
    with pytest.raises(ConfigError, match="train.setps"):
        loop_config({**cfg.to_dict(), "train": {"setps": 3}})
    assert time.monotonic() - start < 2
    trainer = make_trainer(cfg, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}))
    assert isinstance(trainer, TorchTrainer)
    assert scaling_config(cfg).num_workers == 2 and scaling_config(cfg).resources_per_worker == {"CPU": 1.0}


def test_the_workers_get_a_typed_payload_as_one_key_of_a_plain_dict():
    """loop_config's train_loop_config is a dict of one key (what Ray Train and Tune see) holding a plain
    dict; a run and a group each go to their own worker function, which refuses any other payload with a
    ConfigError naming what makes the right one, before touching Ray."""
    from rayvit.launch.entry import measure_group_per_worker
    from rayvit.launch.payload import GroupPayload, RunPayload
    from rayvit.launch.torch_trainer import RayvitTrainer
    from rayvit.trainer import loop_config, make_trainer, train_loop_per_worker

    cfg = load_config("cpu_default", ["parallel.num_workers=2"])
    handed = loop_config(cfg, final_model=False)
    assert list(handed) == ["rayvit"] and isinstance(handed["rayvit"], dict)
    assert RunPayload.of(handed) == RunPayload(cfg.to_dict(), final_model=False)
    trainer = make_trainer(cfg)
    assert trainer.train_loop_per_worker is train_loop_per_worker
    assert RunPayload.of(trainer.train_loop_config) == RunPayload(cfg.to_dict())
    group = RayvitTrainer(cfg, group=[cfg, cfg.replace({"optim.impl": "loop"})], rounds=3, measure_links={})
    assert group.train_loop_per_worker is measure_group_per_worker
    payload = GroupPayload.of(group.train_loop_config)
    assert payload.rounds == 3 and payload.links == {} and len(payload.group) == 2
    assert payload.group[1]["optim"]["impl"] == "loop"
    with pytest.raises(ConfigError, match=r"rayvit.trainer.loop_config\(cfg\)"):
        train_loop_per_worker({"rayvit": cfg.to_dict()})
    with pytest.raises(ConfigError, match="a RunPayload"):
        train_loop_per_worker(group.train_loop_config)
    with pytest.raises(ConfigError, match="a GroupPayload"):
        measure_group_per_worker(handed)
    with pytest.raises(ConfigError, match="unknown fields"):
        RunPayload.of({"rayvit": {**handed["rayvit"], "rounds": 3}})


@pytest.mark.parametrize("strategy, mode", [("ddp", "fp32"), ("ddp", "mixed"), ("fsdp", "mixed"),
                                            ("fairscale_oss", "fp32")])
def test_a_checkpoint_of_any_strategy_loads_into_one_plain_model(tmp_path, strategy, mode):
    """What the run's optimizer stepped comes back: fp32 weights (the master copy under mixed), the
    optimizer state, the step and the config."""
    cfg = load_config("cpu_default", [*TINY, f"parallel.strategy={strategy}", f"precision.mode={mode}"])
    session = Session(cfg)
    try:
        train_steps(session, 3)
        save_state(session, str(tmp_path))
        if strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import get_state_dict

            expected = {k: v.full_tensor() for k, v in get_state_dict(session.model, session.optimizer)[0].items()}
        else:
            model = session.strategy.unwrap(session.model)
            expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if session.masters is not None:
                expected.update({n: session.masters.master_of(p).detach().clone() for n, p in model.named_parameters()})
    finally:
        session.close()
    loaded = load_checkpoint(tmp_path)
    state = loaded.model.state_dict()
    assert set(state) == set(expected) and loaded.step == 3 and loaded.config == cfg
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value.float(), msg=key)
    assert loaded.optimizer_state and not loaded.model.training


@pytest.mark.parametrize("strategy, overrides", [("ddp", ["precision.mode=fp32"]), ("ddp", ["precision.mode=mixed"]),
                                                  ("fsdp", ["precision.mode=mixed"]),
                                                  ("fsdp", ["parallel.reshard_after_forward=false"]),
                                                  ("fairscale_oss", [])])
def test_a_finished_runs_model_alone_loads_into_one_plain_model(tmp_path, strategy, overrides):
    """What a run's final checkpoint holds by default: the model as the optimizer left it, after the final
    evaluation (which leaves FSDP2's parameters gathered without resharding), with no optimizer state; no
    run resumes from it."""
    from rayvit.worker.checkpoint_io import resumable

    cfg = load_config("cpu_default", [*TINY, "data.name=digits", f"parallel.strategy={strategy}", *overrides])
    session = Session(cfg)
    try:
        train_steps(session, 3)
        accuracy = session.evaluate()["val_accuracy"]
        save_model(session, str(tmp_path))
        save_state(session, str(tmp_path / "full"))
    finally:
        session.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "meta.json", "state.pt"]
    loaded, full = load_checkpoint(tmp_path), load_checkpoint(tmp_path / "full")
    assert loaded.step == 3 and loaded.optimizer_state is None and loaded.config == cfg
    assert not resumable(str(tmp_path)) and resumable(str(tmp_path / "full"))
    state = loaded.model.state_dict()
    for key, value in full.model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert loaded.evals[-1]["val_accuracy"] == accuracy


def test_a_resumed_session_continues_its_input_without_drawing_the_batches_before_it(tmp_path):
    """Resuming from a step-7 checkpoint on digits: no batch of the first 7 steps is drawn again, the next
    batch is the one an unbroken run draws at step 7, and the run reports that its input continued."""
    cfg = load_config("cpu_default", ["data.name=digits", "train.steps=12", "train.warmup_steps=1"])
    unbroken = Session(cfg)
    try:
        expected = [next(unbroken.data.train) for _ in range(8)][7]
    finally:
        unbroken.close()
    checkpointed_after(cfg, 7, tmp_path)
    resumed = Session(cfg)
    try:
        resumed.data.train = counted = Counted(resumed.data.train)
        resume(resumed, str(tmp_path))
        assert counted.drawn == 0, f"resuming drew the {counted.drawn} batches it skips"
        images, labels = next(resumed.data.train)
        assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
        assert resumed.step == 7 and resumed.restarts == 1
        assert run_figures.running(resumed)["data_fresh_starts"] == 0
    finally:
        resumed.close()


def test_fairscale_fsdp_shards_are_consolidated_into_one_model(tmp_path):
    """FairScale FSDP trains on GPUs only, but its wrapper, flat shards and metadata exist on CPU: what its
    strategy saves is consolidated by FairScale's own offline routine."""
    import torch.distributed as dist
    from fairscale.nn import FullyShardedDataParallel

    from rayvit.models import build_model
    from rayvit.training import checkpoint_layout
    from rayvit.strategies.fairscale_fsdp import FairScaleFSDP

    cfg = load_config("cpu_default")
    model = build_model(cfg.model)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = FullyShardedDataParallel(model, compute_device=torch.device("cpu"))
        optimizer = torch.optim.AdamW(wrapped.parameters())
        FairScaleFSDP.save(None, str(tmp_path), wrapped, optimizer)
    finally:
        dist.destroy_process_group()
    checkpoint_layout.write_meta(str(tmp_path), {"step": 0, "config": cfg.to_dict()})
    loaded = load_checkpoint(tmp_path)
    for key, value in expected.items():
        torch.testing.assert_close(loaded.model.state_dict()[key], value, msg=key)
    assert isinstance(loaded.optimizer_state, list) and len(loaded.optimizer_state) == 1
    # The model alone (a run's final checkpoint by default): the same shards without the optimizer.
    alone = tmp_path / "alone"
    alone.mkdir()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        FairScaleFSDP.save_model(None, str(alone), wrapped)
    finally:
        dist.destroy_process_group()
    checkpoint_layout.write_meta(str(alone), {"step": 0, "config": cfg.to_dict(), "resumable": False})
    loaded = load_checkpoint(alone)
    for key, value in expected.items():
        torch.testing.assert_close(loaded.model.state_dict()[key], value, msg=key)
    assert loaded.optimizer_state is None


def test_a_folder_without_a_model_says_how_to_get_one(tmp_path):
    with pytest.raises(ConfigError, match="train.checkpoint_every > 0"):
        load_checkpoint(tmp_path)


def _result(times: list[list[float]], rounds: list[int]) -> RunResult:
    cfg = load_config("cpu_default")
    metrics = {"train_flops_per_image": 3e7, "peak_tflops": 0.2}
    conditions = {"batch_per_chip": cfg.train.batch_size, "world_size": 1}
    per_round = [RunResult(metrics=dict(metrics), conditions=dict(conditions), step_times=t) for t in times]
    return RunResult.of_rounds(per_round, [(r, 0) for r in rounds])


def test_two_runs_compare_as_a_paired_ratio_with_its_interval_and_verdict():
    fast = _result([[0.01] * 10, [0.011] * 10, [0.0105] * 10], [0, 1, 2])
    slow = _result([[0.02] * 10, [0.022] * 10, [0.021] * 10], [0, 1, 2])
    ratio = stats.compare(fast, slow)
    assert ratio.median == pytest.approx(2.0) and ratio.rounds == 3
    comparison = Comparison(slow, fast)
    assert comparison.verdict == "higher" and comparison.ratio.median == pytest.approx(2.0)
    assert "2.000x" in comparison.text() and "beyond noise" in comparison.text()
    assert Comparison(slow, slow).verdict == "within noise"
    # Runs from different rounds (two fits): each side resampled alone.
    other = _result([[0.02] * 10], [7])
    assert stats.compare(fast, other).rounds == 1
    with pytest.raises(TypeError, match="rayvit.stats.compare"):
        stats.paired_ratio(fast, slow, lambda s: s, lambda s: s)
    with pytest.raises(ValueError, match="not a figure of the step time"):
        stats.compare(fast, slow, "final_loss")
    assert math.isfinite(stats.compare(fast, slow, "tflops_per_chip").median)
