"""rayvit.trainer on a real local Ray instance: strategies agree, FSDP shards, runs survive crashes."""

import os
import time

import pytest
import ray
import torch

from ray.util.state import list_actors

from rayvit.config import load_config
from rayvit.launch.connect import started_local
from rayvit.results import RunResult
from rayvit.launch.torch_trainer import check_cluster_fits
from rayvit.trainer import ClusterTooSmall, TrainingError, fit, load_checkpoint, make_trainer

from helpers_process import ProcessSnapshot

from helpers_data import export_photos_parquet


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory, shared_ray):
    # The caller's own Ray instance (conftest.py's, shared with the data modules): rayvit must use it, not
    # start another. 3 logical CPUs: two training workers plus one for Ray Data's read/decode tasks
    # (parquet test); the dashboard on, as the Train cleaner polls its state API.
    os.environ["RAYVIT_HOME"] = str(tmp_path_factory.mktemp("rayvit_home"))
    assert ray.cluster_resources()["CPU"] == 3
    yield


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
    before = ProcessSnapshot()
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        cfg = two_workers(f"parallel.strategy={strategy}", "optim.name=sgd", "optim.lr=0.05",
                          "train.steps=4", "train.warmup_steps=1", "train.checkpoint_every=4")
        result = make_trainer(cfg).fit()
        results[strategy] = RunResult.from_dict(result.return_value)
        params[strategy] = final_params(result.checkpoint.path, strategy, tmp_path)
        assert results[strategy]["world_size"] == 2
        # The same model, read back by the library whatever the strategy wrote.
        loaded = load_checkpoint(result.checkpoint).model.state_dict()
        for key, value in params[strategy].items():
            torch.testing.assert_close(loaded[key], value, msg=key)
        # result.metrics is the final report: the summary with its intervals, as fit() returns it.
        summary = RunResult.of_rounds([results[strategy]])
        assert result.metrics["final"] and result.metrics["tflops_per_chip"] == summary["tflops_per_chip"]
        assert result.metrics["tflops_per_chip_lo"] <= result.metrics["tflops_per_chip"] <= result.metrics["tflops_per_chip_hi"]
    assert before.differences() == []            # the trainers' fit() left this process as it was
    # This folder's instance is the caller's own ray.init() with no address, a single machine: the fits
    # ran without Ray Train's preemption watcher, whose process would start during their first timed steps.
    assert started_local()
    here = ray.get_runtime_context().gcs_address          # this instance, whatever else runs on the machine
    assert len(list_actors(here, filters=[("class_name", "=", "TrainController")], limit=1000)) >= 3
    assert list_actors(here, filters=[("class_name", "=", "PreemptionWatcher")], limit=1000) == []
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


def _accuracy(model, cfg) -> float:
    """``model``'s accuracy over the whole validation split, in this process."""
    from rayvit.data import build_data

    correct = count = 0
    with torch.no_grad():
        for images, labels in build_data(cfg, torch.device("cpu")).val_batches():
            correct += (model(images).argmax(-1) == labels).sum().item()
            count += len(labels)
    return correct / count


def test_the_readme_sequence_gives_any_strategys_trained_model_by_default():
    """``load_checkpoint(make_trainer(cfg).fit().checkpoint).model`` with default settings (no
    train.checkpoint_every): the final checkpoint holds the trained model, one file from rank 0 whatever
    the strategy, and that model scores the validation accuracy the run reported. rayvit's own fit(),
    which returns a summary, writes no model."""

    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        cfg = load_config("cpu_default", ["parallel.num_workers=2", "data.name=digits", "train.steps=30",
                                          f"parallel.strategy={strategy}"])
        result = make_trainer(cfg).fit()
        assert sorted(os.listdir(result.checkpoint.path)) == ["meta.json", "rayvit_summary.json", "state.pt"]
        loaded = load_checkpoint(result.checkpoint)
        assert loaded.step == 30 and loaded.config == cfg and loaded.optimizer_state is None
        assert _accuracy(loaded.model, cfg) == pytest.approx(result.metrics["val_accuracy"], abs=1.5 / 360), strategy
    summary_only = make_trainer(cfg, final_model=False).fit()
    assert os.listdir(summary_only.checkpoint.path) == ["rayvit_summary.json"]


def test_a_crashed_worker_resumes_from_its_checkpoint_with_continuous_history():
    common = ["train.steps=10", "train.warmup_steps=1", "train.checkpoint_every=4", "train.max_failures=1"]
    before = ProcessSnapshot()
    clean = fit(two_workers(*common))
    crashed = fit(two_workers(*common, "train.fail_at_step=6", "train.fail_rank=1"))
    assert before.differences() == []            # fit() left this process as it was
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


