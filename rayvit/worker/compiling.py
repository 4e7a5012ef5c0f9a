"""Compile times that mean the same in every run: each compiled run compiles from empty caches.

torch.compile keeps what it compiled at several levels, and a later compile in the same process or on
the same node reuses it: dynamo's graphs, per code object (a second model whose guards match runs the
first's graphs without compiling anything: in one worker group the second compiled strategy took a
fraction of the first's compile time, and every later round almost none), Inductor's in-memory module
caches, and its on-disk FX-graph, AOTAutograd, Triton and automatic-dynamic caches (on by default, in one
directory per user, so later groups and sweeps on a node would find them warm), and remote caches where
a user configured them. On top of that, a process's first compile sets the process up (imports, compiler
and CPU-feature detection, compile workers, Triton), which whichever compiled run came first would pay.

:class:`CompileScope` gives one run all of them empty (``model.compile_cold``, the default; the run's
condition ``compile_cold`` says which) and takes nothing from the process that outlives it: what it, or
torch while compiling, sets in the environment or torch's settings is put back.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Iterator, Optional

import torch

from rayvit.config_schema import ModelConfig

# torch sets TORCHINDUCTOR_CACHE_DIR in os.environ when dynamo is first imported or Inductor first asks
# for its cache directory; fresh_cache sets both while it lasts.
_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# (backend, device type) pairs this process has been set up for (see _set_up).
_set_up_for: set[tuple[str, str]] = set()


class CompileScope:
    """The caches one run compiles with, under ``model.compile``; nothing otherwise.

    Made before the model is compiled (it notes the environment as the caller left it), entered when the
    run is built and before anything compiles (compiling is lazy: the first forward compiles), closed
    with the run: dynamo is reset then, dropping what it compiled (and graphs compiled earlier in this
    process, which only costs their recompilation), and the environment is put back.
    """

    def __init__(self, model: ModelConfig, device: torch.device) -> None:
        self.model, self.device = model, device
        self._env = {k: os.environ.get(k) for k in _CACHE_ENV} if model.compile else {}
        self._stack = contextlib.ExitStack()

    def enter(self) -> None:
        if self.model.compile:
            self._stack.enter_context(compile_caches(self.model.compile_cold, self.model.compile_backend, self.device))

    def close(self) -> None:
        self._stack.close()
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def compile_caches(cold: bool, backend: str = "inductor", device: Optional[torch.device] = None) -> Iterator[None]:
    """While inside, what compiles does so from empty caches (``cold``), or from the caches on disk as
    torch is configured to; dynamo is reset when it ends either way.

    ``cold``: the process is set up first (:func:`_set_up`), then dynamo is reset; Inductor's caches live
    in a temporary directory of their own, removed at exit (``torch._inductor.utils.fresh_cache``:
    ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` set, then restored; in-memory caches cleared),
    and remote caches are off.
    """
    import torch._dynamo

    if cold:
        _set_up(backend, device or torch.device("cpu"))
        torch._dynamo.reset()
    try:
        with _empty_caches() if cold else contextlib.nullcontext():
            yield
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def _empty_caches() -> Iterator[None]:
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), \
            inductor_config.patch(fx_graph_remote_cache=False, autotune_remote_cache=False,
                                  bundled_autotune_remote_cache=False), \
            functorch_config.patch(enable_remote_autograd_cache=False), \
            dynamo_config.patch(automatic_dynamic_remote_pgo=False):
        yield


def _set_up(backend: str, device: torch.device) -> None:
    """A product and its gradient through ``backend`` on ``device``, once per process: a process's first
    compile imports Inductor, detects the compiler and the CPU's vector instructions (compiling probes),
    starts compile workers and initialises Triton, most of a first compile's time on a small model
    (docs/worker_groups.md). In caches of its own, removed after."""
    if (backend, device.type) in _set_up_for:
        return
    with _empty_caches():
        x = torch.randn(8, 8, device=device, requires_grad=True)
        torch.compile(lambda t: torch.nn.functional.gelu(t @ t.t()).sum(), backend=backend)(x).backward()
    _set_up_for.add((backend, device.type))


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far (a counter it never resets)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_overhead_s(warmup_times: list[float], timed_times: list[float]) -> float:
    """The time warm-up steps took beyond a median timed step: what compiling cost under model.compile."""
    steady = statistics.median(timed_times)
    return sum(max(0.0, t - steady) for t in warmup_times)
