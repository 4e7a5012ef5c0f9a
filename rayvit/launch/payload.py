"""What the driver hands rayvit's Ray Train workers: a typed payload inside ``train_loop_config``.

Ray Train, and Ray Tune around it, see ``train_loop_config`` as a dict (Tune merges a ``param_space``'s
``train_loop_config`` into it), so a payload travels as one key, ``{"rayvit": {...}}``, whose value is a
plain dict: the payload's kind, the config as ``Config.to_dict()`` and the payload's fields. Each worker
function reads back the kind it serves (:mod:`rayvit.launch.entry`):

- :class:`RunPayload`: one run (``train_loop_per_worker``; ``loop_config(cfg)`` makes it);
- :class:`GroupPayload`: a group of configs measured on the same workers in interleaved rounds
  (``measure_group_per_worker``, :func:`rayvit.launch.torch_trainer.fit_group`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, TypeVar

from rayvit.errors import ConfigError

# The one key of a train_loop_config rayvit's workers read.
PAYLOAD_KEY = "rayvit"

P = TypeVar("P", bound="Payload")


@dataclass(frozen=True)
class Payload:
    """What every rayvit worker function takes. ``config``: the run's ``Config.to_dict()`` (the workers'
    count and resources are checked against it); ``progress``: called by every worker after every step
    (:mod:`rayvit.launch.progress`); ``links``: the collective microbenchmark's options (``{}`` for its
    defaults), measured after training on the same workers, else None."""

    KIND: ClassVar[str] = ""

    config: dict[str, Any]
    progress: Optional[Any] = None
    links: Optional[dict[str, Any]] = None

    def to_loop_config(self) -> dict[str, Any]:
        """The ``train_loop_config`` that carries this payload (its fields as they are: no copy)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {PAYLOAD_KEY: {"kind": self.KIND, **fields}}

    @classmethod
    def of(cls: type[P], loop_config: Any) -> P:
        """The payload a worker was handed, or a ``ConfigError`` saying how to make one."""
        value = loop_config.get(PAYLOAD_KEY) if isinstance(loop_config, dict) else None
        if not isinstance(value, dict) or value.get("kind") != cls.KIND:
            got = sorted(loop_config) if isinstance(loop_config, dict) else type(loop_config).__name__
            raise ConfigError(f"rayvit's worker function takes the train_loop_config that "
                              f"{_MAKERS[cls.KIND]} makes (a {cls.__name__}); got {got!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names - {"kind"})
        if unknown:
            raise ConfigError(f"unknown fields {unknown} in a {cls.__name__}; it has {sorted(names)}")
        return cls(**{k: v for k, v in value.items() if k != "kind"})


@dataclass(frozen=True)
class RunPayload(Payload):
    """One run. ``final_model``: its final checkpoint carries the trained model (else only the summary,
    and the state ``train.checkpoint_every`` writes)."""

    KIND: ClassVar[str] = "run"

    final_model: bool = True


@dataclass(frozen=True)
class GroupPayload(Payload):
    """Every config of ``group`` (``Config.to_dict()`` each, of one worker count and resources), trained once
    per round in ``rounds`` interleaved rounds (:func:`rayvit.worker.rounds.measure_rounds`)."""

    KIND: ClassVar[str] = "group"

    group: list[dict[str, Any]] = field(default_factory=list)
    rounds: int = 1


_MAKERS = {RunPayload.KIND: "rayvit.trainer.loop_config(cfg)",
           GroupPayload.KIND: "rayvit.launch.torch_trainer.fit_group's trainer"}
