"""Helpers shared by the unit and Ray tiers (``tests/`` is on ``sys.path`` through its conftest).

The CLIs' settings and environment, results with chosen figures for the MLflow record, the digits as
images and parquet, and the ViT-B/16 and strategy-by-precision combinations the projection is checked on.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayvit.config import from_dict, load_config
from rayvit.data import Data
from rayvit.data.digits import export_image_folder
from rayvit.results import RunResult

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"

# -- sweeps and searches through their CLIs ---------------------------------------------------------

SCRIPT = REPO / "experiments" / "scaling.py"
FEW_STEPS = ["--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.report_every=6"]
SEARCH_CPU = CONFIGS / "search_cpu.yaml"
# Small and quick: every trial trains the same few steps on digits with 2 workers.
QUICK = {"train.steps": 40, "train.report_every": 10, "train.warmup_steps": 5}
# The 64-wide ViT the search default used before it grew to width 256 (bf16 is slower than fp32 on it).
TINY_MODEL = {"model.hidden_dim": 64, "model.mlp_dim": 128, "model.patch_size": 4, "optim.lr": 0.003,
              "optim.impl": "foreach"}


def cli_env(root: Path) -> dict[str, str]:
    """A user's environment for the CLIs, with the MLflow store and rayvit's home under ``root``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{root}/mlflow.db", RAYVIT_HOME=str(root / "home"),
               PYTHONUNBUFFERED="1")
    return env


# The whole image as it is, no random crop, flip or border cut: for tests that tell samples apart by their
# pixels (parquet data is otherwise cropped as ImageNet training does: rayvit.data.images).
WHOLE_IMAGES = ("data.crop_scale=[1, 1]", "data.crop_ratio=[1, 1]", "data.hflip=0", "data.crop_pct=1")


# -- MLflow records -------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_result(strategy: str, world_size: int, tflops: float, images_per_chip: float, gpu: bool = False) -> RunResult:
    """A RunResult as the trainer returns it, with chosen figures (inputs for the code under test).

    Peak memory per rank is 4e7, 5e7, ... bytes (max 5e7 at two ranks); ``gpu`` adds what a CUDA run with
    NVML records (reserved memory, utilisation, power).
    """
    metrics = {"images_per_sec": images_per_chip * world_size, "images_per_sec_per_chip": images_per_chip,
               "tflops_per_chip": tflops, "mfu": tflops / 2.0, "step_time_p50_s": 0.1, "step_time_p90_s": 0.12,
               "model_state_bytes_per_rank": 4e6 / (world_size if strategy != "ddp" else 1),
               "peak_memory_bytes_per_rank": 5e7, "final_loss": 1.5, "val_accuracy": None,
               "epoch_time_imagenet_h": 3.0, "train_flops_per_image": 1e9, "peak_tflops": 2.0,
               "timed_steps": 10, "wall_time_s": 4.0}
    per_rank = {"peak_memory_bytes": [4e7 + 1e7 * r for r in range(world_size)]}
    metrics["peak_memory_bytes_per_rank"] = max(per_rank["peak_memory_bytes"])
    if gpu:
        per_rank.update(peak_memory_reserved_bytes=[6e7 + 1e7 * r for r in range(world_size)],
                        gpu_utilization_pct=[90.0 - 10 * r for r in range(world_size)],
                        gpu_power_w=[400.0 - 50 * r for r in range(world_size)])
        metrics.update(peak_memory_reserved_bytes_per_rank=max(per_rank["peak_memory_reserved_bytes"]),
                       gpu_utilization_pct=sum(per_rank["gpu_utilization_pct"]) / world_size,
                       gpu_utilization_pct_max=90.0, gpu_power_w=sum(per_rank["gpu_power_w"]) / world_size,
                       gpu_power_w_max=400.0, gpu_samples=30.0)
    conditions = {"model": "custom", "image_size": 32, "batch_per_chip": 16, "precision": "fp32",
                  "strategy": strategy, "world_size": world_size, "accelerator": "cpu",
                  "torch_version": "2.13.0", "ray_version": "2.60.0", "fairscale_version": "0.4.13",
                  "rayvit_version": "0.1.0", "data": "synthetic",
                  "memory_measure": "cuda_allocated" if gpu else "process_rss"}
    history = [{"step": s, "loss": 2.0 - 0.1 * s, "lr": 1e-3, "step_time_s": 0.1} for s in range(1, 6)]
    return RunResult(metrics, conditions, history, config={"parallel": {"strategy": strategy}},
                     per_rank=per_rank)


