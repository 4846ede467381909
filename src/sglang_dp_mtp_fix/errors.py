"""The exceptions a user of the plugin can see, in one place.

Each docstring says who raises it and why it has its base class. Import them from here: the modules that raise them
no longer re-export them (``plugin.StrictModeAbort``, ``peers.PeerStateMismatch``, ... are gone). This module imports
nothing of the package, so every layer may import it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """``config`` refuses a value it will not guess at; a ValueError because the value, not the system, is wrong."""


class StrictModeAbort(SystemExit):
    """``plugin`` in strict mode when it cannot apply; a SystemExit so that SGLang's ``except Exception`` plugin
    loader and model registry cannot swallow it and the process stops."""


class StartupHazard(RuntimeError):
    """``plugin`` in strict mode at the end of ``Scheduler.__init__`` when the deployment is one the fix cannot keep
    rank-consistent; a RuntimeError raised there brings SGLang's launch down with the message."""


class PeerCheckError(RuntimeError):
    """``peers``: the cross-rank check could not run (raised in strict only; auto logs one warning); a RuntimeError
    like the store failures it wraps."""


class PeerStateMismatch(PeerCheckError):
    """``peers``: ranks of this launch run different patch states (start-up stops in any mode); a PeerCheckError
    because it is the check's own failure, and callers that catch the broader one still see it."""


class MixedDeploymentError(RuntimeError):
    """``draft_graph_vote`` in the MLP sync: some DP ranks of one sync group run without the plugin; a RuntimeError
    out of the scheduler's round stops now rather than hang in a later collective."""


class DraftRowsError(RuntimeError):
    """``draft_local_rows``: a draft output tensor has fewer rows than the rank's local draft tokens; a RuntimeError
    as upstream's own check (PR #32209) raises."""


class ReportFileError(OSError):
    """``report`` (and the flight recorder): a report file could not be written; an OSError because it is one (one
    warning in auto; strict stops)."""


class RecorderFileError(Exception):
    """``rollcall`` (``recorder``): a flight-recorder file it refuses (corrupt, truncated, foreign or of another
    format); a plain Exception the CLI turns into exit 2, never raised inside a serving process."""
