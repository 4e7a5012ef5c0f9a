"""Can a node's CPUs feed its chips? The input pipeline's capacity against the projected compute rate.

Analytic (no torch). The input rate is measured, never assumed: ``rayvit bench-data`` times the training
transform (decode, random resized crop, flip, uint8 batch) over the user's own parquet files, on one
thread in a loop and, with ``--ray-cpus N``, through Ray Data's own read and decode tasks with N CPUs.
The projection takes the Ray Data figure per CPU where the file has one (what the pipeline's tasks
reach: reads, task starts and serialisation included), else the loop's (an upper bound). Per point:

- cores per chip needed = the point's images/s per chip / images/s per core;
- cores per chip free for decoding = (the node's vCPUs - chips per node x ``parallel.cpus_per_worker``,
  which Ray reserves for the training workers) / chips per node / threads per core: Ray counts vCPUs,
  and two hyperthreads of one core decode at about one core's rate, so a node's physical cores are what
  feeds its chips (:func:`node_cpus`; the second thread's gain, if any, is not counted);
- the input's rate per chip = free cores x images/s per core; the point is input-bound when that is
  below the compute rate, and ``epoch_time_imagenet_h`` is ImageNet-1K's 1,281,167 images at the slower
  of the two, with the bound named.

Measured runs say the same from the other side: a steady per-step ``data_wait_fraction`` whose interval
lies above :data:`INPUT_BOUND_FRACTION` marks a point as input-bound (:func:`measured_note`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from rayvit.formats import fmt, number
from rayvit.results import IMAGENET_TRAIN_IMAGES

# A point that waited for data longer than this share of its step time was input-bound.
INPUT_BOUND_FRACTION = 0.05

def node_cpus(profile: Any) -> tuple[Optional[float], float]:
    """The node's CPUs in Ray's count, and how many of them share one physical core: a profile's own
    (``cpus_per_node``, its vCPUs two hardware threads per core), on the cpu profile this machine's (its
    threads per core read from sysfs, as ``lscpu`` does); ``(None, 1.0)`` where the profile says nothing."""
    if profile.name == "cpu":
        import os

        return float(os.cpu_count() or 1), _host_threads_per_core()
    if profile.cpus_per_node is None:
        return None, 1.0
    return float(profile.cpus_per_node), 2.0 if profile.cpus_are_vcpus else 1.0


def _host_threads_per_core() -> float:
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            text = f.read().strip()
        return float(sum(int(b) - int(a) + 1 if "-" in part else 1
                         for part in text.split(",") for a, _, b in [part.partition("-")]))
    except (OSError, ValueError):
        return 1.0


@dataclass(frozen=True)
class InputRate:
    """The training pipeline's measured rate on one CPU core, and what it was measured on."""

    images_per_sec_per_core: float
    image_size: int
    source: str
    # Whether the rate is Ray Data's own tasks' (rayvit bench-data --ray-cpus), not a loop on one thread.
    through_ray_data: bool = False


@dataclass(frozen=True)
class InputVerdict:
    """One projected point seen from its input: can the node's CPUs keep up, and the epoch it allows."""

    compute_images_per_sec_per_chip: float
    cores_needed_per_chip: float
    cores_free_per_chip: float
    input_images_per_sec_per_chip: float
    chips: int

    @property
    def feeds(self) -> bool:
        return self.input_images_per_sec_per_chip >= self.compute_images_per_sec_per_chip

    @property
    def bound(self) -> str:
        return "compute" if self.feeds else "input"

    @property
    def epoch_time_imagenet_h(self) -> float:
        rate = min(self.compute_images_per_sec_per_chip, self.input_images_per_sec_per_chip) * self.chips
        return IMAGENET_TRAIN_IMAGES / rate / 3600 if rate > 0 else math.inf


def cores_free_per_chip(node_cpus: float, chips_per_node: int, cpus_per_worker: float,
                        threads_per_core: float = 1.0) -> float:
    """The physical cores per chip left to Ray Data's tasks once every chip's training worker has its own
    CPUs (``node_cpus`` and ``cpus_per_worker`` in Ray's count, vCPUs; ``threads_per_core`` of them per core)."""
    return max(0.0, (node_cpus - chips_per_node * cpus_per_worker) / chips_per_node / max(threads_per_core, 1.0))


def verdict(images_per_sec_per_chip: float, chips: int, rate: InputRate, free_per_chip: float) -> InputVerdict:
    return InputVerdict(images_per_sec_per_chip, images_per_sec_per_chip / rate.images_per_sec_per_core,
                        free_per_chip, free_per_chip * rate.images_per_sec_per_core, chips)


def load_rate(value: str, image_size: int) -> InputRate:
    """``--data-rate``: a number (images/s per core) or ``rayvit bench-data --json``'s file, whose image size
    must be the projected one (the crop's cost grows with it)."""
    try:
        return InputRate(float(value), image_size, "given on the command line")
    except ValueError:
        pass
    from rayvit.errors import ConfigError

    try:
        data = json.loads(Path(value).read_text())
        measured = data["train"]["images_per_sec_per_core"]
        size = int(data["image_size"])
        ray = max(data.get("ray_data") or [], key=lambda r: r["cpus"], default=None)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--data-rate {value}: not a number nor a `rayvit bench-data --json` file ({e})") from e
    if size != image_size:
        raise ConfigError(f"--data-rate {value} was measured at {size} px, but the projection is at {image_size} px: "
                          f"rerun rayvit bench-data with model.image_size={image_size}")
    where = data.get("cpu", "this CPU")
    if ray is not None:
        # What Ray Data's tasks reached with the most CPUs measured, per CPU (each a physical core there).
        return InputRate(float(ray["images_per_sec"]) / ray["cpus"], size,
                         f"{value}: Ray Data's read and decode tasks with {ray['cpus']} CPUs (rayvit bench-data "
                         f"--ray-cpus: {where})", through_ray_data=True)
    return InputRate(float(measured), size, f"{value}: a loop on one thread (rayvit bench-data: {where}); Ray Data's "
                     "tasks reach less (measure them with --ray-cpus)")