def test_photographs_as_parquet_train_through_ray_data_and_a_corrupt_image_is_named_or_skipped(tmp_path):
    """ImageNet-sized photographs (8 classes) and the odd images of real data (a greyscale, a CMYK, a PNG,
    a tiny and a truncated JPEG), on random resized crops through Ray Data at two workers: the corrupt image
    stops the run with one line naming its file, row and reason, or is skipped and counted, and the run
    learns. Every point reports how long it waited for its batches."""
    path = export_photos_parquet(tmp_path, per_class=24, bad=True, rows_per_shard=1000)
    base = ("data.name=parquet", f"data.path={path}", "model.image_size=32", "model.num_classes=8",
            "train.batch_size=32", "train.warmup_steps=2", "optim.lr=3e-3", "model.classifier=pooled")
    with pytest.raises(TrainingError) as e:
        fit(two_workers(*base, "train.steps=10"))
    message = str(e.value)
    assert message.startswith("ddp x 2 workers failed: rayvit.errors.CorruptImageError: cannot decode the image in ")
    assert f"{path / 'part-00000.parquet'} row " in message and "(row group 0, index " in message
    assert "OSError: image file is truncated" in message and "\n" not in message and len(message) < 400

    result = fit(two_workers(*base, "train.steps=40", "data.skip_corrupt=true"))
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert result["val_accuracy"] > 0.4 and result["data"] == "parquet"
    assert result["skipped_images"] >= 1          # each rank that met it counts it once
    assert 0 <= result["data_wait_fraction"] < 1 and all("data_wait_s" in h for h in result.history)


# -- worker groups: several runs on one set of workers, in interleaved rounds ------------------------

def _group_run(tmp_path, name: str, cfgs: dict, rounds: int):
    """``cfgs`` (point key -> config) as a study's points on one worker group, through the real fit_group
    and the sweep's runner: (the study's record, outcomes, the progress items, the progress lines)."""
    from rayvit.config import load_study
    from rayvit.studies.plan import Point
    from rayvit.studies.runner import Progress, StudyRun
    from rayvit.trainer import fit_group

    points = [Point(i + 1, key, key.split("/")[0], 2, cfg) for i, (key, cfg) in enumerate(cfgs.items())]
    study = load_study(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"sweep.name={name}"])
    run = StudyRun(study, name, "groups", kind="scaling")
    run.start({})
    items, lines = [], []

    def measured(cfgs, rounds, on_progress, **kwargs):       # the real fit_group, its progress items kept
        return fit_group(cfgs, rounds, on_progress=lambda item: (items.append(item), on_progress(item)), **kwargs)

    outcomes = run.run_group(points, rounds, measured, lambda p: {}, Progress(len(points), lines.append, tty=False))
    return run, outcomes, items, lines


def test_a_worker_group_measures_every_run_in_rounds_and_a_failing_run_leaves_the_others(tmp_path):
    """Three points on one worker group, 3 rounds; one raises on every rank (as an unsupported setting or
    an even OOM would): it is recorded failed with its error, the others are measured and recorded."""
    base = ["train.steps=6", "train.warmup_steps=1", f"launch.storage={tmp_path}"]
    cfgs = {"ddp/w2": two_workers(*base),
            "fsdp/w2": two_workers(*base, "parallel.strategy=fsdp", "train.fail_at_step=3", "train.fail_rank=-1"),
            "fairscale_oss/w2": two_workers(*base, "parallel.strategy=fairscale_oss")}
    run, outcomes, items, lines = _group_run(tmp_path, "raises", cfgs, 3)
    assert [o.status for o in outcomes] == ["done", "failed", "done"]
    assert "injected fault on rank 0 at step 3" in outcomes[1].error
    for o in (outcomes[0], outcomes[2]):
        r = o.result
        assert r["rounds"] == 3 and r["strategy"] == o.point.cfg.parallel.strategy
        assert r["images_per_sec_per_chip_lo"] <= r["images_per_sec_per_chip"] <= r["images_per_sec_per_chip_hi"]
        assert [len(x["step_times"]) for x in r.rounds] == [5, 5, 5]
    # Rotated order: fairscale_oss ran last, first, and (fsdp gone) first again.
    assert [x["slot"] for x in outcomes[2].result.rounds] == [2, 0, 0]
    # Round results reached the driver as they finished, a line per round; the group was one Ray Train run.
    rounds = [(i["index"], i["round"]) for i in items if i.get("kind") == "round"]
    assert rounds == [(0, 0), (1, 0), (2, 0), (2, 1), (0, 1), (2, 2), (0, 2)]
    text = "\n".join(lines)
    assert "round 1/3: ddp/w2 " in text and "fsdp/w2 FAILED" in text and "round 3/3: ddp/w2 " in text
    assert "[2/3] fsdp/w2 FAILED: " in text and "(median of 3 rounds, 95% interval)" in text
    assert len([d for d in os.listdir(tmp_path) if d.startswith("rayvit-group-2w-")]) == 1
    records = {r.data.tags["rayvit.point"]: r for r in run.tracker.search_runs("tags.`rayvit.kind` = 'point'")}
    assert {k: r.info.status for k, r in records.items()} == {
        "ddp/w2": "FINISHED", "fsdp/w2": "FAILED", "fairscale_oss/w2": "FINISHED"}
    assert "injected fault" in records["fsdp/w2"].data.tags["rayvit.error"]
    assert records["ddp/w2"].data.metrics["rounds"] == 3


