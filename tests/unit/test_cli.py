"""The ``rayvit`` command: every entry point behind one name, each explaining itself."""

import subprocess
import sys
from pathlib import Path

import pytest

from rayvit.cli import COMMANDS, main


def test_rayvit_lists_its_commands_and_refuses_unknown_ones(capsys):
    assert main([]) == 2
    listing = capsys.readouterr().out
    for name in ("sweep", "project", "search", "bench", "gpu-check", "to-parquet"):
        assert name in COMMANDS and name in listing
    assert main(["--help"]) == 0
    assert main(["swep"]) == 2 and "unknown command 'swep'" in capsys.readouterr().err


@pytest.mark.parametrize("command, words", [
    ("sweep", ["--dry-run", "--project", "--verbose", "RAY_AUTH_TOKEN", "resumes"]),
    ("project", ["--hardware", "--measured", "nothing runs", "rayvit sweep --project", "study_a100.yaml"]),
    ("search", ["search.max_accuracy_drop", "--output", "--verbose"]),
    ("bench", ["--compare"]),
    ("gpu-check", ["--quick", "--list"]),
    ("bench-data", ["--ray-cpus", "--data-rate"]),
    ("to-parquet", ["SRC", "--rows-per-shard"]),
    ("make-photos", ["--per-class", "scikit-image"]),
])
def test_every_command_explains_itself(command, words, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: rayvit {command}")
    for word in words:
        assert word in text


def test_the_installed_module_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "rayvit", "project", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--hardware" in proc.stdout


def test_project_takes_only_what_a_projection_uses_and_says_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        main(["project", "--help"])
    assert "--address" not in capsys.readouterr().out      # nothing runs, so no cluster to name
    assert main(["project", "--set", "model.nmae=vit_b16"]) == 2
    assert "model.nmae" in capsys.readouterr().err


def test_bench_times_variants_side_by_side_as_ratios(capsys):
    """`rayvit bench` end to end on the tiny default: each variant timed, the first the baseline."""
    assert main(["bench", "--steps", "1", "--rounds", "2", "--warmup", "1",
                 "--compare", "optim.impl=loop,foreach"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("optim.impl=")}
    assert set(rows) == {"optim.impl=loop", "optim.impl=foreach"}
    assert rows["optim.impl=loop"][2] == "1.000" and float(rows["optim.impl=foreach"][2]) > 0
    assert float(rows["optim.impl=loop"][-2]) > 0          # model state MB, read before the sessions closed


def test_bench_measures_each_variants_own_peak_memory(tmp_path):
    """One variant on the device at a time, its peak restarted when its session starts: a small batch
    timed after a large one reports a smaller peak (one process-wide peak would give both the same)."""
    import json

    out = tmp_path / "bench.json"
    assert main(["bench", "--steps", "1", "--rounds", "1", "--warmup", "0", "--json", str(out),
                 "--compare", "train.batch_size=512,8"]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["groups"][0]["rows"]}
    large, small = rows["train.batch_size=512"], rows["train.batch_size=8"]
    assert small["peak_memory_mb"] < large["peak_memory_mb"] - 20
    assert small["model_state_mb"] == large["model_state_mb"] > 0


def test_sweep_project_is_gone_and_says_where_it_went(capsys):
    """`rayvit sweep --project` duplicated `rayvit project`: refused as argparse refuses (status 2), with
    the command that does it, whatever options come with it; experiments/scaling.py likewise."""
    for argv in (["sweep", "--project"], ["sweep", "--project", "--hardware", "h100-sxm", "--config", "study_a100"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "--project was removed" in err and "`rayvit project`" in err
    proc = subprocess.run([sys.executable, "experiments/scaling.py", "--project"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "rayvit project" in proc.stderr and "Traceback" not in proc.stderr


def test_make_photos_writes_the_sample_photographs(tmp_path, capsys):
    """`rayvit make-photos` (rayvit.datasets.make_photos) writes per-class JPEGs and says so; bad input is
    one line and status 2."""
    pytest.importorskip("skimage")
    assert main(["make-photos", str(tmp_path / "photos"), "--per-class", "1"]) == 0
    assert "wrote 8 JPEGs of 8 classes" in capsys.readouterr().out
    assert len(list((tmp_path / "photos").rglob("*.jpg"))) == 8
    assert main(["make-photos", str(tmp_path / "none"), "--per-class", "0"]) == 2
    assert "--per-class must be at least 1" in capsys.readouterr().err
