"""The GPU check's cases: each runs one thing only a GPU can tell and returns its detail, raising on a
failure or :class:`NotCheckable` where this machine cannot tell (see :mod:`rayvit.gpu_check`)."""


from __future__ import annotations

import math
import traceback
from typing import Any, Callable, Optional

from rayvit.errors import NotCheckable


# Run from a checkout (or a `ray job submit --working-dir` copy) without installing the package.

# A small ViT for the functional checks: head_dim 64 so the flash kernel applies, a second or two per run.
SMALL_MODEL = {"name": "custom", "hidden_dim": 256, "depth": 4, "num_heads": 4, "mlp_dim": 1024,
               "patch_size": 16, "image_size": 64, "num_classes": 10}


# --------------------------------------------------------------------------------------------------
# Checks: each returns a short detail string, or raises with the reason it failed.


def _two_rank_entry(rank: int, backend: str, devices: Optional[tuple], folder: str, fn, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if devices is None else torch.device("cuda", devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        try:
            outcome = ("ok", fn(device, *args))
        except Exception as e:              # the parent raises it, with the rank
            outcome = ("error", f"{one_line(e)}\n{traceback.format_exc()}")
        torch.save(outcome, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def on_two_ranks(fn: Callable, *args, backend: str = "gloo", devices: Optional[tuple] = None) -> list:
    """``fn(device, *args)`` on two ranks of a new process group in spawned processes; their results.

    ``devices``: the CUDA device index of each rank (gloo allows both on one GPU; NCCL needs two), or
    None for CPU. A rank's exception is raised here, naming the rank.
    """
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_two_rank_entry, args=(backend, devices, folder, fn, args), nprocs=2, join=True)
        outcomes = [torch.load(f"{folder}/rank{r}.pt", weights_only=False) for r in range(2)]
    for r, (kind, value) in enumerate(outcomes):
        if kind == "error":
            raise RuntimeError(f"rank {r}: {value}")
    return [value for _, value in outcomes]


def check_nccl(device) -> str:
    """A one-rank NCCL process group all-reduces a CUDA tensor."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        t = torch.arange(1024, dtype=torch.float32, device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize(device)
        if not torch.equal(t.cpu(), torch.arange(1024, dtype=torch.float32)):
            raise RuntimeError("one-rank all_reduce changed the tensor")
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()
    version = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return f"backend {backend}, NCCL {version}"


def small_config(overrides: dict[str, Any], *, steps: int = 30):
    """A functional-check run: the small ViT on synthetic batches, ``steps`` steps on one GPU."""
    from rayvit.config import from_dict

    base = {"model": dict(SMALL_MODEL), "data": {"name": "synthetic"},
            "parallel": {"use_gpu": True, "num_workers": 1},
            "train": {"batch_size": 32, "steps": steps, "warmup_steps": min(5, steps - 1), "report_every": steps}}
    return from_dict(base, overrides)


def check_training(device, overrides: dict[str, Any], steps: int = 30) -> str:
    """Train the small ViT with ``overrides``: the loss must be finite and fall."""
    from rayvit.worker import train

    cfg = small_config(overrides, steps=steps)
    result = train(cfg, device=device)
    losses = [h["loss"] for h in result.history]
    if len(losses) != steps:
        raise RuntimeError(f"ran {len(losses)} of {steps} steps")
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    m, c = result.metrics, result.conditions
    compiled = ""
    if cfg.model.compile:
        if not m.get("compile_time_s", 0) > 0:
            raise RuntimeError(f"model.compile=true recorded no compile time: {m.get('compile_time_s')}")
        compiled = f", compiled in {m['compile_time_s']:.1f} s (outside the timing)"
    return (f"{c['precision']}, reduce {c['reduce_dtype']}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"{m['images_per_sec_per_chip']:.0f} img/s, peak {m['peak_memory_bytes_per_rank'] / 2**20:.0f} MiB"
            + compiled)


def trained_session(device, overrides: dict[str, Any], steps: int, before_steps=None):
    """A Session of the small ViT after ``steps`` steps, and its losses; ``before_steps(session)`` first."""
    from rayvit.worker import Session

    session = Session(small_config(overrides, steps=steps), device)
    try:
        if before_steps is not None:
            before_steps(session)
        losses = []
        for _ in range(steps):
            session.clear_grads()
            losses.append(session.train_step())
    except BaseException:
        session.close()
        raise
    return session, losses


def dtype_names(dtypes) -> str:
    from rayvit.training.hardware import dtype_name

    return "/".join(sorted(dtype_name(d) for d in dtypes)) or "none"


def check_layer_norm_fp32(device, strategy: str, dtype: str, steps: int = 4) -> str:
    """``mixed``: LayerNorm weights, outputs and gradients fp32 while the matmuls run in half."""
    import torch
    from torch import nn

    from rayvit.strategies import Strategy

    seen: dict[str, set] = {"norm_w": set(), "norm_out": set(), "mm": set()}

    def on_norm(module, inputs, output) -> None:       # a hook returning a value would replace the output
        seen["norm_w"].add(module.weight.dtype)
        seen["norm_out"].add(output.dtype)

    def on_linear(module, inputs, output) -> None:
        seen["mm"].add(output.dtype)

    def spy(session) -> None:
        for m in Strategy.unwrap(session.model).modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_hook(on_norm)
            elif isinstance(m, nn.Linear):
                m.register_forward_hook(on_linear)

    session, losses = trained_session(device, {"parallel.strategy": strategy, "precision.mode": "mixed",
                                                "precision.dtype": dtype}, steps, spy)
    try:
        norms = [m for m in Strategy.unwrap(session.model).modules() if isinstance(m, nn.LayerNorm)]
        grads = {p.grad.dtype for m in norms for p in m.parameters() if p.grad is not None}
    finally:
        session.close()
    facts = (f"LayerNorm weight {dtype_names(seen['norm_w'])}, output {dtype_names(seen['norm_out'])}, grad "
             f"{dtype_names(grads)}; matmuls {dtype_names(seen['mm'])}")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    fp32 = {torch.float32}
    if not (seen["norm_w"] == seen["norm_out"] == grads == fp32 and seen["mm"] == {half}):
        raise RuntimeError(f"expected LayerNorm fp32 and matmuls {dtype}: {facts}")
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss ({facts}): {losses}")
    return facts


# Where the reduce-dtype check sees the dtype a strategy reduces half gradients in at one rank: (module,
# function, index of the tensor sent among its positional arguments). A strategy not listed reduces nothing
# at one rank (FairScale FSDP forces fp32_reduce_scatter there; OSS reduces to the owner, itself): the
# check then needs two GPUs.
REDUCE_CALLS: dict[str, tuple[str, str, int]] = {
    "ddp": ("torch.distributed", "all_reduce", 0),
    # FSDP2 allocates its reduce-scatter input in the reduce dtype, at one rank too.
    "fsdp": ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_reduce_scatter_copy_in", 1),
    # HSDP is FSDP2 on a 2-D mesh: the same buffer, before its reduce-scatter and the shards' all-reduce.
    "hsdp": ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_reduce_scatter_copy_in", 1),
}


def check_reduce_dtype(device, strategy: str, mode: str, dtype: str, reduce: str, steps: int = 3) -> str:
    """The dtype this strategy reduces half gradients in, seen where it hands them over
    (:data:`REDUCE_CALLS`): DDP's communication hook calls ``all_reduce``; FSDP2 fills the buffer it
    reduce-scatters from (allocated in the reduce dtype even at one rank). A strategy that reduces nothing
    at one rank (FairScale FSDP) is checked on two GPUs.
    """
    import importlib

    import torch

    from rayvit.training.hardware import dtype_name
    from rayvit.worker import run_figures

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    expected = torch.float32 if reduce == "fp32" else half
    call = REDUCE_CALLS.get(strategy)
    if call is None:
        # At one rank FairScale reduces nothing and forces fp32_reduce_scatter: ->fp32 and ->half pass alike.
        if not (device.type == "cuda" and torch.cuda.device_count() >= 2):
            raise NotCheckable(f"not checkable on one GPU: {strategy} reduces nothing at one rank (FairScale "
                               "forces fp32_reduce_scatter there); needs two GPUs")
        ranks = on_two_ranks(_reduce_scatter_dtypes, strategy, mode, dtype, reduce, steps, backend="nccl",
                             devices=(0, 1))
        sent = set().union(*ranks)
        facts = f"2 ranks (NCCL), reduce-scattered in {dtype_names(sent)}"
        # fp32 LayerNorm wrappers (mixed) always reduce their fp32 gradients in fp32 beside the half ones.
        if not (expected in sent and sent <= {expected, torch.float32}):
            raise RuntimeError(f"expected {dtype_name(expected)}: {facts}")
        return facts
    sent: list = []
    module_name, name, index = call         # where the strategy hands its gradients over
    module = importlib.import_module(module_name)
    real = getattr(module, name)

    def spy(*args, **kwargs):
        tensor = args[index]
        if tensor.numel() > 1:              # not the loss scaler's one-element overflow flag
            sent.append(tensor.dtype)
        return real(*args, **kwargs)

    setattr(module, name, spy)
    try:
        session, _ = trained_session(device, {"parallel.strategy": strategy, "precision.mode": mode,
                                               "precision.dtype": dtype, "parallel.reduce_dtype": reduce}, steps)
    finally:
        setattr(module, name, real)
    try:
        recorded = run_figures.conditions(session, "check")["reduce_dtype"]
        facts = f"reduced in {dtype_names(set(sent))}"
        # fp32 LayerNorm gradients (mixed) always travel in fp32 beside the half ones.
        ok = expected in sent and set(sent) <= {expected, torch.float32}
    finally:
        session.close()
    facts += f"; recorded reduce_dtype={recorded}"
    if not ok or recorded != dtype_name(expected):
        raise RuntimeError(f"expected {dtype_name(expected)}: {facts}")
    return facts


def _reduce_scatter_dtypes(device, strategy: str, mode: str, dtype: str, reduce: str, steps: int) -> set:
    """On one of two ranks: the dtypes ``strategy`` (FairScale FSDP) reduce-scatters gradients in over
    ``steps`` steps."""
    import torch.distributed as dist

    sent: set = set()
    names = [n for n in ("_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def spy(*args, _name, **kwargs):
        given = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_list"))
        sent.add((given[0] if isinstance(given, (list, tuple)) else given).dtype)
        return real[_name](*args, **kwargs)

    for n in names:          # fairscale.internal.reduce_scatter_bucketer looks them up on torch.distributed
        setattr(dist, n, lambda *a, _n=n, **k: spy(*a, _name=_n, **k))
    try:
        session, _ = trained_session(device, {"parallel.strategy": strategy, "precision.mode": mode,
                                               "precision.dtype": dtype, "parallel.reduce_dtype": reduce}, steps)
        session.close()
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    if not sent:
        raise RuntimeError(f"{strategy} reduce-scattered nothing at two ranks")
    return sent


def _decayed_shards(device) -> tuple[int, int, int]:
    """On one of two ranks: one AdamW step on zero gradients over this rank's flat-parameter shards."""
    import torch

    from rayvit.worker import Session

    session = Session(small_config({"parallel.strategy": "fairscale_fsdp", "optim.weight_decay": 0.5,
                                    "optim.lr": 0.1}), device)
    try:
        decay = session.strategy.masked_decay
        if not all(getattr(p, "_is_sharded", False) for p in decay.params):
            raise RuntimeError("the flat parameters are not sharded: the sharded branch was not taken")
        before = [p.detach().clone() for p in decay.params]
        for p in decay.params:
            p.grad = torch.zeros_like(p)
        session.strategy.optimizer_step(session.model, session.optimizer)
        for p, old, mask in zip(decay.params, before, decay.masks):
            torch.testing.assert_close(p.detach()[mask], old[mask] * (1 - 0.1 * 0.5))
            torch.testing.assert_close(p.detach()[~mask], old[~mask], rtol=0, atol=0)
        return (len(decay.params), sum(int(m.sum()) for m in decay.masks), sum(m.numel() for m in decay.masks))
    finally:
        session.close()


def check_fairscale_weight_decay(device) -> str:
    """One AdamW step on zero gradients is pure decay: flat-parameter elements from matrices shrink by
    ``1 - lr * wd``, those from biases, norms, position embedding and class token do not move. On two
    gloo ranks sharing the device, so that each rank steps a shard of every flat parameter (at one rank
    FairScale does not shard, and the masks' shard arithmetic would go unchecked)."""
    devices = None if device.type == "cpu" else (device.index or 0,) * 2
    (params, decayed0, total0), (_, decayed1, total1) = on_two_ranks(_decayed_shards, backend="gloo",
                                                                     devices=devices)
    if not (total0 and total1):
        raise RuntimeError(f"a rank holds no flat-parameter elements ({total0:,} and {total1:,})")
    return (f"{params} flat parameters over 2 ranks: {decayed0:,} of {total0:,} and {decayed1:,} of {total1:,} "
            f"elements decay (matrices), the rest do not")


def check_flash(device) -> str:
    """Flash attention through SDPA: enabled, runnable alone in bf16, and what SDPA picks by itself."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rayvit.config import from_dict
    from rayvit.config_schema import ModelConfig
    from rayvit.models import build_model

    if not torch.backends.cuda.flash_sdp_enabled():
        raise RuntimeError("torch.backends.cuda.flash_sdp_enabled() is False")
    # ViT-L/16 at 224 px: 16 heads of 64 over 197 tokens.
    q, k, v = (torch.randn(8, 16, 197, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):       # raises "No available kernel" if flash cannot run
        out = F.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
    torch.cuda.synchronize(device)

    # The model's own attention (strided q/k/v views in both layouts) must qualify for flash too.
    for layout in ("batch_first", "batch_second"):
        model_cfg: ModelConfig = from_dict({"model": {**SMALL_MODEL, "layout": layout}}).model
        model = build_model(model_cfg).to(device=device, dtype=torch.bfloat16)
        images = torch.randn(4, 3, model_cfg.image_size, model_cfg.image_size, device=device, dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(images).float().sum().backward()
        torch.cuda.synchronize(device)
    forced = "flash runs alone for raw bf16 SDPA and the ViT's attention (both layouts)"

    # SDPA's own choice with every backend allowed: look for a flash kernel in the CUDA trace. A profiler
    # that cannot trace (no CUPTI) gives no verdict either way.
    try:
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize(device)
        kernels = [e.key for e in prof.key_averages()]
    except Exception as e:
        return f"{forced}; SDPA's own choice not determined (profiler: {type(e).__name__}: {e})"
    if not kernels:
        return f"{forced}; SDPA's own choice not determined (the profiler saw no CUDA kernels)"
    flash = [name for name in kernels if "flash" in name.lower()]
    if not flash:
        raise RuntimeError(f"SDPA in bf16 did not pick a flash kernel by itself; its kernels: {kernels[:6]}")
    return f"{forced}; SDPA picks {flash[0][:60]} by itself"


def check_nvml_sampler(device) -> str:
    """A short training run reports its GPU's utilisation and power (NVML, sampled beside training)."""
    import pynvml  # noqa: F401 - without nvidia-ml-py the figures are absent: say so, not "no readings"

    from rayvit.worker import train

    # Long enough for a few dozen readings at 0.1 s (the small ViT steps in milliseconds on big GPUs).
    cfg = small_config({"train.warmup_steps": 20}, steps=600)
    result = train(cfg, device=device)
    m, per_rank = result.metrics, result.per_rank
    missing = [k for k in ("gpu_utilization_pct", "gpu_power_w", "gpu_samples", "peak_memory_reserved_bytes_per_rank")
               if k not in m]
    if missing:
        raise RuntimeError(f"figures missing: {missing}; has {sorted(m)}")
    if not m["gpu_samples"] >= 3:
        raise RuntimeError(f"only {m['gpu_samples']:.0f} NVML readings in the timed window")
    if not (0 < m["gpu_utilization_pct"] <= 100 and 0 < m["gpu_power_w"] < 2000):
        raise RuntimeError(f"implausible readings: {m['gpu_utilization_pct']}% at {m['gpu_power_w']} W")
    if not 0 < m["peak_memory_bytes_per_rank"] <= m["peak_memory_reserved_bytes_per_rank"]:
        raise RuntimeError(f"peak allocated {m['peak_memory_bytes_per_rank']} > reserved "
                           f"{m['peak_memory_reserved_bytes_per_rank']}")
    if [len(per_rank.get(k, [])) for k in ("peak_memory_bytes", "peak_memory_reserved_bytes",
                                           "gpu_utilization_pct", "gpu_power_w")] != [1, 1, 1, 1]:
        raise RuntimeError(f"per-rank figures not one per rank: {per_rank}")
    return (f"{m['gpu_utilization_pct']:.0f}% util, {m['gpu_power_w']:.0f} W over {m['gpu_samples']:.0f} "
            f"readings ({m['timed_steps']:.0f} timed steps, {m['step_time_p50_s'] * 1e3:.1f} ms each), peak "
            f"{m['peak_memory_bytes_per_rank'] / 2**20:.0f} MiB allocated / "
            f"{m['peak_memory_reserved_bytes_per_rank'] / 2**20:.0f} MiB reserved")


def check_profile(device) -> str:
    """The projection's hardware profile for this GPU, as a sweep picks it: never the CPU profile, and
    (for a chip with a profile of its own) the device's memory size within 5%."""
    import warnings

    import torch

    from rayvit.projection.profiles import UnknownAcceleratorWarning, profile_for_accelerator
    from rayvit.training.hardware import accelerator_name

    name = accelerator_name(device)
    memory = torch.cuda.get_device_properties(device).total_memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = profile_for_accelerator(name, memory)
    unknown = any(issubclass(w.category, UnknownAcceleratorWarning) for w in caught)
    facts = f"{name}, {memory / 2**30:.1f} GiB -> {profile.name} ({profile.source})"
    if profile.accelerator is None or profile.overlap < 0.5:
        raise RuntimeError(f"a GPU projected with a CPU profile: {facts}")
    if not unknown and abs(profile.memory_gib * 2**30 / memory - 1) > 0.05:
        raise RuntimeError(f"the profile's memory ({profile.memory_gib:g} GiB) is not the device's: {facts}")
    return facts + ("; no profile of its own: add one to rayvit.projection.profiles" if unknown else "")


def check_activation_memory(device, mode: str, extra: Optional[dict[str, Any]] = None) -> str:
    """The projection's activation bytes per image against torch.cuda.max_memory_allocated's slope over batch
    (``extra``: more overrides, e.g. activation checkpointing, whose recomputed block is in the peak)."""
    from rayvit.measure.activation_memory import allocator_check

    cfg = small_config({"precision.mode": mode, "precision.dtype": "bf16", **(extra or {})}, steps=3)
    r = allocator_check(cfg, device)
    text = (f"per image measured {r['measured_per_image'] / 2**20:.2f} MiB, modelled "
            f"{r['modelled_per_image'] / 2**20:.2f} MiB (x{r['ratio_per_image']:.2f}); peak at batch "
            f"{r['batches'][0]} measured {r['measured_peak'] / 2**20:.0f} MiB, modelled "
            f"{r['modelled_peak'] / 2**20:.0f} MiB (x{r['ratio_peak']:.2f})")
    if not 0.75 <= r["ratio_per_image"] <= 1.33:
        raise RuntimeError("activation model off by more than 25-33%: " + text)
    return text


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]
