"""One report line per process, with the outcome of every patch.

``load_plugins()`` runs before SGLang configures logging, in the scheduler processes and in the launcher (main)
process alike, so a line logged at load time would be lost (INFO) or unformatted (WARNING). When logging is not
configured yet the report is held by :class:`PendingLine` and emitted right after the first ``logging.basicConfig``
/ ``logging.config.dictConfig`` call that leaves the root logger with a handler and INFO enabled: that is SGLang's own
``configure_logger`` in every release 0.5.15-0.5.23 (so scheduler lines carry SGLang's rank prefix), whatever the
mode. The seam removes itself once it has fired and is removed by ``restore()``; where it cannot be installed the
line is logged at once. Problems are also logged immediately at WARNING so they are never lost.

Report files: only when ``SGLANG_DP_MTP_FIX_REPORT_DIR`` is set, one JSON file per process,
``sglang-dp-mtp-fix-<hostname>-<pid>-<token>.json`` (a random token per process), in that directory and nowhere
else. The directory must already exist and must not itself be a symbolic link (its parents may be; the last
component is opened with ``O_NOFOLLOW`` and the file is created relative to that open directory). The file is
created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0644 (less under a stricter umask): an existing file or link
of that name is never followed or overwritten.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import logging.config
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable, Sequence
from typing import Any

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import MODE_ENV, REPORT_DIR_ENV, Config, Mode, settings
from sglang_dp_mtp_fix.core import Outcome, Status
from sglang_dp_mtp_fix.errors import ReportFileError
from sglang_dp_mtp_fix.sglang_versions import sglang_version

logger = logging.getLogger("sglang_dp_mtp_fix")


def summary_line(outcomes: Sequence[Outcome], config: Config) -> str:
    parts = ", ".join(f"{o.id}={o.status.value}" for o in outcomes)
    verdict = f"{MODE_ENV}=off here, SGLang left fully stock: " if config.mode is Mode.OFF and not config.error else ""
    chosen = "".join(f"{name}={value}: " for name, value in settings(config).items())  # the ranks must agree on them
    return (
        f"sglang-dp-mtp-fix {__version__} on SGLang {sglang_version()} (mode={config.mode.value}): "
        f"{verdict}{chosen}{parts}"
    )


def problem_line(outcomes: Sequence[Outcome], config: Config) -> str | None:
    """The one clear line when an affected install stays stock, else None."""
    if config.error:
        return f"sglang-dp-mtp-fix: SGLang left stock: {config.error}"
    bad = [o for o in outcomes if o.status is Status.UNSUPPORTED]
    if bad:
        first = next((o for o in bad if not o.held_back_by_another), bad[0])  # the root cause
        if any(o.status is Status.APPLIED for o in outcomes):  # a deferred patch stood down alone (core docstring)
            return f"sglang-dp-mtp-fix: {first.id} left stock (the other patches apply as reported): {first.reason}"
        return f"sglang-dp-mtp-fix: SGLang left stock: {first.id}: {first.reason}"
    return None


def logging_configured() -> bool:
    """Logging is set up so that the report line (INFO) is shown: a root handler, and INFO enabled. (0.5.21+ runs a
    bare ``basicConfig`` for the Hub logger, root at WARNING, in some processes before the plugin loads.)"""
    return bool(logging.getLogger().handlers) and logger.isEnabledFor(logging.INFO)


def emit(outcomes: Sequence[Outcome], config: Config, level: int | None = None) -> None:
    """Log the report line (WARNING when there is a problem, unless the caller already logged it)."""
    if level is None:
        level = logging.WARNING if problem_line(outcomes, config) else logging.INFO
    logger.log(level, summary_line(outcomes, config))


class PendingLine:
    """The report line, held until SGLang configures logging (see the module doc); emitted at most once."""

    SEAMS = ((logging, "basicConfig"), (logging.config, "dictConfig"))

    def __init__(self, emit_line: Callable[[], None]):
        self._emit_line = emit_line
        self._done = False
        self._installed: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, wrapper)

    def install(self) -> bool:
        """Wrap the logging set-up calls; False when none could be wrapped (the caller then logs at once)."""
        for owner, name in self.SEAMS:
            original = getattr(owner, name, None)
            if not callable(original):
                continue
            wrapper = self._wrap(original)
            setattr(owner, name, wrapper)
            self._installed.append((owner, name, original, wrapper))
        return bool(self._installed)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def configure_logging(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            # Not on a set-up that would drop the line: 0.5.21+ calls a bare basicConfig (root at WARNING) for the
            # Hub logger before configure_logger; the line waits for the set-up that lets INFO through.
            if logging_configured():
                self.flush()
            return result

        configure_logging.__sglang_dp_mtp_fix_seam__ = "report line"  # type: ignore[attr-defined]
        return configure_logging

    def flush(self) -> None:
        """Emit the line now (once) and take the seam out."""
        if self._done:
            return
        self._done = True
        self.remove()
        try:
            self._emit_line()
        except Exception:  # noqa: BLE001 - a report line must never break the host's logging set-up
            pass

    def remove(self) -> None:
        """Put the logging functions back (only where ours is still the live one: another wrapper stays intact)."""
        for owner, name, original, wrapper in reversed(self._installed):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)
        self._installed.clear()


# A restarted container reuses PIDs: with the PID alone the new process's file would be the old one's name (refused:
# never overwritten). A token per process start (the flight recorder's names do the same).
_TOKEN = secrets.token_hex(4)


def report_file_name() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"  # a file name, whatever the hostname
    return f"sglang-dp-mtp-fix-{host}-{os.getpid()}-{_TOKEN}.json"


def _new_token_after_fork() -> None:
    global _TOKEN
    _TOKEN = secrets.token_hex(4)


os.register_at_fork(after_in_child=_new_token_after_fork)


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
            "export_metrics": config.export_metrics,
            "peer_timeout_s": config.peer_timeout_s,
            "report_dir": config.report_dir,
            "recorder_dir": config.recorder_dir,
            "arrival_seed": config.arrival_seed.value,
            "unknown_variables": [name for name, _ in config.unknown],
            "error": config.error,
        },
        "patches": [o.as_dict() for o in outcomes],
        "summary": summary_line(outcomes, config),
    }


def naming(directory: str, env_name: str) -> str:
    """How a message names a directory: the path in use, quoted, never ``VAR=path`` (the value is stripped of
    surrounding spaces, so the path can differ from what was typed; ``doctor`` shows both)."""
    return f"{env_name} directory {directory!r}"


def check_directory(directory: str, env_name: str) -> None:
    """The directory rules (module doc): exists, a directory, not a symbolic link; raises ReportFileError."""
    where = naming(directory, env_name)
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise ReportFileError(f"{where}: {exc.strerror} (the plugin never creates the directory)") from exc
    if stat.S_ISLNK(st.st_mode):
        raise ReportFileError(f"{where} is a symbolic link; refusing to follow it (point the variable at the real one)")
    if not stat.S_ISDIR(st.st_mode):
        raise ReportFileError(f"{where} is not a directory")


# Below this, a directory's filesystem counts as full: a report file is a few KiB, a recorder ring about 1 MiB.
MIN_FREE_BYTES = 4 << 20


def space_problem(directory: str, env_name: str) -> str | None:
    """A full filesystem: fewer than MIN_FREE_BYTES or no inode left for this user (root also gets the reserved
    blocks). The launch's first write there would fail; nothing else tells ``doctor`` so before it."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None  # unreadable: the create check speaks for it
    root = os.geteuid() == 0
    free = (fs.f_bfree if root else fs.f_bavail) * fs.f_frsize
    inodes = fs.f_ffree if root else fs.f_favail
    if free < MIN_FREE_BYTES or (fs.f_files > 0 and inodes == 0):  # f_files 0: no inode limit (btrfs)
        left = f"{free} bytes" if free < MIN_FREE_BYTES else "no inode"
        return (
            f"{naming(directory, env_name)}: its filesystem is full ({left} free to this user); nothing can be written "
            "there"
        )
    return None


