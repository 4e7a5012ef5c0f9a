"""Step time per chip, and the throughput figures that follow from it, for any strategy and chip count.

    step = slowdown(N) x (forward + backward + recompute) + exposed communication + optimizer step
           + own overhead + straggler(N)

- forward + backward (``compute``): a measured single-chip rate for this model, batch and precision
  (:class:`ComputeRate`, from a 1-chip point, a ``rayvit bench --json`` file or a ``gpu_check`` JSON), less the
  modelled optimizer step and recompute inside that measurement; otherwise, on a GPU the profiles know,
  the op-level roofline of :mod:`rayvit.projection.roofline` at the projected batch (matmuls at their
  shape's achievable rate, attention per its kernel, memory-bound operations at HBM bandwidth), and on
  CPUs ``train FLOPs / (a timed matmul rate x compute_efficiency)``. Split between forward and backward
  as the roofline finds it (1:2 for a measured rate). ``slowdown`` is the profile's measured cost of every
  chip of a node computing at once (1.0 on GPUs).
- recompute: under ``model.activation_checkpointing`` the checkpointed blocks' forward runs again in
  backward (the roofline's forward of those blocks; for a measured rate its share of the FLOPs).
- communication: :mod:`rayvit.projection.comms` messages. Over a GPU profile's links each costs what NCCL's
  own model says (:mod:`rayvit.projection.nccl`: ring or tree, latency growing with the rank count, the
  cheapest protocol); over measured links ``latency + factor x bytes / busbw`` plus the host's wait for the
  slowest rank, read at the step's mean compute between two collectives (:func:`step_gap`; it grows with
  that gap, and with the rank count as the expected maximum of N, :func:`expected_max`), and plus the
  strategy's own host path per message where measured (FSDP2's copy-in and copy-out at more than one rank:
  ``HardwareProfile.collective_path_s``). A fraction ``overlap`` of forward (backward) compute can hide
  messages issued during it; the first gather of each phase and the last reduction cannot hide, nor can
  anything after backward (OSS's broadcasts). What hides still costs: the compute beside a collective runs
  ``overlap_slowdown`` slower (the collective's kernels hold SMs and memory bandwidth), so ``hidden``
  seconds of collectives add ``hidden x s / (1 + s)`` (:func:`contention_s`); it grows with N as the
  collectives' time does.
- optimizer: bytes the update reads and writes on this rank's elements (Adam: 6 x state + gradient bytes
  per element; SGD: 4 x state + gradient; plus 12 per element of master-copy traffic under ``mixed``,
  3 x gradient for fp16 loss-scale checks) over achievable memory bandwidth, plus a per-tensor launch cost.
- own overhead: what a strategy's wrapper costs per step beyond all that (FSDP2's hooks and DTensor
  dispatch, ShardedDDP's gradient hooks: host work that no link or bandwidth figure shows, and on a CPU
  host a visible share of a step; docs/projection.md). Unknown (0) unless measured:
  inside a sweep, each strategy's own point at the smallest count anchors it
  (:func:`rayvit.projection.insweep.strategy_overheads`).
- straggler: every synchronous step waits for the slowest of N chips. Chips of one SKU differ in
  sustained speed (``HardwareProfile.speed_cv``), so the step takes ``speed_cv x work x E[max of N]``
  longer than one chip's, E[max of N] the expected maximum of N standard normal draws (0 at one chip,
  1.42 at 8, 2.59 at 128). On CPUs the measured wait for the slowest rank covers it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Optional

from rayvit.config_schema import BASELINE, Config
from rayvit.errors import ConfigError
from rayvit.models import vit_complexity
from rayvit.models.activation_checkpointing import checkpointed_blocks
from rayvit.projection import comms, memory, nccl, roofline
from rayvit.projection.hardware_profile import HardwareProfile, Link
from rayvit.strategies import strategy_class
from rayvit.strategies.dtypes import FULL
from rayvit.strategies.registry import dtypes_of, layout_of, lineage

FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class ComputeRate:
    """Forward + backward seconds per image on one chip (recompute excluded), and where that figure came
    from; ``breakdown`` is the roofline's op-by-op account where it came from there."""

    seconds_per_image: float
    source: str
    breakdown: Optional[roofline.ComputeTime] = None

    @property
    def measured(self) -> bool:
        return self.breakdown is None and self.source.startswith("measured")


