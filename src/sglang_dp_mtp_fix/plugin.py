"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``dp_mtp_fix``).

SGLang calls ``register()`` from ``load_plugins()`` in every process that runs the scheduler (and in the main
process). It reads the configuration once, applies the patch groups, writes the report file when configured, and
reports: exactly one report line per process, whatever the mode, through SGLang's logging once SGLang has configured
it (``report.PendingLine``). It never raises in ``auto``/``off`` mode; in ``strict`` mode a problem raises
:class:`StrictModeAbort`, a ``SystemExit`` that SGLang's loader (which catches ``Exception``) cannot swallow.

Where patches were applied, the end of the first ``Scheduler.__init__`` also runs the cross-rank patch-state check
(``peers``): ranks that differ raise ``PeerStateMismatch`` there in every mode, which stops SGLang's launch; a
check that passes says so in one line per rank.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from sglang_dp_mtp_fix import _version, peers, report, transport
from sglang_dp_mtp_fix.config import Config, load_config, settings, unknown_line
from sglang_dp_mtp_fix.core import Outcome, Patch, PatchManager, Status, groups
from sglang_dp_mtp_fix.diagnosis import metrics, monitor, recorder, stats, wiring
from sglang_dp_mtp_fix.errors import PeerCheckError, PeerStateMismatch, ReportFileError, StartupHazard, StrictModeAbort
from sglang_dp_mtp_fix.patches import _startup_checks, all_patches

_lock = threading.Lock()
_manager: PatchManager | None = None
last_config: Config | None = None
_report_path: str | None = None  # this process's report file, once written
_report_line: report.PendingLine | None = None  # the report line, until SGLang configures logging


def get_manager() -> PatchManager:
    global _manager
    with _lock:
        if _manager is None:
            _manager = PatchManager(all_patches())
        return _manager


def register() -> list[Outcome]:
    """Entry point. Idempotent per process."""
    global last_config, _report_line
    manager = get_manager()
    if manager.outcomes is not None and last_config is not None:
        return manager.outcomes
    config = load_config(manager.ids)
    last_config = config
    if config.unknown and not config.strict:  # strict: a configuration error, the problem line below
        report.logger.warning("sglang-dp-mtp-fix: %s", unknown_line(config.unknown))
    manager.on_deferred = functools.partial(_deferred_outcome, manager, config)
    wiring.configure(config)  # the diagnosis's settings, before the vote's wrappers are built from them
    outcomes = manager.apply(config)
    problem = report.problem_line(outcomes, config)
    # The flight recorder's directory is checked when the vote is built (at load), under the report files' rules.
    file_problem = _write_report_file(outcomes, config) or recorder.load_problem
    if config.strict and (problem or file_problem):
        manager.restore()
        raise StrictModeAbort(f"{problem or file_problem} [SGLANG_DP_MTP_FIX=strict: stopping]")
    if file_problem:
        report.logger.warning(file_problem)
    if problem:
        report.logger.warning(problem)  # the one WARNING line; the report line below then stays at INFO
    level = logging.INFO if problem else None
    _report_line = report.PendingLine(functools.partial(report.emit, outcomes, config, level=level))
    if report.logging_configured() or not _report_line.install():
        _report_line.flush()
    if manager.applied or manager.awaiting_import:  # only a process we patch touches Scheduler (else: nothing hooked)
        _after_scheduler_init(manager, outcomes, config, _report_line)
    return outcomes


def _deferred_outcome(manager: PatchManager, config: Config, patch: Patch, outcome: Outcome) -> None:
    """A deferred patch was checked when its module was imported (during SGLang's model import, or later). A problem
    is one WARNING line and that patch stays stock; in strict mode it stops the process: ``StrictModeAbort`` is a
    ``SystemExit``, which SGLang's model registry (``except Exception``) cannot swallow, so the scheduler process
    exits and the launch fails."""
    where = f"when {patch.deferred_until_import} was imported"
    if outcome.status is Status.UNSUPPORTED:
        line = f"sglang-dp-mtp-fix: {patch.id} left stock {where}: {outcome.reason}"
        if config.strict:
            manager.restore()
            raise StrictModeAbort(f"{line} [SGLANG_DP_MTP_FIX=strict: stopping]")
        report.logger.warning(line)
    else:
        report.logger.info("sglang-dp-mtp-fix: %s %s %s: %s", patch.id, outcome.status.value, where, outcome.reason)


