"""The input pipeline's capacity: measured per core (rayvit bench-data), projected per point (rayvit project
--data-rate), and the stall figure measured in a run (data_wait_fraction, its interval, the console)."""

from __future__ import annotations

import json
import math

import pytest

from rayvit.cli import main
from rayvit.projection.inputs import InputRate, cores_free_per_chip, measured_note, verdict
from rayvit.results import RunResult

from helpers_cli import CONFIGS
from helpers_data import config, export_photos_parquet


def test_input_verdict_per_point():
    """ViT-B/16-like: 1,000 img/s per chip, 100 img/s per core; a p4d node (96 CPUs, 8 GPUs, 8 CPUs per
    training worker) leaves 4 cores per GPU: the input allows 400 img/s per chip, and bounds the epoch."""
    rate = InputRate(100.0, 224, "test")
    free = cores_free_per_chip(96, 8, 8)
    assert free == 4.0 and cores_free_per_chip(2, 2, 1) == 0.0
    assert cores_free_per_chip(96, 8, 8, threads_per_core=2) == 2.0      # p4d: 96 vCPUs are 48 cores
    v = verdict(1000.0, 8, rate, free)
    assert v.cores_needed_per_chip == 10.0 and v.input_images_per_sec_per_chip == 400.0
    assert not v.feeds and v.bound == "input"
    assert v.epoch_time_imagenet_h == pytest.approx(1_281_167 / (400.0 * 8) / 3600)
    fed = verdict(300.0, 8, rate, free)
    assert fed.feeds and fed.bound == "compute"
    assert fed.epoch_time_imagenet_h == pytest.approx(1_281_167 / (300.0 * 8) / 3600)