@dataclass
class Projection:
    chips: int
    strategy: str
    batch: int
    compute_s: float
    comm_s: float            # all messages back to back
    exposed_comm_s: float    # what the step waits for
    optimizer_s: float
    step_s: float
    images_per_sec_per_chip: float
    tflops_per_chip: float
    mfu: Optional[float]
    memory: memory.MemoryBreakdown
    messages: int
    bytes_per_rank: float
    compute_source: str
    label: str = ""          # the strategy's name in tables (``Strategy.label``)
    overhead_s: float = 0.0  # the strategy's own per-step overhead, measured at an anchor point
    vs_ddp: Optional[float] = None
    scaling_efficiency: Optional[float] = None
    notes: list = field(default_factory=list)
    recompute_s: float = 0.0     # activation checkpointing's second forward (inside compute_s)
    straggler_s: float = 0.0     # the wait for the slowest of ``chips`` chips
    hardware: str = ""           # the hardware profile's name
    compute_detail: str = ""     # what the compute is made of (the roofline's shares)
    # Further per-row figures other parts of the projection add (e.g. an input-pipeline term), by name;
    # they travel into ``record()``.
    extras: dict = field(default_factory=dict)
    # The roofline's shares of forward + backward (matmul, attention, memory-bound; the rest is launch gaps
    # or the host), where the compute came from it.
    compute_shares: dict = field(default_factory=dict)

    @property
    def dominant(self) -> str:
        terms = {"compute": self.compute_s, "communication": self.exposed_comm_s, "optimizer": self.optimizer_s,
                 "strategy overhead": self.overhead_s, "stragglers": self.straggler_s}
        return max(terms, key=terms.get)

    def metrics(self) -> dict[str, float]:
        """``projected_*`` figures as logged beside a measured point."""
        out = {"projected_step_time_s": self.step_s, "projected_images_per_sec_per_chip": self.images_per_sec_per_chip,
               "projected_tflops_per_chip": self.tflops_per_chip, "projected_compute_s": self.compute_s,
               "projected_exposed_comm_s": self.exposed_comm_s, "projected_optimizer_s": self.optimizer_s,
               "projected_overhead_s": self.overhead_s, "projected_straggler_s": self.straggler_s,
               "projected_memory_bytes_per_rank": self.memory.total,
               "projected_model_state_bytes_per_rank": float(self.memory.state.total)}
        if self.mfu is not None:
            out["projected_mfu"] = self.mfu
        return out

    def record(self) -> dict[str, Any]:
        """One JSON-able record of this row (``rayvit project --json``): the figures, their parts, memory."""
        m = self.memory
        return {"hardware": self.hardware, "chips": self.chips, "strategy": self.label or self.strategy,
                "batch_per_chip": self.batch, "images_per_sec_per_chip": self.images_per_sec_per_chip,
                "tflops_per_chip": self.tflops_per_chip, "mfu": self.mfu, "scaling_efficiency": self.scaling_efficiency,
                "vs_ddp": self.vs_ddp, "step_time_s": self.step_s, "compute_s": self.compute_s,
                "recompute_s": self.recompute_s, "exposed_comm_s": self.exposed_comm_s, "comm_s": self.comm_s,
                "optimizer_s": self.optimizer_s, "overhead_s": self.overhead_s, "straggler_s": self.straggler_s,
                "dominant": self.dominant, "memory_bytes_per_rank": m.total,
                "model_state_bytes_per_rank": float(m.state.total), "activation_bytes_per_rank": m.activations,
                "fits": m.fits, "max_batch": m.max_batch, "compute_source": self.compute_source,
                "messages": self.messages, "notes": list(self.notes), **self.extras}


@functools.lru_cache(maxsize=None)
def expected_max(n: int) -> float:
    """E[max of n independent standard normal draws] (0 for one): how far the slowest of n chips lies
    above the mean, in standard deviations. Integrated numerically: n x(pdf)(cdf)^(n-1) over x."""
    if n <= 1:
        return 0.0
    unit, lo, hi, steps = NormalDist(), -9.0, 9.0, 3600
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        w = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += w * x * n * unit.pdf(x) * unit.cdf(x) ** (n - 1)
    return total * h / 3


