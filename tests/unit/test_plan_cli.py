"""``rayvit plan``: the settings it weighs, its ranking by hours and cost per epoch, ``--json``, what it marks,
what it refuses, and the pointer the dry runs print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayvit.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "cluster" / "example_cluster.yaml")
KEYS = {"rank", "hardware", "chips", "strategy", "batch_per_chip", "fits", "epoch_hours", "epoch_cost", "dominant",
        "behind", "changes_accuracy", "precision", "image_size", "activation_checkpointing"}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path / "home"))


def plan(capsys, *args) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rows(capsys, *args) -> list[dict]:
    code, out, err = plan(capsys, "--json", *args)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_json_rows_are_ranked_by_epoch_hours_with_their_fit_and_cost(capsys):
    got = rows(capsys, "--config", "study_a100", "--chips", "8", "64")
    assert got and all(KEYS <= set(r) for r in got)
    ranked = [r for r in got if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1)) and all(r["fits"] for r in ranked)
    hours = [r["epoch_hours"] for r in ranked]
    assert hours == sorted(hours)
    # An epoch of ImageNet-1K at the row's rate; no price on a shipped profile.
    for r in ranked:
        assert r["epoch_hours"] == pytest.approx(1_281_167 / (r["images_per_sec_per_chip"] * r["chips"]) / 3600)
        assert r["epoch_cost"] is None
    # Every strategy the config allows with the variants each offers (both resharding settings of FSDP and
    # HSDP; FairScale FSDP as configured), checkpointing off and on.
    assert {r["strategy"] for r in ranked} == {"ddp", "fsdp", "fsdp (no reshard)", "hsdp", "hsdp (no reshard)",
                                              "fairscale_fsdp (no reshard)"}
    assert {r["activation_checkpointing"] for r in ranked} == {"none", "block"}
    # Each row but the first says why it is behind the one above.
    assert ranked[0]["behind"] is None and all(r["behind"] for r in ranked[1:])


def test_a_priced_cluster_ranks_by_cost_per_epoch(capsys):
    got = [r for r in rows(capsys, "--config", "study_a100", "--hardware", EXAMPLE, "--chips", "4", "8", "16")
           if r["rank"] is not None]
    costs = [r["epoch_cost"] for r in got]
    assert costs == sorted(costs) and got[0]["hardware"] == "example-h100x4"
    for r in got:
        assert r["epoch_cost"] == pytest.approx(r["epoch_hours"] * r["chips"] * 2.49) and r["currency"] == "USD"
    # --by hours: the same rows by time instead.
    by_hours = [r for r in rows(capsys, "--config", "study_a100", "--hardware", EXAMPLE, "--chips", "4", "8", "16",
                                "--by", "hours") if r["rank"] is not None]
    assert by_hours[0]["chips"] == 16 and got[0]["epoch_cost"] <= by_hours[0]["epoch_cost"]


def test_rows_that_do_not_fit_come_last_unranked(capsys):
    got = rows(capsys, "--config", "study_a100", "--chips", "8", "--strategies", "ddp", "fsdp",
               "--batch-per-chip", "32", "4096")
    unfit = [r for r in got if not r["fits"]]
    assert unfit and all(r["rank"] is None and r["batch_per_chip"] == 4096 for r in unfit)
    assert got[-len(unfit):] == unfit and {r["strategy"] for r in got} == {"ddp", "fsdp", "fsdp (no reshard)"}


def test_settings_that_change_precision_or_image_size_are_marked(capsys):
    got = rows(capsys, "--config", "search_a100", "--chips", "8", "--strategies", "ddp")
    changed = {(r["precision"], r["image_size"]) for r in got if r["changes_accuracy"]}
    same = {(r["precision"], r["image_size"]) for r in got if not r["changes_accuracy"]}
    assert same == {("amp-fp16", 224)}
    assert ("pure-fp16", 256) in changed and ("mixed-bf16", 224) in changed
    marked = next(r for r in got if r["precision"] == "pure-bf16" and r["image_size"] == 256)
    assert marked["changes"] == ["precision.mode=pure", "precision.dtype=bf16", "model.image_size=256"]


def test_the_table_names_dominant_terms_and_what_to_do_next(capsys):
    code, out, _ = plan(capsys, "--config", "study_a100", "--chips", "8", "16", "--top", "5")
    assert code == 0
    assert "an epoch = 1,281,167 images (ImageNet-1K's training split)" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    body = lines[first + 2:first + 7]
    assert [line.split()[0] for line in body] == ["1", "2", "3", "4", "5"]
    assert all(" compute " in line or " communication " in line for line in body)
    assert "per image against" in body[1]
    assert "best at each count: 8 chips: rank" in out and "rayvit search" in out


def test_the_epoch_is_the_configs_dataset_or_the_one_given(capsys):
    code, out, _ = plan(capsys, "--config", "study_a100", "--set", "data.name=digits", "--set",
                        "data.val_fraction=0.2", "--chips", "8", "--top", "1")
    assert code == 0 and "an epoch = 1,438 images (the digits' training split)" in out
    got = rows(capsys, "--config", "study_a100", "--chips", "8", "--epoch-images", "1000000", "--strategies", "ddp")
    assert all(r["epoch_images"] == 1_000_000 for r in got)


@pytest.mark.parametrize("args, named", [
    (["--by", "cost"], "--by cost needs a price for every hardware profile"),
    (["--strategies", "zero3"], "--strategies 'zero3' is not a registered strategy"),
    (["--chips", "0"], "--chips takes chip counts of 1 or more"),
    (["--batch-per-chip", "0"], "--batch-per-chip takes batch sizes of 1 or more"),
    (["--hardware", "a200"], "unknown hardware profile 'a200'"),
])
def test_bad_input_is_refused_before_anything_is_projected(capsys, args, named):
    code, out, err = plan(capsys, "--config", "study_a100", *args)
    assert code == 2 and named in err and out == "" and "Traceback" not in err


def test_the_dry_runs_point_to_the_plan(capsys):
    assert main(["sweep", "--dry-run", "--config", "study_a100"]) == 0
    assert "before renting: `rayvit plan --config" in capsys.readouterr().out
    assert main(["search", "--dry-run", "--config", "search_a100"]) == 0
    assert "before renting: `rayvit plan --config" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "cost per epoch" in capsys.readouterr().out