def _write_report_file(outcomes: list[Outcome], config: Config) -> str | None:
    """Write the report file once per process (when configured); returns a problem line instead of raising."""
    global _report_path
    if _report_path is not None:
        return None
    try:
        _report_path = report.write_report_file(outcomes, config)
    except ReportFileError as exc:
        return f"sglang-dp-mtp-fix: report file not written: {exc}"
    except Exception as exc:  # noqa: BLE001 - diagnostics must never crash the host
        return f"sglang-dp-mtp-fix: report file not written: {exc!r}"
    return None


def restore() -> None:
    """Put SGLang back to stock (tests; operators use SGLANG_DP_MTP_FIX=off)."""
    global last_config, _report_path, _report_line
    get_manager().restore()
    wiring.stop()
    if _report_line is not None:
        _report_line.remove()
    last_config = None
    _report_path = None
    _report_line = None


def _after_scheduler_init(
    manager: PatchManager, outcomes: list[Outcome], config: Config, line: report.PendingLine
) -> None:
    """At the end of the first ``Scheduler.__init__`` (SGLang's distributed groups exist by then): run the cross-rank
    patch-state check (``peers``) exactly once. The report line is out by then (SGLang configures logging before it
    builds the Scheduler); should it still be held, it goes out first."""
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except Exception:  # noqa: BLE001 - no scheduler in this process: no groups to check
        return
    original = Scheduler.__dict__.get("__init__")
    if original is None:
        return
    first_init = [True]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if first_init:
            first_init.clear()
            line.flush()
            check_startup_hazards(self, config, manager)  # first: a group it leaves stock is what peers compare
            check_peers(manager, outcomes, config)
            transport.log_line(self, manager)  # before the scheduler's first MLP-sync round
            start_monitor(self, manager)
            counters = stats.active()
            if counters is not None:  # the eager draft steps' reason "graphs off" (stats)
                counters.graphs_off = bool(getattr(getattr(self, "server_args", None), "disable_cuda_graph", False))
            if config.export_metrics:
                export_metrics(self, manager)

    manager.install_seam(Scheduler, "__init__", __init__)


# The patches whose sync-entry wrapper counts the rounds the stall watcher reads: the plugin's vote, or the watch on
# SGLang's own (0.5.21+).
WATCHED_BY = ("draft_graph_vote", "upstream_vote_watch")


def start_monitor(scheduler: Any, manager: PatchManager) -> None:
    """The stall watcher (and, once the recorder's file opens, the heartbeat): one daemon thread per scheduler whose
    rounds are counted (``WATCHED_BY``, ``monitor``). Never raises."""
    if not any(o.id in WATCHED_BY and o.status is Status.APPLIED for o in manager.outcomes or []):
        return
    try:
        monitor.start(dp_rank=recorder.scheduler_dp_rank(scheduler), scheduler=scheduler)
    except Exception as exc:  # noqa: BLE001 - diagnostics must never crash the host
        report.logger.warning("sglang-dp-mtp-fix: stall watcher not started: %r", exc)


def check_peers(manager: PatchManager, outcomes: list[Outcome], config: Config) -> None:
    """Compare patch state with every rank of the launch (see ``peers``). A mismatch raises in every mode (an
    exception out of ``Scheduler.__init__`` brings SGLang's launch down with the message); a store that fails is one
    warning in ``auto`` and an error in ``strict``."""
    try:
        agreed = peers.check(outcomes, manager.peer_fingerprints(), config.peer_timeout_s, settings(config))
    except PeerStateMismatch:
        raise
    except PeerCheckError as exc:
        if config.strict:
            raise PeerCheckError(f"{exc} [SGLANG_DP_MTP_FIX=strict: stopping]") from exc
        report.logger.warning("%s; start-up continues (auto mode)", exc)
        return
    if agreed is not None:
        rank, world = agreed
        applied = sum(o.status is Status.APPLIED for o in outcomes)
        report.logger.info(
            "sglang-dp-mtp-fix: cross-rank patch-state check passed on rank %d: %d ranks agree "
            "(plugin %s, %d of %d patches applied, %d fingerprints)",
            rank,
            world,
            _version.__version__,
            applied,
            len(outcomes),
            len(manager.peer_fingerprints()),
        )