def straggler_s(profile: HardwareProfile, n: int, work_s: float) -> float:
    """The wait for the slowest of ``n`` chips whose speed spreads by ``profile.speed_cv``."""
    return profile.speed_cv * work_s * expected_max(n)


def message_time(m: comms.Message, n: int, profile: HardwareProfile, gap_s: Optional[float] = None,
                 path_s: float = 0.0) -> float:
    """One collective over ``n`` ranks; one rank has no peer and costs nothing.

    Over a GPU profile's links (``Link.hw``): NCCL's cost model (:mod:`rayvit.projection.nccl`). Over
    measured (or gloo) links: ``latency + wait(gap) + factor x bytes / busbw``, the wait for the slowest rank
    read at ``gap_s`` of compute since the previous collective and scaled from the rank count it was
    measured at to ``n`` by the expected maximum of that many ranks. ``path_s``: the strategy's own host
    work per message. A message over a group of the ranks (``Message.group``) runs over that group's links
    (:func:`group_link`)."""
    if m.group and m.group != n:
        n, (link, nodes) = m.group, group_link(profile, m.kind, n, m.group, m.stride)
    else:
        link, nodes = profile.link(m.kind, n), profile.nodes(n)
    if n <= 1:
        return 0.0
    if link.hw:
        seconds, _ = nccl.collective_seconds(m.kind, m.bytes, n, nodes, profile.intra_hw(n) or link.hw, link.busbw)
        return seconds + path_s
    wait = link.wait_s(gap_s)
    ranks = profile.measured_ranks
    if wait and ranks > 1 and n > ranks:
        wait *= expected_max(n) / expected_max(ranks)
    return link.latency_s + wait + path_s + comms.bus_factor(m.kind, n) * m.bytes / link.busbw