def test_a_run_failing_on_one_rank_is_recorded_within_a_minute_and_the_group_goes_on(tmp_path):
    """Rank 1 alone fails: in one run its loss turns NaN (as one rank's fp16 overflow would), in the next
    it raises while rank 0 waits for it in a collective. The first is agreed by both ranks and the group
    goes on; the second ends the group after train.failure_timeout_s, the driver records it failed with
    rank 1's error, and the point that had not run yet is measured in a run of its own."""
    base = ["train.steps=6", "train.warmup_steps=1", "train.failure_timeout_s=5"]
    fault = ["train.fail_at_step=3", "train.fail_rank=1"]
    cfgs = {"ddp/w2": two_workers(*base), "nan/w2": two_workers(*base, *fault, "train.fail_mode=nan"),
            "raises/w2": two_workers(*base, *fault, "parallel.strategy=fsdp"),
            "fsdp/w2": two_workers(*base, "parallel.strategy=fsdp")}
    run, outcomes, items, lines = _group_run(tmp_path, "one-rank", cfgs, 1)
    assert [o.status for o in outcomes] == ["done", "failed", "failed", "done"], [o.error for o in outcomes]
    assert "loss is not finite (NaN or inf) on rank 1 at step 4" in outcomes[1].error
    assert "rank 0 did not answer within 5 s" in outcomes[2].error
    assert "injected fault on rank 1 at step 3" in outcomes[2].error
    # Each failure reached the driver within the minute after the run before it ended (when it started).
    ended = {i["index"]: i["time"] for i in items if i["kind"] == "round"}
    assert sorted(ended) == [0, 1, 2] and ended[1] - ended[0] < 60 and ended[2] - ended[1] < 60
    text = "\n".join(lines)
    assert ("keeping ddp/w2 (all rounds finished) and recording nan/w2, raises/w2 failed and measuring fsdp/w2 "
            "in separate runs") in text
    assert outcomes[3].result["rounds"] == 1 and outcomes[3].result["strategy"] == "fsdp"
    statuses = {r.data.tags["rayvit.point"]: r.info.status for r in run.tracker.search_runs("tags.`rayvit.kind` = 'point'")}
    assert statuses == {"ddp/w2": "FINISHED", "nan/w2": "FAILED", "raises/w2": "FAILED", "fsdp/w2": "FINISHED"}


def test_a_group_that_dies_keeps_finished_points_and_measures_the_rest_alone(tmp_path):
    """A worker process exits in the middle of the group (as a lost node would): the point that had
    finished its rounds keeps them, the others run again in runs of their own."""
    from rayvit.config import load_study
    from rayvit.studies.plan import Point
    from rayvit.studies.runner import Progress, StudyRun
    from rayvit.trainer import fit_group

    study = load_study(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "sweep.name=dies"])
    base = ["train.steps=6", "train.warmup_steps=1"]
    cfgs = {"ddp/w2": two_workers(*base), "exits/w2": two_workers(*base, "train.fail_at_step=3",
                                                                     "train.fail_mode=exit", "train.fail_rank=1"),
            "fsdp/w2": two_workers(*base, "parallel.strategy=fsdp")}
    points = [Point(i + 1, key, key.split("/")[0], 2, cfg) for i, (key, cfg) in enumerate(cfgs.items())]
    run = StudyRun(study, "dies", "groups", kind="scaling")
    run.start({})
    lines = []
    outcomes = run.run_group(points, 1, fit_group, lambda p: {}, Progress(3, lines.append, tty=False))
    assert [o.status for o in outcomes] == ["done", "failed", "done"], [o.error for o in outcomes]
    text = "\n".join(lines)
    assert "the worker group at 2 workers failed" in text
    assert "keeping ddp/w2 (all rounds finished) and measuring exits/w2, fsdp/w2 in separate runs" in text
    assert outcomes[2].result["rounds"] == 1 and outcomes[0].result["strategy"] == "ddp"
    statuses = {r.data.tags["rayvit.point"]: r.info.status for r in run.tracker.search_runs("tags.`rayvit.kind` = 'point'")}
    assert statuses == {"ddp/w2": "FINISHED", "exits/w2": "FAILED", "fsdp/w2": "FINISHED"}


