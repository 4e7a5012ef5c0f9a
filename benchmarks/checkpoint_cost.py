"""What checkpoints add to a run: the final model's save, and the wait for Ray Train to commit a checkpoint.

``final``: two gloo ranks (no Ray) train a few steps of each model and strategy, then, in alternating
rounds, write the model alone (``checkpoint_io.save_model``: what a ``make_trainer`` run's final checkpoint
adds by default; FSDP2 gathers it onto rank 0 first) and the full resumable state
(``checkpoint_io.save_state``: what ``train.checkpoint_every`` writes). Per case it prints the medians of
each, in ms and in timed steps of that run, and the bytes written.

``commit``: a local Ray instance, two workers of one CPU each; a train function reports a checkpoint
every few steps and times ``ray.train.get_all_reported_checkpoints(COMMITTED)`` right after each report
(rayvit.launch.entry waits so after every checkpoint but the last), once under Ray Train's own 2 s
health-check tick and once under rayvit's 0.5 s.

    python benchmarks/checkpoint_cost.py [--what final,commit] [--rounds 5] [--models cpu_default,vit_ti16]

Say which CPU the figures came from (``lscpu``); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STRATEGIES = ("ddp", "fsdp", "fairscale_oss")
# A shipped config's name, or a model preset at 224 px (batch 2, so that a step stays short on a CPU).
MODELS = {"cpu_default": ("cpu_default", []),
          "vit_ti16": (None, ["model.name=vit_ti16", "model.image_size=224", "train.batch_size=2"]),
          "vit_s16": (None, ["model.name=vit_s16", "model.image_size=224", "train.batch_size=2"])}


def _bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _timed(fn, folder: str) -> tuple[float, int]:
    """Seconds ``fn(folder)`` took on every rank (the slowest), and the bytes this rank wrote."""
    dist.barrier()
    start = time.perf_counter()
    fn(folder)
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), _bytes(folder) if os.path.isdir(folder) else 0


def _case(model: str, strategy: str, rounds: int, scratch: str) -> dict:
    from rayvit.config import load_config
    from rayvit.worker import Session, checkpoint_io

    name, overrides = MODELS[model]
    cfg = load_config(name, [*overrides, "parallel.num_workers=2", f"parallel.strategy={strategy}",
                             "train.warmup_steps=1"])
    session = Session(cfg)
    try:
        for _ in range(4):
            session.clear_grads()
            session.train_step()
        times: dict[str, list[float]] = {"model": [], "full": []}
        written = {}
        for r in range(rounds):
            order = ("model", "full") if r % 2 == 0 else ("full", "model")
            for what in order:
                folder = os.path.join(scratch, f"{model}-{strategy}-{what}-{r}-rank{session.rank}")
                save = checkpoint_io.save_model if what == "model" else checkpoint_io.save_state
                seconds, size = _timed(lambda f, save=save: save(session, f), folder)
                times[what].append(seconds)
                total = torch.tensor([size], dtype=torch.float64)
                dist.all_reduce(total)
                written[what] = total.item()
        step = statistics.median(session.clock.step_times)
    finally:
        session.close()
    return {"step": step, **{f"{k}_s": statistics.median(v) for k, v in times.items()},
            **{f"{k}_bytes": v for k, v in written.items()}}


def _final_rank(rank: int, folder: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        for model in args.models:
            for strategy in STRATEGIES:
                c = _case(model, strategy, args.rounds, folder)
                if rank == 0:
                    print(f"  {model:<12} {strategy:<14} step {c['step'] * 1e3:8.1f} ms | model alone "
                          f"{c['model_s'] * 1e3:7.1f} ms ({c['model_s'] / c['step']:5.2f} steps, "
                          f"{c['model_bytes'] / 2**20:6.1f} MiB) | full state {c['full_s'] * 1e3:7.1f} ms "
                          f"({c['full_s'] / c['step']:5.2f} steps, {c['full_bytes'] / 2**20:6.1f} MiB)", flush=True)
    finally:
        dist.destroy_process_group()


def final_model(args: argparse.Namespace) -> None:
    print(f"the final model against the full state, 2 gloo ranks of one thread, median of {args.rounds} "
          f"alternating rounds (the slowest rank's time; bytes over both ranks):", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_final_rank, args=(folder, args), nprocs=2, join=True, start_method="spawn")


def _commit_loop(config: dict) -> dict:
    import ray.train
    from ray.train import Checkpoint

    waits = []
    for i in range(config["checkpoints"]):
        time.sleep(config["between_s"])              # the steps between two checkpoints
        with tempfile.TemporaryDirectory() as tmp:
            if ray.train.get_context().get_world_rank() == 0:
                torch.save({"i": i}, os.path.join(tmp, "state.pt"))
            ray.train.report({"i": i}, checkpoint=Checkpoint.from_directory(tmp) if os.listdir(tmp) else None)
        start = time.perf_counter()
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        waits.append(time.perf_counter() - start)
    return {"waits": waits}


def commit_wait(args: argparse.Namespace) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    print(f"the wait for Ray Train to commit a checkpoint, 2 workers, {args.rounds} checkpoints 1 s apart:",
          flush=True)
    with tempfile.TemporaryDirectory() as storage:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for tick in ("2", "0.5"):
                os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = tick
                trainer = TorchTrainer(_commit_loop, train_loop_config={"checkpoints": args.rounds, "between_s": 1.0},
                                       scaling_config=ScalingConfig(num_workers=2),
                                       run_config=RunConfig(storage_path=storage, name=f"commit-{tick}"))
                waits = trainer.fit().return_value["waits"]
                print(f"  tick {tick:>3} s: median {statistics.median(waits) * 1e3:6.0f} ms, max "
                      f"{max(waits) * 1e3:6.0f} ms per checkpoint (rank 0)", flush=True)
        finally:
            os.environ.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
            ray.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", default="final,commit", help="final, commit or both (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="cpu_default,vit_ti16,vit_s16",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    what = set(args.what.split(","))
    if "final" in what:
        final_model(args)
    if "commit" in what:
        commit_wait(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
