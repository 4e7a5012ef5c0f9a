"""Every exception rayvit raises on purpose, in one place: what went wrong is named by the class, what to
do about it by the message.

Grouped by where they come from: the config (and what it asks of storage), the cluster, a run, the
records, a search. ``ConfigError`` is a ``ValueError`` and ``DivergedError`` a ``FloatingPointError``, so
callers that catch the builtin kinds keep working.
"""

from __future__ import annotations


# -- a config, and what it asks of storage and data -------------------------------------------------

class ConfigError(ValueError):
    """A config key, value or combination of values that rayvit cannot run."""


class StorageError(ConfigError):
    """``launch.storage`` is unusable, or a run needs shared storage and has none."""


class CorruptImageError(ValueError):
    """An image no decoder can read; the message names where it is (file, row) and why."""


# -- the cluster -----------------------------------------------------------------------------------

class ConnectError(RuntimeError):
    """Ray could not be reached or attached to; the message says what to check."""


class ClusterUnreachable(ConnectError):
    """Nothing at the address answers as a Ray cluster."""


class ClusterAuthError(ConnectError):
    """The cluster requires a token this process does not have (or has a different one)."""


class ClusterTooSmall(RuntimeError):
    """The request can never be placed on this cluster (or the autoscaler's maximum)."""


class ScaleUpTimeout(ClusterTooSmall):
    """The autoscaler did not bring up the nodes a run needs before ``launch.scale_up_timeout_s``."""


# -- a run -----------------------------------------------------------------------------------------

class TrainingError(RuntimeError):
    """A Ray Train run failed; the message holds the cause."""


class DivergedError(FloatingPointError):
    """The loss became NaN or infinite."""


class InjectedFault(RuntimeError):
    """Raised by ``train.fail_at_step`` to prove that a run survives a crashed worker."""


class GroupAbandoned(RuntimeError):
    """A run failed on this rank and some peers never reached the verdict (they wait for this rank in a
    collective): the worker group cannot go on, and ends."""


class GroupOutOfStep(GroupAbandoned):
    """Every rank reached the verdict on a run, but they had issued different numbers of collectives on a
    process group (a rank that ran ahead of its peers, then failed): the next run would pair collectives
    that do not match, so the worker group ends on every rank. ``verdict``: the run's agreed outcome (None:
    it finished on every rank; else the first failing rank's error)."""

    def __init__(self, message: str, verdict: "str | None") -> None:
        super().__init__(message)
        self.verdict = verdict


class CompareFailed(RuntimeError):
    """A config of a comparison failed in one of its rounds; the message holds its error."""


class NotCheckable(Exception):
    """A GPU check that cannot fail on this machine (e.g. one that needs a second GPU): reported N/A."""


# -- records and searches --------------------------------------------------------------------------

class TrackingError(RuntimeError):
    """The tracking store cannot be reached or used."""


class BaselineFailed(RuntimeError):
    """The baseline did not produce a validation accuracy, so the constraint cannot be applied."""


class SearchInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the search: its trials were stopped and no best config was written."""

    def __init__(self, message: str, signum: int = 2):      # 2: SIGINT
        super().__init__(message)
        self.message, self.signum = message, signum

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + int(self.signum)

    def __str__(self) -> str:
        return self.message