def directory_problem(directory: str, env_name: str) -> str | None:
    """What ``create_in_directory`` would refuse, checked without creating anything (``doctor``): the directory
    rules, whether this user can create a file there, and whether its filesystem has room."""
    try:
        check_directory(directory, env_name)
    except ReportFileError as exc:
        return str(exc)
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"{naming(directory, env_name)}: this user cannot create a file there (permissions, or a read-only "
            "filesystem)"
        )
    return space_problem(directory, env_name)


def create_in_directory(directory: str, env_name: str, name: str, flags: int = os.O_WRONLY) -> tuple[int, str]:
    """Create ``name`` in ``directory`` under the report-file rules (module doc): the directory must exist and not be
    a symbolic link, the file must not exist (never followed, never overwritten). Returns (fd, path); raises
    ReportFileError naming the variable, the path and the reason. Shared with the flight recorder."""
    where = naming(directory, env_name)
    check_directory(directory, env_name)
    path = os.path.join(directory, name)
    try:
        # Open the directory itself without following a link swapped in since the lstat, then create relative to it.
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ReportFileError(f"{where}: cannot open the directory: {exc.strerror}") from exc
    try:
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        except FileExistsError as exc:
            raise ReportFileError(
                f"{path} already exists (a file or link not written by this process); not touched"
            ) from exc
        except OSError as exc:
            raise ReportFileError(f"cannot create {path}: {exc.strerror}") from exc
    finally:
        os.close(dir_fd)
    return fd, path


def write_report_file(outcomes: Sequence[Outcome], config: Config) -> str | None:
    """Write this process's report file; returns its path (None when no directory is configured).

    Raises ReportFileError naming the variable, the path and the reason; never writes outside the directory.
    """
    directory = config.report_dir
    if not directory:
        return None
    payload = (json.dumps(report_data(outcomes, config), indent=1) + "\n").encode()
    fd, path = create_in_directory(directory, REPORT_DIR_ENV, report_file_name())
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        with contextlib.suppress(OSError):  # a half-written report (a full disk) is no report: not left behind
            os.unlink(path)
        raise ReportFileError(f"cannot write {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return path
