"""The plugin in a real SGLang server on CPU, as a user sees it (``tools/launch-demo.sh``): the launch tier's shape
(DP attention tp 2 / dp 2, PD decode with the fake transfer backend, NEXTN MTP, dummy weights, the tier's named CPU
stand-ins, 127.0.0.1 only), a few greedy requests at once, then a summary of its own: which process loaded which
patches, the cross-rank check, the vote counters, the completions, the stop. SGLang's own output (its warnings
included) stays in the log file the demo names; the server's whole process group is stopped at the end, whatever
happens. Extra environment passes through (e.g. SGLANG_DP_MTP_FIX=off, SGLANG_DP_MTP_FIX_STATS=4)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

from launchlib import PROMPTS, SGLANG_VERSION, base_env, gaps_pythonpath, start_server

# "[2026-12-02 15:27:07 DP0 TP0] message": schedulers carry SGLang's DP/TP prefix, the launcher none.
LINE = re.compile(r"^\[[^\]]*?(?: (?P<who>DP\d+ TP\d+))?\] (?P<msg>sglang-dp-mtp-fix.*)$")
REPORT = re.compile(r"^sglang-dp-mtp-fix (?P<plugin>\S+) on SGLang \S+ \(mode=(?P<mode>\w+)\): (?P<rest>.*)$")
IMPORTED = re.compile(r"^sglang-dp-mtp-fix: (?P<id>\w+) (?P<what>applied|left stock) when (?P<module>\S+) was imported")
STATS = re.compile(
    r"stats \(last (?P<n>\d+) decode batches\): generic decode vote "
    r"graph-eligible=(?P<gen_yes>\d+) eager=(?P<gen_no>\d+); "
    r"draft vote graph-eligible=(?P<draft_yes>\d+) forced-eager=(?P<draft_no>\d+); "
    r"forced-eager by cause: [^=]+=(?P<own>\d+), [^=]+=(?P<other>\d+)"
)

# Lines the summary already shows; anything else the plugin logged (a warning, a stop) is printed as it is.
ROUTINE = (
    REPORT,
    re.compile(r"applied when \S+ was imported|cross-rank patch-state check passed|^sglang-dp-mtp-fix stats "),
    re.compile(r"^sglang-dp-mtp-fix: (MLP-sync transport|vote counters exported|flight recorder):"),
)


def plugin_lines(log: str) -> list[tuple[str, str]]:
    """(process, message) for every sglang-dp-mtp-fix line of the server's log, in order."""
    found = []
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            found.append((m["who"] or "launcher", m["msg"]))
    return found


def patches_by_process(lines: list[tuple[str, str]]) -> dict[str, str]:
    """Per process, in one short line: the most common status, then every patch with another one. The report line
    at load is updated by the 'applied when ... imported' lines (the deferred patches)."""
    statuses: dict[str, dict[str, str]] = {}
    heads: dict[str, str] = {}
    for who, msg in lines:
        report = REPORT.match(msg)
        if report:
            heads[who] = f"plugin {report['plugin']}, mode={report['mode']}"
            pairs = (p.rpartition("=") for p in report["rest"].split(": ")[-1].split(", "))
            statuses[who] = {pid: status for pid, _, status in pairs if pid}
        imported = IMPORTED.match(msg)
        if imported and who in statuses:
            statuses[who][imported["id"]] = "applied" if imported["what"] == "applied" else "left stock at import"
    out = {}
    for who, by_id in statuses.items():
        groups: dict[str, list[str]] = {}
        for pid, status in by_id.items():
            groups.setdefault(status, []).append(pid)
        common = max(groups, key=lambda st: len(groups[st]))
        rest = "; ".join(f"{', '.join(ids)} {st}" for st, ids in groups.items() if st != common)
        out[who] = f"{heads[who]}: {len(groups[common])} of {len(by_id)} {common}" + (f", {rest}" if rest else "")
    return out