# -- data -----------------------------------------------------------------------------------------

CPU = torch.device("cpu")


def config(*overrides: str):
    return load_config(overrides=["train.batch_size=16", "model.image_size=16", *overrides])


def sample_key(image: torch.Tensor) -> bytes:
    """Identify a digit by its pixels (every load_digits image is distinct)."""
    return image[0].cpu().numpy().tobytes()


def take(data: Data, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(data.train) for _ in range(steps)]


def train_steps(session, steps: int) -> None:
    """``steps`` optimizer steps of a ``rayvit.worker.Session``."""
    for _ in range(steps):
        session.clear_grads()
        session.train_step()


def checkpointed_after(cfg, steps: int, folder, **session_kwargs) -> None:
    """A session of ``cfg`` trained ``steps`` steps, its resumable checkpoint written to ``folder``, closed."""
    from rayvit.worker import Session
    from rayvit.worker.checkpoint_io import save_state

    session = Session(cfg, **session_kwargs)
    try:
        train_steps(session, steps)
        save_state(session, str(folder))
    finally:
        session.close()


class Counted:
    """A session's own train stream, counting the batches drawn from it (``drawn``)."""

    def __init__(self, batches):
        self.batches, self.drawn = batches, 0

    def __next__(self):
        self.drawn += 1
        return next(self.batches)

    def close(self):
        self.batches.close()


def export_digits_parquet(root: Path) -> Path:
    """All 1797 digits exported as PNGs under ``root`` and converted with the to_parquet CLI (4 shards)."""
    import contextlib
    import io

    from rayvit.cli import to_parquet

    export_image_folder(root / "folder")
    # The CLI's own entry point, in this process (a subprocess would spend seconds importing).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = to_parquet([str(root / "folder"), str(root / "parquet"), "--rows-per-shard", "500"])
    assert code == 0, printed.getvalue()
    assert "wrote 1797 images of 10 classes to 4 shard(s)" in printed.getvalue()
    return root / "parquet"


def export_photos_parquet(root: Path, per_class: int = 8, bad: bool = False, rows_per_shard: int = 100) -> Path:
    """The sample photographs (rayvit.data.photos, 8 classes) as parquet through the to_parquet CLI; with
    ``bad``, the odd images a real dataset holds added to the first class (:func:`write_odd_images`)."""
    import contextlib
    import io

    from rayvit.data.photos import make_photos
    from rayvit.cli import to_parquet

    folder = make_photos(root / "photos", per_class=per_class)
    if bad:
        write_odd_images(folder / "astronaut")
    with contextlib.redirect_stdout(io.StringIO()):
        assert to_parquet([str(folder), str(root / "parquet"), "--rows-per-shard", str(rows_per_shard)]) == 0
    return root / "parquet"


ODD_IMAGES = ("grey.jpg", "cmyk.jpg", "rgba.png", "tiny.jpg", "truncated.jpg")