def group_span(profile: HardwareProfile, ranks: int, stride: int) -> tuple[int, int]:
    """(nodes, groups per node) of a group of ``ranks`` ranks whose global ranks lie ``stride`` apart, nodes
    holding ``profile.chips_per_node`` consecutive ranks each: how many nodes it crosses, and how many groups
    of its family (every group of a strided family runs the same collective at once) share each node's
    network."""
    per_node = profile.chips_per_node
    if stride <= 1:
        return profile.nodes(ranks), 1
    nodes = len({k * stride // per_node for k in range(ranks)})
    return nodes, min(stride, per_node) if nodes > 1 else 1


def group_link(profile: HardwareProfile, kind: str, n: int, ranks: int, stride: int) -> tuple[Link, int]:
    """(the link, the nodes spanned) of a collective over a group of ``ranks`` of the ``n`` ranks, ``stride``
    apart. Within a node it is the node's link; across nodes the network's for as many nodes, shared by the
    groups of its family that cross each node's NICs at once (HSDP's replica all-reduces: one per shard
    index, each moving 1/shard of the gradients, together what one DDP all-reduce moves), and never faster
    than the node's own link."""
    nodes, share = group_span(profile, ranks, stride)
    if nodes <= 1:
        return profile.link(kind, min(ranks * stride, profile.chips_per_node) if stride > 1 else ranks), 1
    net = profile.link(kind, nodes * profile.chips_per_node)
    if share > 1:
        net = dataclasses.replace(net, busbw=min(net.busbw / share, profile.intra.busbw))
    return net, nodes


def exposed_communication(messages: list[comms.Message], n: int, profile: HardwareProfile,
                          forward_s: float, backward_s: float, *, gap_s: Optional[float] = None,
                          path_s: float = 0.0) -> tuple[float, float]:
    """(all messages back to back, the part the step waits for) in seconds."""
    total = exposed = 0.0
    for phase, hide in (("forward", forward_s), ("backward", backward_s), ("after", 0.0)):
        times = [message_time(m, n, profile, gap_s, path_s) for m in messages if m.phase == phase]
        kinds = [m.kind for m in messages if m.phase == phase]
        total += sum(times)
        if not times:
            continue
        if phase == "after":
            exposed += sum(times)
            continue
        fixed = times[-1] if phase == "backward" else 0.0          # the last reduction waits for all
        if kinds[0] == "all_gather":                               # the first gather has nothing to hide in
            fixed += times[0]
        hideable = sum(times) - fixed
        hidden = min(hideable, profile.overlap * hide)
        exposed += fixed + (hideable - hidden) + contention_s(hidden, profile)
    return total, exposed


def contention_s(hidden_s: float, profile: HardwareProfile) -> float:
    """What ``hidden_s`` seconds of collectives running beside compute cost the step: over that time the
    compute gets through ``1 / (1 + overlap_slowdown)`` of what it would alone."""
    s = profile.overlap_slowdown
    return hidden_s * s / (1.0 + s)


def optimizer_elements(cfg: Config, n: int, per_node: int = 0) -> tuple[int, int]:
    """(elements, tensors) the largest rank's optimizer steps (the strategy's ``optimizer_elements``)."""
    return strategy_class(cfg.parallel.strategy).optimizer_elements(layout_of(cfg, n, per_node=per_node))


def optimizer_time(cfg: Config, n: int, profile: HardwareProfile, *,
                   layer_norm_fp32: Optional[bool] = None) -> float:
    dt = dtypes_of(cfg, layer_norm_fp32)
    elements, tensors = optimizer_elements(cfg, n, profile.chips_per_node)
    state, grad = dt.optimizer_state(False), dt.stored(False)
    per_element = (4 if cfg.optim.name == "sgd" else 6) * state + grad
    if dt.has_master(False):
        per_element += 2 * (2 + FULL)           # half grad -> fp32 master grad, fp32 master -> half weight
    if cfg.precision.mode != "fp32" and cfg.precision.dtype == "fp16":
        per_element += 3 * grad
    launch = profile.per_tensor_s.get(cfg.optim.impl, 0.0)
    return elements * per_element / (profile.memory_bw * profile.memory_efficiency) + tensors * launch


def peak_key(cfg: Config) -> str:
    """The ``PEAK_TFLOPS`` column a step computes at: fp32, or the half dtype."""
    return dtypes_of(cfg).peak_key(cfg.precision.dtype)


def peak_flops(cfg: Config, profile: HardwareProfile) -> Optional[float]:
    """The chip's dense peak for the precision's dtype; on CPUs the host's measured matmul rate (as for
    MFU), where the profile carries one."""
    return profile.peak_flops(peak_key(cfg))


def compute_from_peak(cfg: Config, profile: HardwareProfile, batch: Optional[int] = None) -> ComputeRate:
    """The compute nothing measured: the op-level roofline on a GPU the profiles know, else (CPUs) a timed
    matmul rate x the profile's ``compute_efficiency``. Recompute is left out (``project`` adds it)."""
    batch = batch or cfg.train.batch_size
    chip = roofline.chip_for(profile, peak_key(cfg))
    if chip is not None:
        ct = roofline.step_compute(cfg, chip, batch)
        seconds = ct.seconds - ct.recompute_s
        return ComputeRate(seconds / batch, f"roofline of {chip.spec.name} at batch {batch} ({ct.describe()}; "
                                            f"matmul efficiency {chip.spec.gemm_source})", ct)
    peak = peak_flops(cfg, profile)
    if peak is None:
        what = ("no matmul rate measured on this host" if profile.accelerator is None
                else "no peak in rayvit.accelerators.PEAK_TFLOPS")
        raise ConfigError(f"hardware profile {profile.name} has {what}: give a measured single-chip rate "
                          "(--measured)")
    flops = vit_complexity(cfg.model).train_flops_per_image
    return ComputeRate(flops / (peak * profile.compute_efficiency),
                       f"peak {peak / 1e12:.4g} TFLOPS x efficiency {profile.compute_efficiency:g} (not measured)")


def recompute_fraction(cfg: Config, profile: HardwareProfile, batch: Optional[int] = None) -> float:
    """Activation checkpointing's second forward as a fraction of the step's forward + backward: the
    roofline's where the chip has one, else the checkpointed blocks' share of the training FLOPs."""
    blocks = checkpointed_blocks(cfg.model)
    if not blocks:
        return 0.0
    chip = roofline.chip_for(profile, peak_key(cfg))
    if chip is not None:
        ct = roofline.step_compute(cfg, chip, batch or cfg.train.batch_size)
        return ct.recompute_s / max(ct.seconds - ct.recompute_s, 1e-30)
    whole = vit_complexity(cfg.model)
    stem_and_head = vit_complexity(dataclasses.replace(cfg.model, depth=0))
    per_block = (whole.flops - stem_and_head.flops) / cfg.model.depth
    return len(blocks) * per_block / whole.train_flops_per_image


def compute_from_measured(cfg: Config, images_per_sec: float, profile: HardwareProfile, source: str, *,
                          chips: int = 1) -> ComputeRate:
    """Forward + backward per image from a measured rate of ``cfg`` (its strategy) at ``chips`` chips."""
    batch = cfg.train.batch_size
    step = batch / images_per_sec
    overhead = optimizer_time(cfg, chips, profile)
    msgs = comms.step_messages(cfg, chips, per_node=profile.chips_per_node)
    fb = (step - overhead) / (profile.shared_host_slowdown if _shares_host(profile, chips) else 1.0)
    # The measured step's communication and stragglers, as this model sees them, are not compute either.
    _, exposed = exposed_communication(msgs, chips, profile, fb * FORWARD_SHARE, fb * (1 - FORWARD_SHARE),
                                       gap_s=step_gap(fb + overhead, msgs),
                                       path_s=inherited(profile.collective_path_s, cfg.parallel.strategy))
    fb -= exposed + straggler_s(profile, chips, fb + overhead)
    # A measured run with activation checkpointing computed its checkpointed blocks' forward twice.
    fb /= 1.0 + recompute_fraction(cfg, profile)
    return ComputeRate(max(fb, 0.0) / batch, f"measured: {source}")


def inherited(measured: dict[str, float], strategy: str) -> float:
    """A figure measured by strategy name: ``strategy``'s own, else that of the nearest strategy its runtime
    is built on (``registry.lineage``: HSDP is FSDP2's), else 0."""
    return next((measured[n] for n in lineage(strategy) if n in measured), 0.0)


def step_gap(work_s: float, messages: list[comms.Message]) -> Optional[float]:
    """The mean compute between two of a step's collectives: the step's work (forward, backward, optimizer,
    the wrapper's own) over its messages. DDP's one all-reduce follows a whole step's work; FSDP's nine
    messages at two ranks a ninth each."""
    return work_s / len(messages) if messages else None


def _shares_host(profile: HardwareProfile, chips: int) -> bool:
    return min(chips, profile.chips_per_node) > 1


def project(cfg: Config, chips: int, profile: HardwareProfile, compute: Optional[ComputeRate] = None, *,
            batch: Optional[int] = None, layer_norm_fp32: Optional[bool] = None,
            peak: Optional[float] = None, overhead_s: float = 0.0, accumulation: int = 1) -> Projection:
    """One point: ``cfg`` (its strategy, precision, model) on ``chips`` chips of ``profile``, with
    ``overhead_s`` the strategy's own per-step overhead where it was measured. Without ``compute`` the
    roofline (GPUs) or the timed peak (CPUs) prices it at this batch.

    ``accumulation``: micro-batches of ``batch`` per optimizer step (gradient accumulation, as published
    runs of other code use it; rayvit's own training steps once per batch): their collectives are issued
    once, behind the last micro-batch's compute, and the optimizer steps once."""
    batch = batch or cfg.train.batch_size
    if compute is None or compute.breakdown is not None and compute.breakdown.batch != batch:
        compute = compute_from_peak(cfg, profile, batch)
    one = compute.seconds_per_image * batch
    forward_share = compute.breakdown.forward_share if compute.breakdown else FORWARD_SHARE
    one_recompute = one * recompute_fraction(cfg, profile, batch)
    if _shares_host(profile, chips):
        one, one_recompute = one * profile.shared_host_slowdown, one_recompute * profile.shared_host_slowdown
    fb, recompute = one * accumulation, one_recompute * accumulation
    fwd, bwd = one * forward_share, one * (1 - forward_share) + one_recompute
    msgs = comms.step_messages(cfg, chips, layer_norm_fp32=layer_norm_fp32, per_node=profile.chips_per_node)
    opt = optimizer_time(cfg, chips, profile, layer_norm_fp32=layer_norm_fp32)
    comm_s, exposed = exposed_communication(msgs, chips, profile, fwd, bwd,
                                            gap_s=step_gap(fb + recompute + opt + max(overhead_s, 0.0), msgs),
                                            path_s=inherited(profile.collective_path_s, cfg.parallel.strategy))
    # A negative overhead (the anchor point ran faster than this model says) never takes the step below
    # its compute.
    overhead_s = max(overhead_s, -(exposed + opt))
    waiting = straggler_s(profile, chips, fb + recompute + opt)
    step = fb + recompute + exposed + opt + overhead_s + waiting
    ips = batch * accumulation / step
    tflops = vit_complexity(cfg.model).train_flops_per_image * ips / 1e12
    peak = peak or peak_flops(cfg, profile)
    mem = memory.memory(cfg, chips, profile, batch=batch, layer_norm_fp32=layer_norm_fp32)
    notes = list(compute.breakdown.notes) if compute.breakdown else []
    return Projection(chips, cfg.parallel.strategy, batch, fb + recompute, comm_s, exposed, opt, step, ips, tflops,
                      tflops * 1e12 / peak if peak else None, mem, len(msgs),
                      comms.bytes_moved_per_rank(msgs, chips), compute.source,
                      label=strategy_class(cfg.parallel.strategy).label(cfg), overhead_s=overhead_s, notes=notes,
                      recompute_s=recompute, straggler_s=waiting, hardware=profile.name,
                      compute_detail=compute.breakdown.describe() if compute.breakdown else "",
                      compute_shares=_shares(compute.breakdown))


def _shares(ct: Optional[roofline.ComputeTime]) -> dict[str, float]:
    if ct is None:
        return {}
    return {name: ct.total(kind) / ct.seconds for name, kind in
            (("matmul", "matmul"), ("attention", "attention"), ("memory-bound", "memory"))}


def project_grid(cfg: Config, chip_counts: list[int], variants: list[Config], profile: HardwareProfile,
                 compute: Optional[ComputeRate] = None, *, overheads: Optional[dict[str, float]] = None,
                 **kwargs) -> list[Projection]:
    """Every variant (strategy settings) at every chip count, with ratios to DDP and scaling efficiency.

    ``overheads``: each strategy's own per-step overhead, by strategy name, where it was measured.
    ``vs_ddp`` = per-chip TFLOPS / DDP's at the same count, where DDP fits; ``scaling_efficiency`` = per-chip
    images/s / the same variant's at the smallest count given (the sweep's conventions).
    """
    out = []
    for n in sorted(set(chip_counts)):
        for v in variants:
            extra = (overheads or {}).get(v.parallel.strategy, 0.0)
            out.append(project(v, n, profile, compute, overhead_s=extra, **kwargs))
    add_ratios(out)
    return out


def add_ratios(points: list[Projection]) -> None:
    """``vs_ddp`` against DDP at the same count (none where DDP does not fit: there is nothing to compare
    with), ``scaling_efficiency`` against the same variant at its smallest count."""
    ddp = {p.chips: p for p in points if p.strategy == BASELINE}
    smallest = {}
    for p in sorted(points, key=lambda p: p.chips):
        smallest.setdefault(p.label, p)
    for p in points:
        ref = ddp.get(p.chips)
        usable = ref is not None and ref.memory.fits is not False
        p.vs_ddp = p.tflops_per_chip / ref.tflops_per_chip if usable else None
        first = smallest[p.label]
        p.scaling_efficiency = p.images_per_sec_per_chip / first.images_per_sec_per_chip


__all__ = ["ComputeRate", "Projection", "project", "project_grid", "compute_from_peak", "compute_from_measured",
           "optimizer_time", "exposed_communication", "contention_s", "message_time", "group_link", "step_gap",
           "expected_max",
           "straggler_s", "recompute_fraction"]