def input_table(points: Iterable[Any], rate: InputRate, node_cpus: Optional[float], chips_per_node: int,
                cpus_per_worker: float, threads_per_core: float = 1.0) -> str:
    """Per projected point (``chips``, ``label``, ``images_per_sec_per_chip``): cores needed and free per
    chip, whether the node feeds its chips, and the epoch time with its bound. ``node_cpus``: Ray's count
    (vCPUs), ``threads_per_core`` of them per physical core."""
    free = cores_free_per_chip(node_cpus, chips_per_node, cpus_per_worker, threads_per_core) if node_cpus else None
    cores = (f" ({node_cpus / threads_per_core:g} cores: {threads_per_core:g} vCPUs each)" if threads_per_core > 1
             else "")
    lines = [f"input: {rate.images_per_sec_per_core:.4g} images/s per core at {rate.image_size} px ({rate.source}); "
             + (f"{node_cpus:g} CPUs per node{cores}, {chips_per_node} chips, {cpus_per_worker:g} reserved per training "
                f"worker: {free:.3g} cores per chip decode" if free is not None else
                "the node's CPUs are unknown: --node-cpus N says whether it feeds its chips"),
             f"{'chips':>5}  {'strategy':<26} {'img/s/chip':>10} {'cores/chip needed':>17} {'feeds':>5}  "
             f"{'epoch h (bound)':<18}"]
    for p in points:
        v = verdict(p.images_per_sec_per_chip, p.chips, rate, free if free is not None else math.inf)
        feeds = "-" if free is None else ("yes" if v.feeds else "NO")
        epoch = f"{v.epoch_time_imagenet_h:.3g} ({v.bound})" if free is not None else "-"
        lines.append(f"{p.chips:>5}  {p.label:<26} {p.images_per_sec_per_chip:>10.4g} "
                     f"{v.cores_needed_per_chip:>17.3g} {feeds:>5}  {epoch:<18}")
    return "\n".join(lines)


def annotate(points: Iterable[Any], rate: InputRate, node_cpus: Optional[float], chips_per_node: int,
             cpus_per_worker: float, threads_per_core: float = 1.0) -> None:
    """Each point's input verdict in its ``extras`` (``rayvit project --json``): cores per chip needed and
    free, whether the node feeds its chips, the epoch time and its bound (None where the node's CPUs are
    unknown)."""
    free = cores_free_per_chip(node_cpus, chips_per_node, cpus_per_worker, threads_per_core) if node_cpus else None
    for p in points:
        v = verdict(p.images_per_sec_per_chip, p.chips, rate, free if free is not None else math.inf)
        p.extras.update({"input_images_per_sec_per_core": rate.images_per_sec_per_core,
                         "input_cores_needed_per_chip": v.cores_needed_per_chip,
                         "input_cores_free_per_chip": free,
                         "input_feeds": v.feeds if free is not None else None,
                         "epoch_time_imagenet_h": v.epoch_time_imagenet_h if free is not None else None,
                         "epoch_bound": v.bound if free is not None else None})


def input_bound(metrics: Mapping[str, Any]) -> bool:
    """Whether a measured point's steady per-step wait for data is beyond :data:`INPUT_BOUND_FRACTION` of its
    step time by its interval: the 95% interval's low end above the line (the median alone where a point
    has no interval). A wait inside the noise of a short or noisy window is no verdict; epoch starts are
    booked apart (``epoch_start_wait_fraction``) and are no verdict on the per-step input either."""
    wait = number(metrics.get("data_wait_fraction"))
    lo = number(metrics.get("data_wait_fraction_lo"))
    return wait is not None and (lo if lo is not None else wait) > INPUT_BOUND_FRACTION


def measured_note(metrics: Mapping[str, Any]) -> Optional[str]:
    """``input-bound: waited 12.0% (9.1%-15.2%) of its step time for data``, for an input-bound point (and
    what its epoch starts waited besides, when they did)."""
    if not input_bound(metrics):
        return None
    lo, hi = number(metrics.get("data_wait_fraction_lo")), number(metrics.get("data_wait_fraction_hi"))
    spread = f" ({fmt(lo, '.1%')}-{fmt(hi, '.1%')})" if lo is not None and hi is not None else ""
    starts = number(metrics.get("epoch_start_wait_fraction"))
    besides = (f"; epoch starts waited another {fmt(starts, '.1%')} ({fmt(metrics.get('epoch_start_wait_s'), '.2f')} s "
               "each)" if starts else "")
    return (f"input-bound: waited {fmt(metrics['data_wait_fraction'], '.1%')}{spread} of its step time for data "
            f"(the interval above {INPUT_BOUND_FRACTION:.0%}){besides}: its throughput and epoch time are the input's")
