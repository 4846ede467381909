"""One report line per process, with the outcome of every patch.

``load_plugins()`` runs before SGLang configures logging in the scheduler process, so a line logged at load time
would be lost (INFO) or unformatted (WARNING). When logging is not configured yet the report is held and emitted
by a one-shot seam at the end of ``Scheduler.__init__`` (installed only when patches were applied, and removed by
``restore()``); problems are also logged immediately at WARNING so they are never lost.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Outcome, Status

logger = logging.getLogger("sglang_dp_mtp_fix")


def sglang_version() -> str:
    try:
        loaded = sys.modules.get("sglang")
        if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
            return loaded.__version__  # cheap; importlib.metadata costs ~10 ms per call
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return "not installed"


def summary_line(outcomes: Sequence[Outcome], config: Config) -> str:
    parts = ", ".join(f"{o.id}={o.status.value}" for o in outcomes)
    return f"sglang-dp-mtp-fix {__version__} on SGLang {sglang_version()} (mode={config.mode.value}): {parts}"


def problem_line(outcomes: Sequence[Outcome], config: Config) -> str | None:
    """The one clear line when an affected install stays stock, else None."""
    if config.error:
        return f"sglang-dp-mtp-fix: SGLang left stock: {config.error}"
    bad = [o for o in outcomes if o.status is Status.UNSUPPORTED]
    if bad:
        first = next((o for o in bad if not o.reason.startswith("not applied:")), bad[0])
        return f"sglang-dp-mtp-fix: SGLang left stock: {first.id}: {first.reason}"
    return None


def logging_configured() -> bool:
    return bool(logging.getLogger().handlers)


def emit(outcomes: Sequence[Outcome], config: Config, level: int | None = None) -> None:
    """Log the report line (WARNING when there is a problem, unless the caller already logged it)."""
    if level is None:
        level = logging.WARNING if problem_line(outcomes, config) else logging.INFO
    logger.log(level, summary_line(outcomes, config))
