"""GPU utilisation and power over the timed window, read through NVML on a thread beside training.

A :class:`Sampler` calls a reading function every ``interval_s`` on a daemon thread. Readings count only
while the window is *active*: the loop activates it just before each timed (post-warm-up) step and
deactivates it right after, outside the step's clock, so Ray reports, checkpoints and evaluations between
steps are left out and the step timing itself is untouched (NVML's calls release the GIL). The window's
figure is the mean of the readings that counted.

:func:`nvml_reader` is the reading function for one CUDA device (``nvidia-ml-py``): the device's
utilisation (percent of the last sample period, 1/6 s to 1 s by GPU, in which a kernel ran) and its power
draw in watts (the board's own average over about 1 s on Ampere and newer). It returns None on CPU,
without ``nvidia-ml-py``, when NVML does not start or does not know the device, and when the device
supports neither reading (e.g. a MIG slice): the figures are then absent, never zeros.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Callable, Mapping, Optional, Sequence

import torch

Reading = Mapping[str, float]

# What nvml_reader's readings hold (only the keys the device supports).
UTILIZATION = "gpu_utilization_pct"
POWER = "gpu_power_w"


def mean_readings(readings: Sequence[Reading]) -> dict[str, float]:
    """The mean of each key over ``readings`` (non-finite values skipped), and ``samples``: their count.

    ``{}`` without readings: no figure rather than a made-up one.
    """
    if not readings:
        return {}
    means: dict[str, float] = {}
    for key in dict.fromkeys(k for r in readings for k in r):
        values = [float(r[key]) for r in readings if key in r and math.isfinite(float(r[key]))]
        if values:
            means[key] = sum(values) / len(values)
    if means:
        means["samples"] = float(len(readings))
    return means


class Sampler:
    """Calls ``read()`` every ``interval_s`` on a daemon thread; readings count while :meth:`activate`-d.

    ``read`` returns a mapping of figures or raises (a failed reading is skipped and counted in
    ``errors``). ``close`` runs once when the sampler stops (NVML shutdown).
    """

    def __init__(self, read: Callable[[], Reading], interval_s: float = 0.1,
                 close: Optional[Callable[[], None]] = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.read = read
        self.interval_s = interval_s
        self._close = close
        self.readings: list[Reading] = []
        self.errors = 0
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[dict[str, float]] = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the sampling thread (once; readings count only while active)."""
        if self._thread is not None or self._stop.is_set():
            return
        self._thread = threading.Thread(target=self._run, name="rayvit-sampler", daemon=True)
        self._thread.start()

    def activate(self) -> None:
        self._active.set()

    def deactivate(self) -> None:
        self._active.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._active.is_set():
                self.sample()

    def sample(self) -> None:
        """Take one reading now (the thread's tick; callable directly in tests)."""
        try:
            reading = dict(self.read())
        except Exception:  # noqa: BLE001 - one failed reading must never break training
            self.errors += 1
            return
        self.readings.append(reading)

    def stop(self) -> dict[str, float]:
        """Stop the thread and return :func:`mean_readings` of what counted (idempotent)."""
        if self._result is None:
            self._active.clear()
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=10 * self.interval_s + 5)
            if self._close is not None:
                try:
                    self._close()
                except Exception:  # noqa: BLE001 - shutting NVML down is best effort
                    pass
            self._result = mean_readings(self.readings)
        return dict(self._result)


# --------------------------------------------------------------------------------------------------
# NVML


def nvml_candidates(index: int, uuid: Optional[str] = None, pci_bus_id: Optional[str] = None,
                    visible_devices: Optional[str] = None) -> list[tuple[str, object]]:
    """Ways to find torch's CUDA device ``index`` in NVML, most reliable first: ``[(how, key), ...]``.

    NVML numbers every GPU of the machine in PCI order and ignores ``CUDA_VISIBLE_DEVICES`` (Ray Train
    sets it per worker, so each worker's device is its index 0). The device's UUID and PCI bus id name it
    unambiguously; the ``CUDA_VISIBLE_DEVICES`` entry (an NVML index or a UUID) comes last, and a bare
    index (only with ``CUDA_VISIBLE_DEVICES`` unset) assumes CUDA orders devices as NVML does.
    """
    out: list[tuple[str, object]] = []
    if uuid:
        uuid = str(uuid)
        if uuid.startswith(("GPU-", "MIG-")):
            out.append(("uuid", uuid))
        else:
            out += [("uuid", f"GPU-{uuid}"), ("uuid", f"MIG-{uuid}")]
    if pci_bus_id:
        out.append(("pci", pci_bus_id))
    if visible_devices is None:
        out.append(("index", index))
    else:
        entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
        if 0 <= index < len(entries):
            entry = entries[index]
            if entry.isdigit():
                out.append(("index", int(entry)))
            elif entry.startswith(("GPU-", "MIG-")):
                out.append(("uuid", entry))
    return list(dict.fromkeys(out))


def _device_identity(device: torch.device) -> tuple[int, Optional[str], Optional[str]]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    pci = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        # NVML's "domain:bus:device.function" in hex.
        pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return index, (str(uuid) if uuid is not None else None), pci


def nvml_reader(device: torch.device) -> Optional[tuple[Callable[[], Reading], Callable[[], None]]]:
    """``(read, close)`` for ``device``'s utilisation and power through NVML, or None where unavailable."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / library: no readings
        return None
    try:
        index, uuid, pci = _device_identity(device)
        handle = None
        lookups = {"uuid": pynvml.nvmlDeviceGetHandleByUUID, "pci": pynvml.nvmlDeviceGetHandleByPciBusId,
                   "index": pynvml.nvmlDeviceGetHandleByIndex}
        for how, key in nvml_candidates(index, uuid, pci, os.environ.get("CUDA_VISIBLE_DEVICES")):
            try:
                handle = lookups[how](key)
                break
            except Exception:  # noqa: BLE001 - try the next way
                continue
        if handle is None:
            raise LookupError("device not found in NVML")

        readers: dict[str, Callable[[], float]] = {
            UTILIZATION: lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            POWER: lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,   # milliwatts
        }
        supported = {}
        for key, fn in readers.items():
            try:
                fn()
                supported[key] = fn
            except Exception:  # noqa: BLE001 - e.g. NVML_ERROR_NOT_SUPPORTED on a MIG slice
                continue
        if not supported:
            raise LookupError("the device supports neither utilisation nor power readings")
    except Exception:  # noqa: BLE001
        pynvml.nvmlShutdown()
        return None

    def read() -> dict[str, float]:
        return {key: fn() for key, fn in supported.items()}

    return read, pynvml.nvmlShutdown


def nvml_sampler(device: torch.device, interval_s: float = 0.1) -> Optional[Sampler]:
    """A :class:`Sampler` of ``device``'s NVML readings, or None where there are none (CPU, no NVML)."""
    reader = nvml_reader(device)
    if reader is None:
        return None
    read, close = reader
    return Sampler(read, interval_s, close=close)