def export_metrics(scheduler: Any, manager: PatchManager) -> None:
    """SGLang runs with --enable-metrics: the vote counters go to its /metrics from this scheduler (``metrics``),
    with each patch's status as it stands after model load (deferred patches included). Never raises."""
    try:
        result = metrics.install(scheduler, manager.outcomes or [], _version.__version__)
    except Exception as exc:  # noqa: BLE001 - an exporter must never crash the host
        result = metrics.MetricsExport(False, f"sglang-dp-mtp-fix: vote counters not exported to /metrics: {exc!r}")
    if result is not None:
        report.logger.log(logging.INFO if result.exported else logging.WARNING, result.line)
    try:
        result = metrics.install_liveness(scheduler, monitor.active())
    except Exception as exc:  # noqa: BLE001 - an exporter must never crash the host
        result = metrics.MetricsExport(False, f"sglang-dp-mtp-fix: liveness not exported to /metrics: {exc!r}")
    if result is not None:
        report.logger.log(logging.INFO if result.exported else logging.WARNING, result.line)


def check_startup_hazards(scheduler: Any, config: Config, manager: PatchManager | None = None) -> None:
    """Once per scheduler, at the end of its ``__init__`` (``_startup_checks``). A hazard is one WARNING line in
    ``auto`` and a stop in ``strict``. A refused configuration (one the draft-vote group cannot keep consistent and
    no seam can fix) also leaves that group stock on this scheduler in ``auto``: it runs before the cross-rank
    check, and decided from the server arguments every rank shares, so every rank of the launch stands down alike
    (a rank that differs is a mismatch the check then stops)."""
    manager = manager or get_manager()
    status = {o.id: o for o in manager.outcomes or []}
    for patch in manager.patches:
        if patch.id in status and status[patch.id].status is Status.APPLIED:
            try:
                patch.at_scheduler_start(scheduler)
            except Exception as exc:  # noqa: BLE001 - what the patch needs cannot be read: stock, never a crash
                why = f"sglang-dp-mtp-fix: {patch.id} cannot start on this scheduler: {exc}"
                _stand_down_group(manager, config, patch.id, why)
    vote = status.get("draft_graph_vote")
    if vote is not None and vote.status is Status.SUPERSEDED:
        return  # SGLang's own vote decides (0.5.21+, the watch alone applied): the vote group's hazards are not checked
    for hazard in _startup_checks.CHECKS:
        check, fixed_by = hazard.check, hazard.fixed_by
        fix = status.get(fixed_by or "")
        if fix is not None and fix.status is Status.APPLIED:
            continue  # the patch that removes this hazard runs on this scheduler
        try:
            line = check(scheduler)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never crash the host
            line = None
            report.logger.debug("sglang-dp-mtp-fix: start-up check %s failed: %r", check.__name__, exc)
        if line is None:
            continue
        if fix is not None:
            line += f" [{fix.id} is {fix.status.value}: {fix.reason}]"
        if hazard.stands_down_group_of:
            _stand_down_group(manager, config, hazard.stands_down_group_of, line)
        elif config.strict:
            raise StartupHazard(f"{line} [SGLANG_DP_MTP_FIX=strict: stopping]")
        else:
            report.logger.warning(line)


def _stand_down_group(manager: PatchManager, config: Config, patch_id: str, line: str) -> None:
    """strict: stop. auto: put ``patch_id``'s whole group back to stock on this scheduler, and say so in one line."""
    if config.strict:
        raise StartupHazard(f"{line} [SGLANG_DP_MTP_FIX=strict: stopping]")
    group = next((g for g in groups(manager.patches) if any(p.id == patch_id for p in g)), [])
    ids = [p.id for p in group if any(o.id == p.id and o.status is Status.APPLIED for o in manager.outcomes or [])]
    if ids:
        not_restored = manager.stand_down(ids, f"left stock at scheduler start: {line}")
        line += f"; left stock on this scheduler (auto; strict stops): {', '.join(ids)}"
        if not_restored:
            line += f" (not restored, another hook wraps them now: {', '.join(not_restored)})"
    report.logger.warning(line)