def write_odd_images(folder: Path) -> None:
    """A greyscale and a CMYK JPEG, an RGBA PNG among the JPEGs, a 20x15 JPEG (smaller than any crop) and a
    JPEG cut off after its first kilobyte (corrupt), each from a photograph."""
    from PIL import Image

    from rayvit.data.photos import source_photographs

    photo = Image.fromarray(source_photographs()["chelsea"]).resize((300, 200))
    photo.convert("L").save(folder / "grey.jpg", quality=90)
    photo.convert("CMYK").save(folder / "cmyk.jpg", quality=90)
    rgba = photo.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(folder / "rgba.png")
    photo.resize((20, 15)).save(folder / "tiny.jpg", quality=90)
    whole = folder / "whole.jpg"
    photo.save(whole, quality=95)
    (folder / "truncated.jpg").write_bytes(whole.read_bytes()[:1024])
    whole.unlink()


# -- projection -----------------------------------------------------------------------------------

COMBOS = [(s, m) for s in ("ddp", "fsdp", "fairscale_oss") for m in ("fp32", "amp", "mixed", "pure")
          if not (s == "fairscale_oss" and m == "mixed")]


def reduce_dtype(strategy: str, mode: str) -> str:
    """ShardedDDP reduces in the parameters' dtype: under pure it can only be told to reduce in half."""
    return "parallel.reduce_dtype=" + ("half" if strategy == "fairscale_oss" and mode == "pure" else "fp32")


def vit_b16(**overrides):
    cfg = from_dict({"model": {"name": "vit_b16", "image_size": 224, "num_classes": 1000}})
    return cfg.replace(overrides) if overrides else cfg


# -- two gloo ranks in spawned processes, and what they send ---------------------------------------


# The ranks are forked from a forkserver that has imported torch and rayvit's worker once (multiprocessing
# starts it at the first call and keeps it for the session): a fresh interpreter per call (``spawn``)
# spent about a second per rank importing them. Each rank is still a new process of its own, forked from
# a server that never ran anything, so no call sees another's state (or this process's: a server is no
# fork of pytest). The server's sys.path, working directory and environment are those of its start; each
# rank takes this process's current ones before it unpickles its function, as a spawned rank would.
_PRELOAD = ["torch", "torch.distributed", "rayvit.config", "rayvit.worker", "shared"]


def _entry(rank: int, folder: str, state: tuple, payload: bytes, timeout_s: float | None = None) -> None:
    import pickle
    import sys
    from datetime import timedelta

    path, cwd, environ = state
    sys.path[:] = path
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    fn, args = pickle.loads(payload)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2, **timeout)
    try:
        torch.save(fn(rank, *args), f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def two_ranks(tmp_path, fn, *args, timeout_s: float | None = None, join: bool = True) -> list:
    """Run ``fn(rank, *args)`` on two gloo ranks (new processes, no Ray); their return values, rank 0
    first. ``fn`` must be importable by name (a module-level function). ``timeout_s``: the process group's
    timeout (a collective one rank never joins fails after it; default torch's 30 minutes).
    ``join=False``: the two processes, started (a rank that dies does not end the other; each rank's
    return value is in ``tmp_path / f"rank{rank}.pt"`` once it has returned)."""
    import multiprocessing
    import pickle
    import sys

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    state = (list(sys.path), os.getcwd(), dict(os.environ))
    context = mp.start_processes(_entry, args=(str(tmp_path), state, pickle.dumps((fn, args)), timeout_s),
                                 nprocs=2, join=join, start_method="forkserver")
    if not join:
        return context.processes
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@contextmanager
def spied(record: Callable[[str, tuple, dict], None], *names: str, module=dist):
    """While inside: each function ``names`` of ``module`` (torch.distributed) first calls
    ``record(name, args, kwargs)``, then does its work."""
    real = {name: getattr(module, name) for name in names}

    def spy(*args, _name, **kwargs):
        record(_name, args, kwargs)
        return real[_name](*args, **kwargs)

    for name in names:
        setattr(module, name, lambda *a, _n=name, **k: spy(*a, _name=_n, **k))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)


