"""rayvit as a user installs it: a wheel built from this checkout, installed into a fresh environment
(not editable), its commands run from an empty directory. Marked slow (about half a minute)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "experiments" / "configs"


def _build_wheel(tmp: Path) -> Path:
    """A wheel of a copy of the checkout (building in the checkout itself would leave build/ there)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(REPO / "rayvit", src / "rayvit", symlinks=True, ignore=ignore)
    shutil.copytree(CONFIGS, src / "experiments" / "configs", symlinks=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    # No build isolation: setuptools from this environment, nothing downloaded.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp / "dist").glob("rayvit-*.whl")
    return wheel


def _fresh_env(tmp: Path, wheel: Path) -> Path:
    """A new venv holding only the wheel; the dependencies (torch & co.) are this environment's, reached
    through a .pth line, so that nothing is downloaded and this checkout's editable rayvit is not seen."""
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    python = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    str(wheel)], check=True, capture_output=True, timeout=120)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # Lines of a .pth file are added to sys.path after the venv's own site-packages; .pth files inside the
    # added folder (this checkout's editable-install hook among them) are not run.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_runs_its_commands_from_an_empty_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "rayvit/studies/ladder.yaml" in names
    assert "rayvit/py.typed" in names                  # type checkers read rayvit's annotations
    with zipfile.ZipFile(wheel) as z:                 # the files themselves, not links to the checkout
        for config in CONFIGS.glob("*.yaml"):
            assert z.read(f"rayvit/configs/{config.name}") == config.read_bytes(), config.name

    env = _fresh_env(tmp_path, wheel)
    empty = tmp_path / "empty"
    empty.mkdir()
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    run_env.update(RAYVIT_HOME=str(tmp_path / "home"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")

    # The three dry runs write nothing anywhere, so they run at once (each is mostly imports: ~3 s of one
    # core), while this process asks the installed python where rayvit comes from.
    commands = {"sweep": ("sweep", "--dry-run"), "ladder": ("sweep", "--dry-run", "--config", "ladder_cpu.yaml"),
                "search": ("search", "--dry-run")}
    procs = {key: subprocess.Popen([str(env / "bin" / "rayvit"), *args], cwd=empty, env=run_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for key, args in commands.items()}
    try:
        # The library resolves a shipped config's name as the commands do, from any directory.
        where = subprocess.run([str(env / "bin" / "python"), "-c", "import rayvit; from rayvit.config import "
                                "load_config; assert load_config('cpu_default').train.steps; print(rayvit.__file__)"],
                               cwd=empty, env=run_env, capture_output=True, text=True, check=True).stdout.strip()
        outputs = {}
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"rayvit {' '.join(commands[key])}:\n{stdout}\n{stderr}"
            outputs[key] = stdout + stderr
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert where.startswith(str(env)), where            # the installed copy, not this checkout
    assert "ddp" in outputs["sweep"]
    assert "7-full_half" in outputs["ladder"]           # a config the package ships
    assert "baseline" in outputs["search"]
    assert list(empty.iterdir()) == []                  # nothing written where it ran
