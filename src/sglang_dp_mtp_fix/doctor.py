"""``sglang-dp-mtp-fix doctor``: what ``load_plugins()`` would do in this environment, and what the launch checks.

It runs the plugin's own checks without a GPU and without starting SGLang (it imports the target modules, changes
nothing, creates no file) and reports: every variable with its value and what it means here, variables named like the
plugin's that it does not know (with the closest known name), the report and recorder directories under the rules the
launch applies to them, the entry point, and each patch's outcome. For a deferred patch (applied when its module is
imported, e.g. the DSA patches) it imports that module in the doctor's own process and reports what the post-import
hook would decide. Gathering (``doctor_report``), deciding (``decide``, over plain fields) and printing
(``doctor_lines``) are separate.

Exit codes: 0 fixed or not affected; 1 an affected install would not be patched; 2 a configuration error (a value
refused, an unknown variable, a directory the launch refuses or cannot write), whether the launch then stops (strict)
or goes on without what was asked for (auto); the verdict says which.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import (
    ARRIVAL_SEED_ENV,
    CONFIG_NAMES,
    METRICS_ENV,
    MODE_ENV,
    PEER_TIMEOUT_ENV,
    RECORDER_DIR_ENV,
    REPORT_DIR_ENV,
    SKIP_ENV,
    STALL_ENV,
    STATS_ENV,
    ArrivalSeed,
    Config,
    Mode,
    load_config,
    parse_metrics,
    parse_mode,
)
from sglang_dp_mtp_fix.errors import ConfigError
from sglang_dp_mtp_fix.sglang_versions import sglang_version

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "dp_mtp_fix"


def entry_point_selected(environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Would SGLang's ``load_plugins()`` run our entry point? (Same whitelist rule as SGLang.)"""
    env = os.environ if environ is None else environ
    installed = any(ep.name == ENTRY_POINT_NAME for ep in entry_points(group=ENTRY_POINT_GROUP))
    if not installed:
        return False, f"entry point {ENTRY_POINT_NAME!r} is not installed in group {ENTRY_POINT_GROUP}"
    allowed = env.get("SGLANG_PLUGINS", "")
    if not allowed:
        return True, "SGLANG_PLUGINS is unset or empty: SGLang loads every installed plugin"
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if ENTRY_POINT_NAME in names:
        return True, f"SGLANG_PLUGINS selects {ENTRY_POINT_NAME}"
    if not names:  # SGLang reads any non-empty value as a list: "," or " " is an empty one
        return False, f"SGLANG_PLUGINS={allowed!r} names no plugin, so SGLang loads none (unset it, or name this one)"
    return False, f"SGLANG_PLUGINS={allowed!r} does not include {ENTRY_POINT_NAME}"


def meanings(config: Config, env: Mapping[str, str]) -> dict[str, str]:
    """What each variable means here (the configuration as read; nothing where it could not be read)."""
    if config.error:
        return {}
    metrics_on = parse_metrics(env.get(METRICS_ENV))
    return {
        MODE_ENV: config.mode.value,
        SKIP_ENV: ", ".join(sorted(config.skip)) or "none skipped",
        STATS_ENV: f"vote counters logged every {config.stats_every} decode batches" if config.stats_every else "off",
        PEER_TIMEOUT_ENV: f"cross-rank check waits up to {config.peer_timeout_s:g} s",
        REPORT_DIR_ENV: config.report_dir or "no report files",
        RECORDER_DIR_ENV: config.recorder_dir or "no flight recorder",
        STALL_ENV: f"stall line after {config.stall_s:g} s" if config.stall_s else "off: no stall line",
        METRICS_ENV: "on when SGLang runs with --enable-metrics" if metrics_on else "off",
        ARRIVAL_SEED_ENV: ARRIVAL_SEED_MEANINGS[config.arrival_seed],
    }


ARRIVAL_SEED_MEANINGS = {
    ArrivalSeed.OFF: "off: seedless PD arrivals stay seedless (their draft step eager, the group with them)",
    ArrivalSeed.EXACT: "seedless PD arrivals whose prompt fits index_topk get their exact DSA seed",
    ArrivalSeed.RECENT: "seedless PD arrivals get their exact DSA seed, or the most recent index_topk positions",
}


