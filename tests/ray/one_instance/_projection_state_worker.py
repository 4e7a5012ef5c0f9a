"""One rank of the world-size-2 model-state check in tests/ray/one_instance/test_projection_distributed.py (run as a subprocess).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/ray/one_instance/_projection_state_worker.py

Trains each strategy x precision for two steps on a gloo process group and prints rank 0's
``model_state_bytes_per_rank`` (the max over ranks) per combination as JSON. ``small_bucket`` runs
fairscale_oss with a 5,000-element ShardedDDP bucket, so some gradients fall outside it.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COMBOS = [(s, m) for s in ("ddp", "fsdp", "fairscale_oss") for m in ("fp32", "amp", "mixed", "pure")
          if not (s == "fairscale_oss" and m == "mixed")]


def reduce_dtype(strategy: str, mode: str) -> str:
    """ShardedDDP reduces in the parameters' dtype: under pure it can only be told to reduce in half."""
    return "parallel.reduce_dtype=" + ("half" if strategy == "fairscale_oss" and mode == "pure" else "fp32")
SMALL_BUCKET = 5000


def measure(strategy: str, mode: str) -> float:
    from rayvit.config import load_config
    from rayvit.worker import train

    cfg = load_config(ROOT / "experiments/configs/cpu_default.yaml", [
        f"parallel.strategy={strategy}", f"precision.mode={mode}", "parallel.num_workers=2", "train.steps=2",
        "train.warmup_steps=1", "train.batch_size=4", reduce_dtype(strategy, mode)])
    return train(cfg).metrics["model_state_bytes_per_rank"]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {f"{s}/{m}": measure(s, m) for s, m in COMBOS}
    import fairscale.nn.data_parallel as fdp

    original = fdp.ShardedDataParallel

    class SmallBucket(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, reduce_buffer_size=SMALL_BUCKET, **kwargs)

    fdp.ShardedDataParallel = SmallBucket
    out["fairscale_oss/fp32/small_bucket"] = measure("fairscale_oss", "fp32")
    fdp.ShardedDataParallel = original
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
