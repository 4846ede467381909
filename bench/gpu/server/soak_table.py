#!/usr/bin/env python3
"""The soak results table, made from the summary JSONs only (``soak-<release>-<arm>.json`` under a results folder,
one row per file, named by its run's folder), the ``pd`` stage's legs (``pd-<release>-<prefill>-<arm>.json``), and
the ``ab`` stage's ratios (``summary-<release>.json``):
``python3 bench/gpu/server/soak_table.py bench/gpu/results/<date>`` prints them; ``--check README.md`` fails when
a table of the README (between its two marker lines) is not what the files say."""

from __future__ import annotations

import glob
import json
import os
import random
import statistics
import sys
from typing import Any

BEGIN, END = "<!-- soak-table: begin (soak_table.py) -->", "<!-- soak-table: end -->"
AB_BEGIN, AB_END = "<!-- ab-table: begin (soak_table.py) -->", "<!-- ab-table: end -->"
PD_BEGIN, PD_END = "<!-- pd-table: begin (soak_table.py) -->", "<!-- pd-table: end -->"
# the ab stage's pairs: (numerator arm, denominator arm, what is compared, the goal of issue 47)
PAIRS = (("A", "B", "patched / stock (plugin off)", 0.995), ("R", "A", "recorder on / off", 0.998))


def ranks(d: dict[str, Any]) -> str:
    return " / ".join(str(d[k]) for k in sorted(d, key=int))


def gpu_cell(r: dict[str, Any]) -> str:
    """The card's short name and how the DP ranks' processes share it (run.sh MPS=1; before it: time-sliced)."""
    name = next((w for w in (r.get("gpu") or "").split() if w[:1] in "ABHL" and w[1:2].isdigit()), "-")
    return f"{name} {r.get('gpu_sharing', 'time-sliced')}"


def row(run: str, r: dict[str, Any]) -> str:
    head = f"| {run} | {r['release']} | {r['nodes']} | {gpu_cell(r)} | {r['arm']} | {r['backend']} |"
    if r.get("not_ready") or r.get("not_run"):
        why = r.get("not_run") or "not ready"
        return f"{head} not run: {why} |||||||"
    graph = ranks({k: f"{v['on']}/{v['off']}" for k, v in r["verify_graph"].items()})
    draft = ranks({k: f"{v['graph']}/{v['eager']}" for k, v in r["draft_rounds"].items()})
    ms = r.get("round_ms") or {}
    rt = " / ".join(f"{(ms.get(p) or {}).get('median', '-')}" for p in ("graph", "eager"))
    dm = r.get("draft_ms") or {}
    gpu = " / ".join(f"{(dm.get(f'gpu_{p}') or {}).get('median', '-')}" for p in ("graph", "eager"))
    share = "-" if r.get("eager_share") is None else f"{100 * r['eager_share']:.1f} %"
    rc = r.get("rollcall") or {}
    verdict = "- (plugin off)" if r["arm"] == "stock" else rc.get("verdict")
    return (f"{head} {ranks(r['decode_batches'])} | {graph} | "
            f"{draft} | {share} | {r['split_rounds']} | {r['served']} / {r['asked']} | {rt} | {gpu} | "
            f"{r['stopped_by']}{drained(r)}; rollcall {verdict} |")  # fmt: skip


def drained(r: dict[str, Any]) -> str:
    """How the drain after the traffic ended (soaks since 2026-12-07's second session; none before)."""
    return f", drain {r['drain_ended_by']} {r['drain_s']} s" if r.get("drain_ended_by") else ""


def table(folder: str) -> str:
    paths = sorted(glob.glob(os.path.join(folder, "**", "soak-*.json"), recursive=True))
    rows = [(os.path.relpath(os.path.dirname(p), folder), json.load(open(p))) for p in paths]
    head = ("| run | release | DP | GPU | arm | KV | decode batches per rank | verify graph on/off per rank | "
            "draft graph/eager per rank | group-eager rounds | split rounds | served / asked | "
            "ms per round graph / eager (median) | draft step GPU ms graph / eager (median) | "
            "ended by |\n|" + "---|" * 15)  # fmt: skip
    return "\n".join([head, *(row(run, r) for run, r in rows)])


def judged(j: dict[str, Any] | None) -> str:
    """identical / compared tokens, and the requests that differ: near-ties and divergences (tier.judge)."""
    if not j or j.get("tokens_compared") is None:
        return "-"
    return (f"{j['tokens_identical']} / {j['tokens_compared']} ({j['requests_identical']} / {j['requests_compared']}"
            f" requests; {j['near_ties']} near-tie, {j['divergences']} divergent)")  # fmt: skip


