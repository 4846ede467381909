"""One report line per process, with the outcome of every patch.

``load_plugins()`` runs before SGLang configures logging in the scheduler process, so a line logged at load time
would be lost (INFO) or unformatted (WARNING). When logging is not configured yet the report is held and emitted
by a one-shot seam at the end of ``Scheduler.__init__`` (installed only when patches were applied, and removed by
``restore()``); problems are also logged immediately at WARNING so they are never lost.

Report files: only when ``SGLANG_DP_MTP_FIX_REPORT_DIR`` is set, one JSON file per process,
``sglang-dp-mtp-fix-<hostname>-<pid>.json``, in that directory and nowhere else. The directory must already exist and
must not itself be a symbolic link (its parents may be; the last component is opened with ``O_NOFOLLOW`` and the
file is created relative to that open directory). The file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and
mode 0644 (less under a stricter umask): an existing file or link of that name is never followed or overwritten.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import sys
from collections.abc import Sequence

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import REPORT_DIR_ENV, Config
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
        if any(o.status is Status.APPLIED for o in outcomes):  # a deferred patch stood down alone (core docstring)
            return f"sglang-dp-mtp-fix: {first.id} left stock (the other patches apply as reported): {first.reason}"
        return f"sglang-dp-mtp-fix: SGLang left stock: {first.id}: {first.reason}"
    return None


def logging_configured() -> bool:
    return bool(logging.getLogger().handlers)


def emit(outcomes: Sequence[Outcome], config: Config, level: int | None = None) -> None:
    """Log the report line (WARNING when there is a problem, unless the caller already logged it)."""
    if level is None:
        level = logging.WARNING if problem_line(outcomes, config) else logging.INFO
    logger.log(level, summary_line(outcomes, config))


class ReportFileError(OSError):
    """The report file could not be written (one warning in ``auto``; ``strict`` stops)."""


def report_file_name() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"  # a file name, whatever the hostname
    return f"sglang-dp-mtp-fix-{host}-{os.getpid()}.json"


def report_data(outcomes: Sequence[Outcome], config: Config) -> dict[str, object]:
    return {
        "plugin_version": __version__,
        "sglang_version": sglang_version(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "config": {
            "mode": config.mode.value,
            "skip": sorted(config.skip),
            "stats_every": config.stats_every,
            "peer_timeout_s": config.peer_timeout_s,
            "report_dir": config.report_dir,
            "error": config.error,
        },
        "patches": [o.as_dict() for o in outcomes],
        "summary": summary_line(outcomes, config),
    }


def write_report_file(outcomes: Sequence[Outcome], config: Config) -> str | None:
    """Write this process's report file; returns its path (None when no directory is configured).

    Raises ReportFileError naming the variable, the path and the reason; never writes outside the directory.
    """
    directory = config.report_dir
    if not directory:
        return None
    where = f"{REPORT_DIR_ENV}={directory}"
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise ReportFileError(f"{where}: {exc.strerror} (the plugin never creates the directory)") from exc
    if stat.S_ISLNK(st.st_mode):
        raise ReportFileError(f"{where} is a symbolic link; refusing to follow it (point the variable at the real one)")
    if not stat.S_ISDIR(st.st_mode):
        raise ReportFileError(f"{where} is not a directory")
    name = report_file_name()
    path = os.path.join(directory, name)
    payload = (json.dumps(report_data(outcomes, config), indent=1) + "\n").encode()
    try:
        # Open the directory itself without following a link swapped in since the lstat, then create relative to it.
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ReportFileError(f"{where}: cannot open the directory: {exc.strerror}") from exc
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except FileExistsError as exc:
            raise ReportFileError(
                f"{path} already exists (a file or link not written by this process); not touched"
            ) from exc
        except OSError as exc:
            raise ReportFileError(f"cannot create {path}: {exc.strerror}") from exc
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as exc:
            raise ReportFileError(f"cannot write {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return path