@dataclass(frozen=True)
class DirectoryProblem:
    variable: str
    problem: str
    stops_strict: bool  # the launch checks this at load: strict stops on it
    effect: str  # what the launch does in auto


def directory_problems(config: Config, recording: bool) -> list[DirectoryProblem]:
    """The report and recorder directories under the launch's own checks (``recording``: a patch that records
    applies here, so the launch checks the recorder directory at load)."""
    from sglang_dp_mtp_fix import report
    from sglang_dp_mtp_fix.diagnosis import recorder

    found = []
    if config.report_dir:
        problem = report.directory_problem(config.report_dir, REPORT_DIR_ENV)
        if problem:
            found.append(DirectoryProblem(REPORT_DIR_ENV, problem, True, "no report files (one WARNING per process)"))
    if config.recorder_dir and recording:
        problem = recorder.check_directory(config.recorder_dir)  # the launch's own check, at load
        if problem:
            found.append(DirectoryProblem(RECORDER_DIR_ENV, problem, True, "no flight recorder (one WARNING)"))
        else:
            problem = report.directory_problem(config.recorder_dir, RECORDER_DIR_ENV)
            if problem:  # found at the first round's open: a WARNING there, never a stop
                effect = "no flight recorder (one WARNING per scheduler at its first round, in any mode)"
                found.append(DirectoryProblem(RECORDER_DIR_ENV, problem, False, effect))
    return found


@dataclass(frozen=True)
class Facts:
    """What the verdict is decided from: plain fields, no message text."""

    config_error: str | None
    strict: bool
    unknown: int  # unknown variables
    directories: tuple[DirectoryProblem, ...]
    fixed_or_clean: bool  # every fixing patch applied, superseded or not affected
    would_patch: bool  # a fixing patch would be applied
    selected: bool  # SGLang loads the plugin


def decide(f: Facts) -> tuple[int, str]:
    """(exit code, verdict)."""
    if f.config_error:
        then = "the launch stops (strict)" if f.strict else "SGLang is left stock at launch (auto)"
        return 2, f"configuration error: {then}; see CONFIG ERROR"
    stops = [d.variable for d in f.directories if d.stops_strict and f.strict]
    if stops:
        return 2, f"the launch stops (strict): {', '.join(stops)} is refused (see DIRECTORY)"
    code = 0 if f.fixed_or_clean and (f.selected or not f.would_patch) else 1
    if code == 0 and f.would_patch:
        verdict = "affected release; the fix will be applied when SGLang loads plugins"
    elif code == 0:
        verdict = "nothing to do: this SGLang is not affected or already contains the fix"
    elif f.would_patch and not f.selected:
        verdict = "affected release, but SGLang will not load this plugin (see entry_point_reason)"
    else:
        verdict = "affected release, but the fix would NOT be applied (see the patch reasons)"
    if f.unknown:
        code, verdict = 2, f"{verdict}; configuration error: {f.unknown} unknown variable(s), ignored (see UNKNOWN)"
    for d in f.directories:
        code, verdict = 2, f"{verdict}; configuration error: {d.variable}: the launch goes on with {d.effect}"
    return code, verdict


