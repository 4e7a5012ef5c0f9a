"""A cluster the user describes: a YAML file naming a shipped profile and what differs on their cluster.

Usable wherever a hardware profile's name is (``rayvit project --hardware my_cluster.yaml``, ``rayvit plan``,
``sweep.hardware`` for the in-sweep projection)::

    base: h100-sxm              # a shipped profile: the chip, its memory bandwidth, NVLink, the roofline's figures
    name: my-h100s              # how tables name it (default: the file's name)
    gpus_per_node: 4
    network_gbps: 800           # per node, every NIC together, line rate
    cpus_per_node: 64
    cpus_are_vcpus: true        # hyperthreads, as clouds count them (false: physical cores)
    memory_gib: 80              # per GPU
    price_per_gpu_hour: 2.49
    currency: USD

Everything not given is the base profile's. The network's line rate gets the shipped profiles' achievable
fraction (0.8, ``profiles.NET_EFFICIENCY``) and the base fabric's latency; the profile remembers which figures
came from the file (``HardwareProfile.described``) so that every header can say so. ``cluster/example_cluster.yaml``
is a documented example.
"""

from __future__ import annotations

import dataclasses
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from rayvit.errors import ConfigError

if TYPE_CHECKING:
    from rayvit.projection.hardware_profile import HardwareProfile

GB = 1e9

SUFFIXES = (".yaml", ".yml")
KEYS = {
    "base": "a shipped profile's name",
    "name": "how tables name this cluster",
    "description": "free text, shown in the header",
    "gpus_per_node": "GPUs per node (a whole number)",
    "network_gbps": "network per node, every NIC together, Gb/s line rate",
    "cpus_per_node": "CPUs per node",
    "cpus_are_vcpus": "true: cpus_per_node counts hyperthreads (vCPUs); false: physical cores",
    "memory_gib": "device memory per GPU, GiB",
    "price_per_gpu_hour": "what one GPU costs per hour",
    "currency": "the price's currency (default USD)",
}


def is_cluster_file(name: str) -> bool:
    """Whether ``--hardware`` was given a file (a path ending in .yaml / .yml) rather than a profile name."""
    return name.lower().endswith(SUFFIXES)


def _number(data: dict, key: str, where: str, *, whole: bool = False, above: float = 0.0) -> Any:
    value = data[key]
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value > above
    if ok and whole:
        ok = float(value).is_integer()
    if not ok:
        kind = "a whole number" if whole else "a number"
        raise ConfigError(f"{where}: {key}={value!r} must be {kind} above {above:g} ({KEYS[key]})")
    return int(value) if whole else float(value)


def _read(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise ConfigError(f"--hardware {path}: no such cluster file (a YAML file with base: a shipped profile "
                          f"and the keys that differ; example: cluster/example_cluster.yaml)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"cluster file {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path}: expected keys ({', '.join(KEYS)}), got {type(data).__name__}")
    return data


def _check_keys(data: dict, where: str, shipped: Mapping[str, HardwareProfile]) -> None:
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    base = data.get("base")
    if base is None:
        raise ConfigError(f"{where}: base is missing: name the shipped profile the cluster is built from "
                          f"({', '.join(shipped)})")
    if base not in shipped:
        raise ConfigError(f"{where}: base={base!r} is not a shipped profile; choose one of: {', '.join(shipped)}")
    if "cpus_per_node" in data and not isinstance(data.get("cpus_are_vcpus"), bool):
        raise ConfigError(f"{where}: cpus_per_node={data['cpus_per_node']!r} needs cpus_are_vcpus: true (hyperthreads, "
                          "as clouds count vCPUs) or false (physical cores)")
    if "cpus_are_vcpus" in data and "cpus_per_node" not in data:
        raise ConfigError(f"{where}: cpus_are_vcpus is given without cpus_per_node")
    for key in ("name", "description", "currency"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f"{where}: {key}={data[key]!r} must be text ({KEYS[key]})")


def load_cluster_file(path: str | Path, shipped: Mapping[str, HardwareProfile], net_efficiency: float
                      ) -> HardwareProfile:
    """The profile ``path`` describes: its ``base`` (one of ``shipped``) with the given figures in place, the
    network's line rate x ``net_efficiency``; ConfigError naming the file and the key for anything wrong.
    (``profiles.get_profile`` calls it with the shipped profiles.)"""
    path = Path(path)
    where = f"cluster file {path}"
    data = _read(path)
    _check_keys(data, where, shipped)
    base = shipped[data["base"]]
    changes: dict[str, Any] = {"name": data.get("name") or path.stem}
    given: list[str] = []
    if "gpus_per_node" in data:
        changes["chips_per_node"] = _number(data, "gpus_per_node", where, whole=True)
        given.append(f"{changes['chips_per_node']} GPUs per node")
    if "network_gbps" in data:
        gbps = _number(data, "network_gbps", where)
        changes["inter"] = dataclasses.replace(base.inter, busbw=gbps / 8 * GB * net_efficiency, hw="net",
                                               source=f"{gbps:g} Gb/s per node x {net_efficiency:g} ({path.name})")
        given.append(f"network {gbps:g} Gb/s per node")
    if "memory_gib" in data:
        changes["memory_gib"] = _number(data, "memory_gib", where, above=base.reserved_gib)
        given.append(f"{changes['memory_gib']:g} GiB per GPU")
    if "cpus_per_node" in data:
        changes["cpus_per_node"] = _number(data, "cpus_per_node", where)
        changes["cpus_are_vcpus"] = data["cpus_are_vcpus"]
        given.append(f"{changes['cpus_per_node']:g} {'vCPUs' if data['cpus_are_vcpus'] else 'cores'} per node")
    if "price_per_gpu_hour" in data:
        changes["price_per_chip_hour"] = _number(data, "price_per_gpu_hour", where)
        changes["currency"] = data.get("currency", "USD")
        given.append(f"{changes['price_per_chip_hour']:g} {changes['currency']} per GPU-hour")
    elif "currency" in data:
        raise ConfigError(f"{where}: currency is given without price_per_gpu_hour")
    about = data.get("description", "")
    changes["source"] = f"{about + '; ' if about else ''}{path.name}: {base.name} ({base.source})"
    changes["described"] = tuple(given)
    changes["described_by"] = f"{path} (base {base.name})"
    return base.replace(**changes)


def describe(profile: HardwareProfile) -> str:
    """The header's line for a described cluster: which figures came from its file, the rest from its base."""
    if not profile.described_by:
        return ""
    what = ", ".join(profile.described) or "nothing"
    return f"cluster file {profile.described_by}: {what}; everything else from the base profile"


__all__ = ["load_cluster_file", "is_cluster_file", "describe", "KEYS"]
