"""``sglang-dp-mtp-fix rollcall DIR [DIR ...]``: every rank's flight-recorder file read (``diagnosis.reader``) and
judged (``diagnosis.verdicts``: the first round where ranks decided differently, which ranks stopped); here, what the
command says about it: the answer's sentences, the lines printed, the JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from sglang_dp_mtp_fix.diagnosis import verdicts
from sglang_dp_mtp_fix.diagnosis.recfile import PATH_EAGER, PATH_GRAPH

SETTLE_S = verdicts.SETTLE_S
MAX_SETTLE_S = 600.0  # --settle's upper bound: a watch, not a wait for ever


def rollcall(targets: Sequence[str], settle_s: float = SETTLE_S) -> tuple[dict[str, Any], int]:
    """Read and judge every rank's file (``verdicts.decide``: the exit code's meaning), then say it: ``data`` gets
    its ``answer`` and each divergent group its ``decision``."""
    data, code, findings = verdicts.decide(targets, settle_s)
    divergence = data.get("divergence")
    if divergence is not None:
        show_votes = divergence.pop("votes_differ")
        divergence["groups"] = [_with_decision(g, show_votes) for g in divergence["groups"]]
    data["answer"] = "; ".join(_sentence(f) for f in findings)
    return data, code


def _with_decision(group: dict[str, Any], show_votes: bool) -> dict[str, Any]:
    facts = {k: v for k, v in group.items() if k not in ("ranks", "pending")}
    return {"ranks": group["ranks"], "decision": _describe(group, show_votes), **facts}


def _describe(group: dict[str, Any], show_votes: bool) -> str:
    """One group's decision in the first round that differs (its record's fields, ``reader.Record.as_dict``)."""
    generic, draft = group["decode_vote_group"], group["draft_vote_group"]
    path = None if group["pending"] else {"graph": PATH_GRAPH, "eager": PATH_EAGER}.get(group["draft_path"], 0)
    if path is None:
        text = "draft step not reached yet"
    elif path == PATH_GRAPH:
        bucket = group["bucket"]
        text = f"draft graph (bucket {bucket})" if bucket >= 0 else "draft graph"
    elif path == PATH_EAGER:
        if not draft:
            cause = "own seedless batch" if not group["draft_vote_sent"] else "another rank's vote"
        else:
            cause = "after a graph vote: decided outside the vote"
        text = f"eager ({cause})"
    else:
        text = "no draft step"
    if show_votes:
        text += f"; decode vote {'graph' if generic else 'eager'}, draft vote {'graph' if draft else 'eager'}"
    return text


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {list(ranks)}"


def _sentence(f: dict[str, Any]) -> str:
    """One finding of ``verdicts.decide`` as the answer says it."""
    kind = f["kind"]
    if kind in _SIMPLE:
        return _SIMPLE[kind](f)
    if kind == "no_file":
        return "no readable flight-recorder file" + (" (see refused)" if f["refused"] else "")
    if kind == "incompatible":
        return "files from different deployments (dp size, tp size): " + ", ".join(map(str, f["shapes"]))
    if kind == "diverge":
        d = f["divergence"]
        return f"round {d['round']}: " + ", ".join(f"{_ranks_text(p['ranks'])} {p['decision']}" for p in d["groups"])
    if kind == "missing":
        return (
            f"{f['rank_kind']} {_ranks_text(f['ranks'])} of {f['size']} no file: the plugin or its recorder is not "
            "active there (SGLANG_DP_MTP_FIX=off, not installed, the variable unset), or that node's directory was "
            "not copied here"
        )
    if kind == "implausible":
        return (
            f"{_ranks_text(f['ranks'])}: fields that cannot be true (see implausible), not used: the answer may be "
            "incomplete"
        )
    if kind == "refused":
        return f"{f['count']} file(s) refused (see above): the answer may be incomplete"
    raise ValueError(f"no sentence for the finding {kind!r}")


def _stopped_sentence(f: dict[str, Any]) -> str:
    since = f["since"]
    when = time.strftime("%H:%M:%S", time.gmtime(since)) + " UTC" if since else "(no time recorded)"
    what = {
        "stopped": f"frozen (pid {f['pid']} is stopped: SIGSTOP or a debugger)",
        "dead": f"dead (pid {f['pid']} is gone)",
        "running": f"frozen (pid {f['pid']} runs, but its heartbeat thread stopped)",
        "unknown": "its heartbeat stopped (another host or boot: whether frozen or dead is told on its node)",
    }[f["process"]]
    beat = "heartbeat" if f["heartbeat"] else "no heartbeat since the file opened at"
    if f["stale_by"] == "counter":
        behind = "no tick while the others ticked"
    elif f["heartbeat_behind_s"] is not None:
        behind = f"{f['heartbeat_behind_s']:.0f} s before the freshest"
    else:
        behind = "no time recorded"
    return (
        f"{f['rank_kind']} rank {f['rank']} stopped: {what}; {beat} {when}, {behind}; last entered round "
        f"{f['entered']}, last recorded {f['last_round']} (host {f['host']})"
    )


def _agreement_sentence(f: dict[str, Any]) -> str:
    n, agreed, top = f["ranks"], f["agreed"], f["top"]
    if "never_reached" in f:
        behind = f["never_reached"]
        text = f"all {n} ranks agreed up to round {agreed}; {_ranks_text(behind)} never reached round {top}"
        lag = f["lag_s"]
        if lag is None:
            return text
        said = f"{lag:.1f} s" if lag >= 0.1 else f"{1000 * lag:.0f} ms"  # in-phase heartbeats lag by tens of ms
        whose = "its file was written out" if len(behind) == 1 else "their files were written out up to"
        return text + f" ({whose} {said} before the newest)"
    if agreed == 0:
        return f"no round recorded yet on any of the {n} ranks with a file"
    if "entered_without_record" in f:
        return (
            f"all {n} ranks agreed up to round {agreed}; {_ranks_text(f['entered_without_record'])} entered round "
            f"{top} without a record of it (no batch there, or still inside it)"
        )
    return f"all {n} ranks agreed up to round {agreed}, the last round of every rank"


def _behind_sentence(f: dict[str, Any]) -> str:
    behind = f["ranks"]
    return (
        f"no round advances and {f['rank_kind']} {_ranks_text(behind)} {'are' if len(behind) > 1 else 'is'} many "
        f"rounds behind (entered {', '.join(str(e) for e in f['entered'])}; the others up to {f['top']}): that rank "
        "stopped taking part in MLP-sync rounds while the others went on (a sync it skipped, or a collective "
        "outside the sync that only the others issue)"
    )


def _stall_sentence(f: dict[str, Any]) -> str:
    return (
        f"every rank alive (heartbeats ticking), none advances, all in round {f['round']} with the same decisions: a "
        "stall outside the vote. Check where the ranks wait (py-spy dump --pid <pid> --native), e.g. a lazily loaded "
        "kernel on the first target-verify or draft step (sglang#33642: every scheduler in cuModuleLoadData; start "
        "with CUDA_MODULE_LOADING=EAGER), a collective outside the MLP sync, or a stuck device"
    )


def _mixed_sentence(f: dict[str, Any]) -> str:
    parts = []
    for what, by in f["mixed"].items():
        name = "plugin" if what == "plugin" else "SGLang"
        parts.append(f"{name} " + ", ".join(f"{v} on {_ranks_text(r)}" for v, r in by.items()))
    return (
        f"the files come from different versions ({'; '.join(parts)}): one launch runs one version (an older file of "
        "a rank that recorded nothing this time, or a mixed install); the rounds are compared all the same"
    )


def _all_stale_sentence(f: dict[str, Any]) -> str:
    if f["watched_s"]:
        since = f"no rank's heartbeat ticked in {f['watched_s']:.1f} s"
    else:
        since = f"the newest {f['newest_heartbeat_age_s']:.0f} s ago"
    return (
        f"every heartbeat stopped ({since}): the server is down, or these are copies (read the files on their own "
        "nodes to tell frozen from dead)"
    )


_SIMPLE = {
    "stopped": _stopped_sentence,
    "agreement": _agreement_sentence,
    "behind": _behind_sentence,
    "stall_outside_vote": _stall_sentence,
    "mixed_versions": _mixed_sentence,
    "all_stale": _all_stale_sentence,
}


def escape(text: str) -> str:
    """``text`` with every character a terminal would act on (control characters, escapes) shown as an escape: a
    file's fields and names are never printed raw."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def rollcall_lines(data: dict[str, Any]) -> list[str]:
    """The text report, one entry a line (not yet escaped)."""
    kind = "DP" if data.get("rank_kind", "dp") == "dp" else "TP"
    lines = []
    if data.get("size"):
        lines.append(f"sglang-dp-mtp-fix rollcall: {len(data['ranks'])} of {data['size']} {kind} ranks have a file")
    for r in data["ranks"]:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(r["started"])) if r["started"] else "unknown"
        skipped = f", {r['skipped']} half-written" if r["skipped"] else ""
        lines.append(
            f"  {kind} rank {r['rank']}: last round {r['last_round']} ({r['records']} rounds kept{skipped}, "
            f"last entered {r['entered_round']}); "
            f"host {r['host']} pid {r['pid']}, started {started}, plugin {r['plugin_version']} on SGLang "
            f"{r['sglang_version']}"
        )
        for bad in r["implausible"]:
            lines.append(f"    cannot be true, not used: {bad['field']} {bad['value']}: {bad['reason']}")
    for m in data["missing_ranks"]:
        lines.append(f"  {kind} rank {m}: NO FILE")
    for path in data["superseded"]:
        lines.append(f"  ignored (the rank's other file is its live or newest one): {path}")
    for ref in data["refused"]:
        lines.append(f"  refused {ref['file']}: {ref['reason']}")
    for note in data["notes"]:
        lines.append(f"  {note}")
    lines.append(data["answer"])
    return lines


def print_rollcall(data: dict[str, Any]) -> None:
    for line in rollcall_lines(data):
        print(escape(line))


def unsurrogated(value: Any) -> Any:
    """``value`` with every string's undecodable bytes (a non-UTF-8 path, decoded by the OS as lone surrogates, which
    strict JSON readers refuse) written as ``\\xNN``, through lists and dicts."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {unsurrogated(k): unsurrogated(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [unsurrogated(v) for v in value]
    return value


def rollcall_json(data: dict[str, Any]) -> str:
    """Strict JSON (no NaN or Infinity: the reader keeps no time that is not one; no lone surrogate)."""
    return json.dumps(unsurrogated(data), indent=2, allow_nan=False)