def pd_row(run: str, r: dict[str, Any]) -> str:
    prefill = f"{r['prefill']}: {'MTP' if r['prefill_spec'] else 'no spec'}"
    head = f"| {run} | {r['release']} | {r['nodes']} | {gpu_cell(r)} | {r['transfer']} | {prefill} | {r['arm']} |"
    if r.get("not_ready") or r.get("not_run"):
        return f"{head} not run: {r.get('not_run') or 'not ready'} ||||||||||||"
    graph = ranks({k: f"{v['on']}/{v['off']}" for k, v in r["verify_graph"].items()})
    ms = r.get("round_ms") or {}
    rt = " / ".join(f"{(ms.get(p) or {}).get('median', '-')}" for p in ("graph", "eager"))
    share = "-" if r.get("group_eager_share") is None else f"{100 * r['group_eager_share']:.1f} %"
    judge = r.get("judge") or {}
    ref = judge.get("reference") or "-"
    return (f"{head} {r['arrivals_seeded']} / {r['arrivals_seedless']} | {share} | {r['split_rounds']} | "
            f"{ranks(r['decode_batches'])} | {graph} | {rt} | {(r.get('accept_len') or {}).get('mean', '-')} | "
            f"{r['served']} / {r['asked']} | {ref} | {r.get('tokens_compared', '-')} of {r.get('tokens_served', '-')}"
            " | "
            f"{judged(judge.get('soak'))} | {judged(judge.get('alone'))} | "
            f"{r.get('arrivals_written_elsewhere', '-')} | {r['stopped_by']}{drained(r)} |")  # fmt: skip


def pd_table(folder: str) -> str:
    paths = sorted(
        p
        for p in glob.glob(os.path.join(folder, "**", "pd-*.json"), recursive=True)
        if not os.path.basename(p).startswith("pd-tokens-")
    )
    rows = [(os.path.relpath(os.path.dirname(p), folder), json.load(open(p))) for p in paths]
    head = ("| run | release | DP | GPU | transfer | prefill | decode | arrivals seeded / seedless | "
            "group-eager rounds | split rounds | decode batches per rank | verify graph on/off per rank | "
            "ms per round graph / eager (median) | accepted length (mean per batch) | served / asked | "
            "judged against | served tokens judged | soak tokens identical / compared | one-at-a-time tokens "
            "identical / compared | arrivals written outside their slot | ended by |\n|" + "---|" * 21)  # fmt: skip
    return "\n".join([head, *(pd_row(run, r) for run, r in rows)])


def pooled_ms(rounds: list[dict[str, Any]], kind: str, tokens: int) -> float:
    return 1000 * statistics.median([x for r in rounds for x in r[kind]]) / tokens


def ratio_interval(num: list[dict[str, Any]], den: list[dict[str, Any]], kind: str, tokens: int) -> tuple[float, float]:
    """95 % interval of the throughput ratio, each arm's rounds resampled with replacement (fixed seed: checkable)."""
    rng, out = random.Random(0), []
    for _ in range(2000):
        a, b = [rng.choice(num) for _ in num], [rng.choice(den) for _ in den]
        out.append(pooled_ms(b, kind, tokens) / pooled_ms(a, kind, tokens))
    out.sort()
    return out[50], out[1949]


def ab_rows(run: str, s: dict[str, Any]) -> list[str]:
    ab, rows = s["ab"], []
    tokens = ab["workload"]["tokens"]
    for num, den, what, goal in PAIRS:
        a = [r for r in ab["rounds"] if r["arm"] == num]
        b = [r for r in ab["rounds"] if r["arm"] == den]
        if not a or not b:
            continue
        for kind, load in (("conc", f"{ab['workload']['per_rank']} per rank at once"), ("solo", "one at a time")):
            ms_a, ms_b = pooled_ms(a, kind, tokens), pooled_ms(b, kind, tokens)
            lo, hi = ratio_interval(a, b, kind, tokens)
            rows.append(f"| {run} | {s['release']} | {s['nodes']} | {what} | {load} | {len(a)} / {len(b)} | "
                        f"{ms_a:.3f} / {ms_b:.3f} | {ms_b / ms_a:.4f} | {lo:.4f}-{hi:.4f} | >= {goal} |")  # fmt: skip
    return rows


def ab_table(folder: str) -> str:
    paths = sorted(glob.glob(os.path.join(folder, "**", "summary-*.json"), recursive=True))
    runs = [(os.path.relpath(os.path.dirname(p), folder), json.load(open(p))) for p in paths]
    head = ("| run | release | DP | compared | requests | rounds | ms per token (pooled median) | throughput ratio | "
            "95 % interval (rounds resampled) | goal |\n|" + "---|" * 10)  # fmt: skip
    return "\n".join([head, *(line for run, s in runs if "summary" in s.get("ab", {}) for line in ab_rows(run, s))])


def differs(text: str, begin: str, end: str, made: str) -> bool:
    have = text.split(begin, 1)[1].split(end, 1)[0].strip() if begin in text else ""
    return have != made


def main() -> int:
    folder = sys.argv[1]
    tables = (("soak", BEGIN, END, table), ("ab", AB_BEGIN, AB_END, ab_table), ("pd", PD_BEGIN, PD_END, pd_table))
    if len(sys.argv) > 3 and sys.argv[2] == "--check":
        text = open(sys.argv[3]).read()
        for name, begin, end, make in tables:  # each table the README holds
            if begin in text and differs(text, begin, end, made := make(folder)):
                print(f"{sys.argv[3]}: the {name} table differs from {folder}'s files; regenerate it:\n{made}")
                return 1
        return 0
    print("\n\n".join(make(folder) for _, _, _, make in tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
