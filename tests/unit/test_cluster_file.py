"""A cluster the user describes (``--hardware my_cluster.yaml``): what it changes, what it refuses and names,
what the header says came from it, and ``sweep.hardware``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayvit.cli import main
from rayvit.config import load_study
from rayvit.errors import ConfigError
from rayvit.projection.performance import project
from rayvit.projection.profiles import PROFILES, get_profile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "cluster" / "example_cluster.yaml"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path / "home"))


def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_shipped_example_loads_over_its_base():
    profile = get_profile(str(EXAMPLE))
    base = PROFILES["h100-sxm"]
    assert profile.name == "example-h100x4" and profile.accelerator == base.accelerator
    assert profile.chips_per_node == 4 and profile.memory_gib == 80
    assert profile.inter.busbw == pytest.approx(800 / 8 * 1e9 * 0.8)
    assert profile.cpus_per_node == 64 and profile.cpus_are_vcpus is True
    assert profile.price_per_chip_hour == 2.49 and profile.currency == "USD"
    # What the file does not give stays the base's.
    assert profile.intra == base.intra and profile.memory_bw == base.memory_bw and profile.speed_cv == base.speed_cv


def test_the_network_per_node_changes_the_64_gpu_fsdp_projection(tmp_path):
    study = load_study("study_a100", ["parallel.strategy=fsdp", "parallel.reshard_after_forward=true"],
                       baseline_required=False)
    step = {}
    for gbps in (800, 3200):
        profile = get_profile(write(tmp_path, f"base: h100-sxm\nnetwork_gbps: {gbps}\n", f"net{gbps}.yaml"))
        step[gbps] = project(study.run, 64, profile)
    # 3,200 Gb/s is the DGX H100's 8 x 400: the shipped profile's own figure.
    assert step[3200].step_s == pytest.approx(project(study.run, 64, get_profile("h100-sxm")).step_s)
    assert step[800].exposed_comm_s > 2 * step[3200].exposed_comm_s
    assert step[800].images_per_sec_per_chip < 0.97 * step[3200].images_per_sec_per_chip
    # Within one node nothing crosses the network.
    one_node = {g: project(study.run, 8, get_profile(write(tmp_path, f"base: h100-sxm\nnetwork_gbps: {g}\n")))
                for g in (800, 3200)}
    assert one_node[800].step_s == pytest.approx(one_node[3200].step_s)


def test_gpus_per_node_moves_the_network_boundary(tmp_path):
    study = load_study("study_a100", baseline_required=False)
    four = get_profile(write(tmp_path, "base: a100-40gb\ngpus_per_node: 4\n"))
    # 8 chips: one node of the base, two of the described cluster (DDP's gradients then cross EFA).
    assert project(study.run, 8, four).exposed_comm_s > 5 * project(study.run, 8, PROFILES["a100-40gb"]).exposed_comm_s


@pytest.mark.parametrize("text, named", [
    ("netwrok_gbps: 800\nbase: h100-sxm\n", "unknown key 'netwrok_gbps'"),
    ("network_gbps: 800\n", "base is missing"),
    ("base: h100\n", "base='h100' is not a shipped profile"),
    ("base: h100-sxm\nnetwork_gbps: -1\n", "network_gbps=-1 must be a number above 0"),
    ("base: h100-sxm\nnetwork_gbps: fast\n", "network_gbps='fast'"),
    ("base: h100-sxm\ngpus_per_node: 2.5\n", "gpus_per_node=2.5 must be a whole number"),
    ("base: h100-sxm\ncpus_per_node: 64\n", "cpus_per_node=64 needs cpus_are_vcpus"),
    ("base: h100-sxm\ncpus_are_vcpus: true\n", "cpus_are_vcpus is given without cpus_per_node"),
    ("base: h100-sxm\nmemory_gib: 1\n", "memory_gib=1 must be a number above 1.5"),
    ("base: h100-sxm\ncurrency: EUR\n", "currency is given without price_per_gpu_hour"),
    ("base: [h100-sxm\n", "not valid YAML"),
    ("- h100-sxm\n", "expected keys"),
])
def test_a_wrong_cluster_file_is_refused_naming_the_file_and_key(tmp_path, capsys, text, named):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="cluster file"):
        get_profile(path)
    code = main(["project", "--config", "study_a100", "--hardware", path, "--chips", "8"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and path in err and "Traceback" not in err


def test_a_missing_cluster_file_is_named(tmp_path, capsys):
    missing = str(tmp_path / "nowhere.yaml")
    assert main(["project", "--hardware", missing]) == 2
    err = capsys.readouterr().err
    assert missing in err and "no such cluster file" in err and "example_cluster.yaml" in err


def test_the_header_says_which_figures_came_from_the_file(capsys, tmp_path):
    assert main(["project", "--config", "study_a100", "--hardware", str(EXAMPLE), "--chips", "8", "--out-dir",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("cluster file"))
    for figure in ("4 GPUs per node", "network 800 Gb/s per node", "80 GiB per GPU", "64 vCPUs per node",
                   "2.49 USD per GPU-hour", "base h100-sxm", "everything else from the base profile"):
        assert figure in line, line
    assert "on example-h100x4 " in out and "4 chips/node" in out and "inter-node busbw 80 GB/s" in out
    # Shipped profiles have no such line.
    assert main(["project", "--config", "study_a100", "--hardware", "h100-sxm", "--chips", "8", "--out-dir",
                 str(tmp_path)]) == 0
    assert "cluster file" not in capsys.readouterr().out


def test_sweep_hardware_names_the_profile_project_uses_and_is_checked_early(capsys, tmp_path):
    assert main(["project", "--config", "study_a100", "--set", f"sweep.hardware={EXAMPLE}", "--chips", "8",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and {r["hardware"] for r in rows} == {"example-h100x4"}
    bad = write(tmp_path, "base: h100-sxm\nnetwork_gbps: 0\n")
    assert main(["sweep", "--config", "study_a100", "--set", f"sweep.hardware={bad}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"sweep.hardware={bad}" in err and "network_gbps=0" in err