@contextmanager
def flag_apart(sent: list, flags: list):
    """While inside, what :func:`rayvit.worker.agree.nonfinite_ranks` sends (one float per rank after every
    step, outside its clock) is moved from the end of ``sent`` (where a spy records a step's collectives)
    to ``flags``, one list per step: a step's own collectives are what the projection counts."""
    from rayvit.worker import agree

    real = agree.nonfinite_ranks

    def apart(value, device):
        before = len(sent)
        verdict = real(value, device)
        flags.append(sent[before:])
        del sent[before:]
        return verdict

    agree.nonfinite_ranks = apart
    try:
        yield
    finally:
        agree.nonfinite_ranks = real


# -- a caller's process ---------------------------------------------------------------------------


class ProcessSnapshot:
    """What a public entry point must leave as it found it: the environment, every logger's level,
    handlers and propagation, torch's thread count, ``sys.excepthook`` and the signal handlers."""

    def __init__(self) -> None:
        import ray  # noqa: F401 - importing Ray sets RAY_CLIENT_MODE itself: compare after it

        loggers = {"": logging.getLogger(), **{n: lg for n, lg in logging.Logger.manager.loggerDict.items()
                                               if isinstance(lg, logging.Logger)}}
        self.environ = dict(os.environ)
        self.loggers = {n: (lg.level, list(lg.handlers), lg.propagate) for n, lg in loggers.items()}
        self.threads = torch.get_num_threads()
        self.excepthook = sys.excepthook
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def differences(self) -> list[str]:
        now = ProcessSnapshot()
        found = [f"env {k}: {self.environ.get(k)!r} -> {now.environ.get(k)!r}"
                 for k in set(self.environ) | set(now.environ) if self.environ.get(k) != now.environ.get(k)]
        found += [f"logger {n!r}: {self.loggers[n]} -> {now.loggers.get(n)}" for n in self.loggers
                  if now.loggers.get(n) != self.loggers[n]]
        if now.threads != self.threads:
            found.append(f"torch threads {self.threads} -> {now.threads}")
        if now.excepthook is not self.excepthook:
            found.append("sys.excepthook replaced")
        found += [f"signal {s}" for s in self.signals if now.signals[s] is not self.signals[s]]
        return found

# -- FairScale FSDP on CPU: what its wrapper, flat shards and weight decay are, with no GPU ------------------


def fairscale_fsdp_on_cpu(overrides, seed=0):
    """A FairScale FSDP strategy and its wrapped tiny ViT, built on CPU (one rank)."""
    from rayvit.models import build_model
    from rayvit.strategies import strategy_class
    from rayvit.training.precision import Precision

    CPU = torch.device("cpu")
    cfg = load_config(overrides=["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true", *overrides])
    cls = strategy_class("fairscale_fsdp")
    precision = Precision(cfg.precision, CPU, cls.owns_mixed_precision)
    strategy = cls(cfg, precision, CPU)
    torch.manual_seed(seed)
    model, optimizer = strategy.parallelize(precision.prepare_model(build_model(cfg.model)))
    return cfg, strategy, model, optimizer


def reference_step(cfg, seed, grads_seed):
    """The step every strategy must reproduce: torch's optimizer over decay groups of the plain model."""
    from rayvit.models import build_model
    from rayvit.training.optim import build_optimizer, param_groups

    torch.manual_seed(seed)
    model = build_model(cfg.model)
    optimizer = build_optimizer(cfg.optim, param_groups(model, cfg.optim.weight_decay))
    gen = torch.Generator().manual_seed(grads_seed)
    grads = {id(p): torch.randn(p.shape, generator=gen) for p in model.parameters()}
    for p in model.parameters():
        p.grad = grads[id(p)].clone()
    optimizer.step()
    return model, grads


def unwrapped_paths(wrapped: "torch.nn.Module") -> dict[int, str]:
    """id(module) -> its path in the unwrapped model (FairScale's wrapper levels left out)."""
    levels = ("_fsdp_wrapped_module", "_fpw_module")
    return {id(m): ".".join(part for part in path.split(".") if part not in levels)
            for path, m in wrapped.named_modules()}