def test_bench_data_and_the_projections_input_table(tmp_path, capsys):
    photos = export_photos_parquet(tmp_path, per_class=2)
    out = tmp_path / "rate.json"
    code = main(["bench-data", f"data.path={photos}", "model.image_size=64", "--images", "12", "--rounds", "2",
                 "--json", str(out), "--compare", "data.cpu_decoder=pil,simplejpeg"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "one thread on" in printed.err
    for text in ("data.cpu_decoder=pil", "data.cpu_decoder=simplejpeg", "train", "val", "img/s/core"):
        assert text in printed.out
    data = json.loads(out.read_text())
    assert data["image_size"] == 64 and data["images"] == 12 and data["train"]["transform"] == "train"
    assert data["train"]["images_per_sec_per_core"] > 0 and len(data["train"]["rounds"]) == 2

    # The projection takes it at the image size it was measured at, and refuses another.
    study = str(CONFIGS / "study_a100.yaml")
    code = main(["project", "--config", study, "--data-rate", str(out), "--out-dir", str(tmp_path)])
    assert code == 2 and "measured at 64 px, but the projection is at 224 px" in capsys.readouterr().err
    code = main(["project", "--config", study, "--set", "model.image_size=64", "--data-rate", str(out),
                 "--out-dir", str(tmp_path), "--chips", "8"])
    text = capsys.readouterr().out
    assert code == 0
    # p4d's 96 vCPUs are 48 cores: 8 GPUs' workers take 64 vCPUs, the 32 left are 16 cores, 2 per chip.
    assert ("96 CPUs per node (48 cores: 2 vCPUs each), 8 chips, 8 reserved per training worker: 2 cores per chip "
            "decode") in text
    assert "a loop on one thread" in text and "measure them with --ray-cpus" in text
    assert "cores/chip needed" in text and "epoch h (bound)" in text
    # 20 img/s per core on 16 free cores per H100 (192 CPUs, 8 reserved per worker): 320 img/s per chip,
    # below ViT-H's projected ~500: no point is fed, each epoch is the input's.
    code = main(["project", "--config", study, "--data-rate", "20", "--out-dir", str(tmp_path), "--chips", "8",
                 "--hardware", "h100-sxm"])
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.strip().startswith("8  ") and "(input)" in line]
    assert code == 0 and rows and all(" NO " in r for r in rows)
    assert "192 CPUs per node (96 cores" in text


def test_data_wait_fraction_over_rounds_with_its_interval_and_the_console_flag():
    """Three rounds of 20 steps: 10%, 12% and 8% of each round's time waiting for data."""
    def run(fraction: float) -> RunResult:
        steps, waits = [0.1] * 20, [0.1 * fraction] * 20
        return RunResult(metrics={"images_per_sec_per_chip": 160.0, "images_per_sec": 160.0, "train_flops_per_image": 1e9,
                                  "peak_tflops": 1.0, "data_wait_fraction": fraction},
                         conditions={"batch_per_chip": 16, "world_size": 1}, step_times=steps, data_wait_times=waits)

    point = RunResult.of_rounds([run(0.10), run(0.12), run(0.08)])
    m = point.metrics
    assert m["data_wait_fraction"] == pytest.approx(0.10)
    assert m["data_wait_fraction_lo"] == pytest.approx(0.08) and m["data_wait_fraction_hi"] == pytest.approx(0.12)
    assert [len(r["data_wait_times"]) for r in point.rounds] == [20, 20, 20]
    note = measured_note(m)
    assert note.startswith("input-bound: waited 10.0% (8.0%-12.0%) of its step time for data")
    assert measured_note({"data_wait_fraction": 0.01}) is None and measured_note({}) is None
    # The verdict is the interval's: a median above the line whose interval reaches below it is noise.
    wobbly = RunResult.of_rounds([run(0.04), run(0.09), run(0.06)]).metrics
    assert wobbly["data_wait_fraction"] > 0.05 and wobbly["data_wait_fraction_lo"] < 0.05
    assert measured_note(wobbly) is None
    # Epoch starts booked apart are named beside the steady wait.
    note = measured_note({**m, "epoch_start_wait_fraction": 0.31, "epoch_start_wait_s": 0.32})
    assert note.startswith("input-bound: waited 10.0% (8.0%-12.0%)")
    assert "epoch starts waited another 31.0% (0.32 s each)" in note


def test_a_session_times_the_wait_for_each_batch_apart(tmp_path):
    """Parquet photographs decoded as batches are drawn: every step records its wait; the run's fraction
    is the timed steps' waits over their time, and synthetic data waits for next to nothing."""
    from rayvit.worker import train

    photos = export_photos_parquet(tmp_path, per_class=4)
    base = ("model.num_classes=8", "model.image_size=32", "train.batch_size=8", "train.steps=6",
            "train.warmup_steps=2", "data.prefetch_batches=0")
    result = train(config("data.name=parquet", f"data.path={photos}", *base))
    waits = [h["data_wait_s"] for h in result.history]
    assert len(waits) == 6 and all(0 < w < h["step_time_s"] for w, h in zip(waits, result.history))
    assert result.data_wait_times == pytest.approx(waits[2:])
    expected = sum(waits[2:]) / sum(h["step_time_s"] for h in result.history[2:])
    assert result["data_wait_fraction"] == pytest.approx(expected)
    assert 0.05 < result["data_wait_fraction"] < 1          # decoding in the step's own thread: input-bound
    synthetic = train(config(*base))
    assert synthetic["data_wait_fraction"] < 0.01 and not math.isnan(synthetic["data_wait_fraction"])


def test_the_projection_takes_the_rate_ray_datas_tasks_reach(tmp_path, capsys):
    """A bench-data file with Ray Data's rate (--ray-cpus) feeds the projection that rate per CPU, not the
    one-thread loop's, and says so."""
    rate = tmp_path / "rate.json"
    rate.write_text(json.dumps({"image_size": 224, "cpu": "test CPU", "train": {"images_per_sec_per_core": 811.0},
                                "ray_data": [{"cpus": 1, "images_per_sec": 640.0}, {"cpus": 2, "images_per_sec": 1100.0}]}))
    from rayvit.projection.inputs import load_rate

    got = load_rate(str(rate), 224)
    assert got.images_per_sec_per_core == 550.0 and got.through_ray_data
    assert "Ray Data's read and decode tasks with 2 CPUs" in got.source
    loop = json.loads(rate.read_text())
    del loop["ray_data"]
    rate.write_text(json.dumps(loop))
    assert load_rate(str(rate), 224).images_per_sec_per_core == 811.0 and not load_rate(str(rate), 224).through_ray_data
