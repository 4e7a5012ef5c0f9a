"""rayvit.trainer on a real local Ray instance: strategies agree, FSDP shards, runs survive crashes."""

import os
import time

import pytest
import ray
import torch

from rayvit.config import load_config
from rayvit.data.digits import export_image_folder
from rayvit.results import RunResult
from rayvit.trainer import ClusterTooSmall, TrainingError, build_trainer, check_cluster_fits, fit


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    # The caller's own Ray instance: rayvit must use it, not start another.
    os.environ["RAYVIT_HOME"] = str(tmp_path_factory.mktemp("rayvit_home"))
    # 3 logical CPUs: two training workers plus one for Ray Data's read/decode tasks (parquet test).
    ray.init(num_cpus=3, include_dashboard=True)  # the Train cleaner polls its state API
    yield
    ray.shutdown()


def two_workers(*overrides):
    return load_config(overrides=["parallel.num_workers=2", "train.report_every=5", *overrides])


def final_params(checkpoint_dir, strategy, tmp_path):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = tmp_path / f"{strategy}.pt"
        dcp_to_torch_save(os.path.join(checkpoint_dir, "sharded"), out)
        return torch.load(out, weights_only=False)["model"]
    return torch.load(os.path.join(checkpoint_dir, "state.pt"), weights_only=False)["model"]


def test_ddp_fsdp_and_oss_reach_the_same_parameters_and_fsdp_holds_half_the_state(tmp_path):
    params, results = {}, {}
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        cfg = two_workers(f"parallel.strategy={strategy}", "optim.name=sgd", "optim.lr=0.05",
                          "train.steps=4", "train.warmup_steps=1", "train.checkpoint_every=4")
        result = build_trainer(cfg).fit()
        results[strategy] = RunResult.from_dict(result.return_value)
        params[strategy] = final_params(result.checkpoint.path, strategy, tmp_path)
        assert results[strategy]["world_size"] == 2
    for strategy in ("fsdp", "fairscale_oss"):
        assert params[strategy].keys() == params["ddp"].keys()
        for key, value in params["ddp"].items():
            torch.testing.assert_close(params[strategy][key], value, rtol=1e-4, atol=1e-5, msg=key)
    # The runs moved the weights (same result because they agree, not because nothing happened).
    assert results["ddp"].history[-1]["loss"] != results["ddp"].history[0]["loss"]
    ddp_bytes = results["ddp"]["model_state_bytes_per_rank"]
    assert results["fsdp"]["model_state_bytes_per_rank"] <= 0.55 * ddp_bytes
    assert results["fairscale_oss"]["model_state_bytes_per_rank"] < ddp_bytes
    for r in results.values():
        assert r["images_per_sec_per_chip"] > 0 and r["tflops_per_chip"] > 0 and 0 < r["mfu"]
        # Each rank's peak memory (on CPU the worker process's resident set), gathered over gloo, and the max.
        per_rank = r.per_rank["peak_memory_bytes"]
        assert len(per_rank) == 2 and all(v > 50 * 2**20 for v in per_rank)
        assert r["peak_memory_bytes_per_rank"] == max(per_rank) and r["memory_measure"] == "process_rss"
        assert set(r.per_rank) == {"peak_memory_bytes"}                  # no GPU: nothing else, not zeros
        assert not [k for k in r.metrics if k.startswith("gpu_") or "reserved" in k]


def test_a_crashed_worker_resumes_from_its_checkpoint_with_continuous_history():
    common = ["train.steps=10", "train.warmup_steps=1", "train.checkpoint_every=4", "train.max_failures=1"]
    clean = fit(two_workers(*common))
    crashed = fit(two_workers(*common, "train.fail_at_step=6", "train.fail_rank=1"))
    assert crashed.restarts == 1 and clean.restarts == 0
    assert [h["step"] for h in crashed.history] == list(range(10))
    # Same seed, same data stream after the restart: the loss curve is the uninterrupted one.
    for a, b in zip(crashed.history, clean.history):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)


def test_a_crash_without_retries_fails_fast_with_the_cause():
    start = time.monotonic()
    with pytest.raises(TrainingError, match="injected fault on rank 0 at step 3"):
        fit(two_workers("train.steps=6", "train.warmup_steps=1", "train.fail_at_step=3",
                        "train.checkpoint_every=2"))
    assert time.monotonic() - start < 60


def test_a_cluster_too_small_is_refused_before_any_worker_starts():
    start = time.monotonic()
    with pytest.raises(ClusterTooSmall, match=r"asked for 4 workers.*3 CPUs"):
        fit(load_config(overrides=["parallel.num_workers=4"]))
    with pytest.raises(ClusterTooSmall, match="Ray Data"):
        check_cluster_fits([load_config(overrides=["parallel.num_workers=3", "data.name=parquet",
                                                   "data.path=/nonexistent"])])
    with pytest.raises(ClusterTooSmall, match="GPU"):
        check_cluster_fits([load_config(overrides=["parallel.use_gpu=true"])])
    assert time.monotonic() - start < 5


def test_tiny_vit_reaches_90_percent_on_digits_within_two_minutes():
    start = time.monotonic()
    result = fit(two_workers("data.name=digits", "model.image_size=16", "model.classifier=pooled",
                             "train.batch_size=32", "train.steps=250", "train.report_every=50",
                             "optim.lr=3e-3", "optim.lr_warmup_steps=10"))
    elapsed = time.monotonic() - start
    assert result["val_accuracy"] >= 0.90, result.metrics
    assert elapsed < 120
    assert result["data"] == "digits" and result["world_size"] == 2


def test_digits_as_parquet_train_through_ray_data(tmp_path):
    export_image_folder(tmp_path / "digits")
    from rayvit.data.to_parquet import main as to_parquet

    assert to_parquet([str(tmp_path / "digits"), str(tmp_path / "parquet")]) == 0
    result = fit(two_workers("data.name=parquet", f"data.path={tmp_path / 'parquet'}", "model.image_size=16",
                             "train.batch_size=32", "train.steps=40", "train.warmup_steps=2",
                             "optim.lr=3e-3", "model.classifier=pooled"))
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])
    assert result["val_accuracy"] > 0.3 and result["data"] == "parquet"