def counters(lines: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """Per scheduler: the stats lines' windows summed (decode batches, votes, causes)."""
    sums: dict[str, dict[str, int]] = {}
    for who, msg in lines:
        m = STATS.search(msg)
        if m:
            acc = sums.setdefault(who, {})
            for key, value in m.groupdict().items():
                acc[key] = acc.get(key, 0) + int(value)
    return sums


def summary(log: str, completions: list[str], stopped: bool) -> list[str]:
    lines = plugin_lines(log)
    out = ["--- patches per process (the report line, updated by the 'applied when ... imported' lines)"]
    by_process = patches_by_process(lines)
    order = sorted(by_process, key=lambda w: (w != "launcher", w))  # launcher, then DP0, DP1, ...
    for k, who in enumerate(order):
        same = next((w for w in order[:k] if w != "launcher" and by_process[w] == by_process[who]), None)
        out.append(f"  {who:<9} " + (f"same as {same}" if same else by_process[who]))
    if not by_process:
        out.append("  no report line: the plugin was not loaded (SGLANG_PLUGINS without dp_mtp_fix?)")
    checks: dict[str, list[str]] = {}  # the check's verdict (rank number dropped) -> the processes that logged it
    for who, msg in lines:
        if "cross-rank patch-state check" in msg:
            verdict = msg.split("cross-rank patch-state check ", 1)[-1]
            checks.setdefault(re.sub(r" on rank \d+", "", verdict), []).append(who)
    out.append("--- cross-rank check" + ("" if checks else ": not run (no patched scheduler)"))
    out += [f"  {', '.join(sorted(whos))}: {verdict}" for verdict, whos in checks.items()]
    other = [f"  {w}: {m[:200]}" for w, m in lines if not any(k.search(m) for k in ROUTINE)]
    other += sorted({f"  {line.strip()[:200]}" for line in log.splitlines() if "PeerStateMismatch" in line})
    if other:
        out += ["--- other plugin lines (warnings, stops)", *other[:8]]
    sums = counters(lines)
    out.append("--- vote counters (votes, not graph use), summed per rank" + ("" if sums else ": none logged"))
    for who, c in sorted(sums.items()):
        out.append(
            f"  {who}: {c['n']} batches; generic vote graph-eligible {c['gen_yes']} eager {c['gen_no']}; draft vote "
            f"graph-eligible {c['draft_yes']} forced-eager {c['draft_no']} (seedless {c['own']}, peer {c['other']})"
        )
    out += ["--- completions (greedy, 8 tokens)", *completions]
    out.append(f"--- stop: server process group gone: {stopped}")
    return out


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="launch-demo-"))
    env = base_env(gaps_pythonpath(work / "entry-points"))
    env.update({k: v for k, v in os.environ.items() if k.startswith(("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS"))})
    env.setdefault("SGLANG_DP_MTP_FIX_STATS", "4")
    server = start_server("demo", work, env)
    print(f"SGLang {SGLANG_VERSION} on CPU, 127.0.0.1:{server.port}; SGLang's output (warnings included) goes to")
    print(f"  {server.log_path}", flush=True)
    completions: list[str] = []
    try:
        t0 = time.monotonic()
        if not server.wait_ready():
            # SGLang's own log lines only (its Python warnings stay in the file), cut to one terminal line each.
            tail = [line[:160] for line in server.log.splitlines() if line.startswith("[")][-10:]
            print(f"the server did not become ready in {time.monotonic() - t0:.0f} s (LAUNCH_READY_TIMEOUT raises the")
            print(f"bound); its last log lines (all of it: {server.log_path}):", *tail, sep="\n")
            return 1
        print(f"ready in {time.monotonic() - t0:.0f} s; sending {len(PROMPTS)} requests at once", flush=True)
        # bootstrap_host 2.2.2.2 is SGLang's fake-transfer marker, never contacted.
        for k, out in enumerate(server.generate_all(PROMPTS), 1):
            completions.append(
                f"  request {k}: DP rank {out['meta_info'].get('dp_rank')}, output_ids {out['output_ids']}"
            )
        time.sleep(1.0)
    finally:
        server.stop()
    print("\n".join(summary(server.log, completions, not server.group_alive())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