def doctor_report(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], int]:
    from sglang_dp_mtp_fix.core import Status, plan
    from sglang_dp_mtp_fix.patches import PATCH_IDS, all_patches
    from sglang_dp_mtp_fix.plugin import WATCHED_BY

    env = os.environ if environ is None else environ
    config = load_config(PATCH_IDS, env)
    outcomes = plan(all_patches(), config).check_deferred_all().outcomes  # checks only: nothing is changed
    selected, why = entry_point_selected(env)
    meaning = meanings(config, env)
    recording = any(o.id in WATCHED_BY and o.status is Status.APPLIED for o in outcomes)
    directories = directory_problems(config, recording) if not config.error else []
    data: dict[str, Any] = {
        "sglang_version": sglang_version(),
        "plugin_version": __version__,
        "mode": config.mode.value if _mode_read(env) else None,
        "skip": sorted(config.skip),
        "peer_timeout_s": config.peer_timeout_s,
        "report_dir": config.report_dir,
        "recorder_dir": config.recorder_dir,
        "stall_s": config.stall_s,
        "stats_every": config.stats_every,
        "arrival_seed": config.arrival_seed.value,
        "variables": [{"name": n, "value": env.get(n), "meaning": meaning.get(n)} for n in CONFIG_NAMES],
        "unknown_variables": [{"name": n, "value": env.get(n), "closest": c} for n, c in config.unknown],
        "directories": [d.__dict__ for d in directories],
        "config_error": config.error,
        "entry_point_selected": selected,
        "entry_point_reason": why,
        "patches": [o.as_dict() for o in outcomes],
    }
    # The verdict is about the patches that fix; a diagnostic one (upstream_vote_watch) changes no decision.
    fixing = {p.id for p in all_patches() if p.fixes}
    statuses = {o.status for o in outcomes if o.id in fixing}
    if Status.DISABLED in statuses and not config.error:
        # Disabled by the operator: is this install affected at all? (A not-affected or already fixed SGLang is fine
        # whatever the switches say.)
        underlying = plan(all_patches(), Config(mode=Mode.AUTO)).check_deferred_all().outcomes
        data["without_switches"] = [o.as_dict() for o in underlying]
        fixing_underlying = {o.status for o in underlying if o.id in fixing}
        if fixing_underlying <= {Status.SUPERSEDED, Status.NOT_AFFECTED}:
            statuses = fixing_underlying
    facts = Facts(
        config.error, config.strict, len(config.unknown), tuple(directories),
        statuses <= {Status.APPLIED, Status.SUPERSEDED, Status.NOT_AFFECTED}, Status.APPLIED in statuses, selected,
    )  # fmt: skip
    code, data["verdict"] = decide(facts)
    settings = {p.id: p.setting for p in all_patches() if p.setting}
    applied = [o.id for o in outcomes if o.id not in fixing and o.status is Status.APPLIED]
    watching = [pid for pid in applied if pid not in settings]
    if code == 0 and watching and selected:
        data["verdict"] += f"; the hang diagnosis ({', '.join(watching)}) will be applied when SGLang loads plugins"
    opted = [
        f"{pid} ({settings[pid]}={env.get(settings[pid], '').strip().lower()})" for pid in applied if pid in settings
    ]
    if code == 0 and opted and selected:
        data["verdict"] += f"; {', '.join(opted)} will be applied when SGLang loads plugins"
    return data, code


def _mode_read(env: Mapping[str, str]) -> bool:
    try:
        parse_mode(env.get(MODE_ENV))
    except ConfigError:
        return False
    return True


def doctor_lines(data: dict[str, Any]) -> list[str]:
    """The text report, one entry a line (the caller escapes them)."""
    lines = [f"sglang-dp-mtp-fix {data['plugin_version']} doctor", f"  SGLang:       {data['sglang_version']}"]
    lines.append(f"  mode:         {data['mode'] or 'not read (CONFIG ERROR below)'}")
    width = max(len(v["name"]) for v in data["variables"])
    for v in data["variables"]:
        value = "unset" if v["value"] is None else repr(v["value"])
        meaning = f" -> {v['meaning']}" if v["meaning"] else ""
        lines.append(f"  {v['name']:<{width}}  {value}{meaning}")
    for u in data["unknown_variables"]:
        close = f"did you mean {u['closest']}?" if u["closest"] else "no such variable"
        lines.append(f"  UNKNOWN:      {u['name']}={u['value']!r} is ignored ({close})")
    for d in data["directories"]:
        lines.append(f"  DIRECTORY:    {d['problem']}")
    if data["config_error"]:
        lines.append(f"  CONFIG ERROR: {data['config_error']}")
    selected = "selected" if data["entry_point_selected"] else "NOT selected"
    lines.append(f"  entry point:  {selected} - {data['entry_point_reason']}")
    if data["config_error"]:
        lines.append("  patches:      none applied (bad configuration, above)")
    else:
        width = max(len(p["id"]) for p in data["patches"])
        for p in data["patches"]:
            lines.append(f"  {p['id']:<{width}}  {p['status']:<13} {p['reason']}")
    lines.append(f"  verdict:      {data['verdict']}")
    return lines