def test_a_hand_built_trainer_with_more_workers_than_the_config_is_refused_with_both_numbers():
    """A TorchTrainer built by hand (no driver-side check): the first worker refuses figures that would be
    stated for the wrong world size, instead of training on silently."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayvit.trainer import loop_config, train_loop_per_worker

    cfg = load_config(overrides=["parallel.num_workers=1", "train.steps=2", "train.warmup_steps=1"])
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config=loop_config(cfg),
                           scaling_config=ScalingConfig(num_workers=2))
    with pytest.raises(Exception, match="started 2 workers, the config says parallel.num_workers=1"):
        trainer.fit()


def test_a_dataset_with_the_wrong_columns_is_refused_on_the_driver_naming_what_it_found():
    from rayvit.errors import ConfigError

    wrong = ray.data.from_items([{"pixels": b"\xff\xd8", "target": 1}] * 4)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"no column 'image' \(columns: pixels \(binary\), target \(int64\)\)"):
        make_trainer(load_config(overrides=["parallel.num_workers=1"]), datasets={"train": wrong})
    assert time.monotonic() - start < 2
    # Named by the config, the same columns are taken (and the config says it trains on a dataset).
    trainer = make_trainer(load_config(overrides=["parallel.num_workers=1", "data.image_column=pixels",
                                                  "data.label_column=target"]), datasets={"train": wrong})
    assert trainer.rayvit_config.data.name == "dataset"


# -- the caller's own Dataset: a corrupt row named first, and Ray Data quiet ------------------------

PROGRESS = ("Running Dataset", "Execution plan", "Starting execution", "row/s", "rows/s]", "it/s]")


def test_a_corrupt_row_of_the_callers_dataset_is_named_first_and_ray_data_runs_quietly(tmp_path, capfd):
    """make_trainer on the caller's own Dataset (read_parquet of one file: no file column): a truncated
    JPEG stops fit() with rayvit's CorruptImageError whose first line names the row (its block and offset
    in the map's input, label, size and digest, enough for Dataset.filter to find it) and whose cause is Ray's
    error; the good rows train with no Ray Data progress on the console, the caller's DataContext and
    Dataset as they were."""
    import hashlib

    import pyarrow.parquet as pq

    from rayvit.errors import CorruptImageError

    photos = export_photos_parquet(tmp_path, per_class=3, bad=True, rows_per_shard=1000)
    table = pq.read_table(photos, columns=["image", "label"])
    corrupt = [i for i, b in enumerate(table.column("image").to_pylist()) if len(b) == 1024]
    assert len(corrupt) == 1
    pq.write_table(table, tmp_path / "all.parquet")
    pq.write_table(table.filter([i not in corrupt for i in range(len(table))]), tmp_path / "good.parquet")
    cfg = load_config(overrides=["parallel.num_workers=1", "model.image_size=32", "model.num_classes=8",
                                 "train.batch_size=4", "train.steps=40", "train.warmup_steps=1"])
    context = ray.data.DataContext.get_current()
    settings = (context.enable_progress_bars, context.print_on_execution_start, context.get_config("rayvit.data.info"))

    users = ray.data.read_parquet(str(tmp_path / "all.parquet"))
    with pytest.raises(CorruptImageError) as e:
        make_trainer(cfg, datasets={"train": users}).fit()
    first = str(e.value).splitlines()[0]
    digest = hashlib.md5(table.column("image")[corrupt[0]].as_py()).hexdigest()[:12]
    assert first.startswith("cannot decode the image in block "), first
    assert f"(label 0, 1024 bytes, md5 {digest})" in first and "image file is truncated" in first
    assert e.value.__cause__ is not None and "Traceback" not in first

    capfd.readouterr()
    good = ray.data.read_parquet(str(tmp_path / "good.parquet"))
    result = make_trainer(cfg.replace(["train.steps=8"]), datasets={"train": good}).fit()
    assert result.metrics["step"] == 8
    time.sleep(1.0)                                # Ray forwards its workers' lines asynchronously
    printed = capfd.readouterr()
    noise = [line for line in (printed.out + printed.err).splitlines() if any(p in line for p in PROGRESS)]
    assert noise == [], noise[:5]
    assert (context.enable_progress_bars, context.print_on_execution_start,
            context.get_config("rayvit.data.info")) == settings
    assert users.context.enable_progress_bars == good.context.enable_progress_bars == settings[0]
