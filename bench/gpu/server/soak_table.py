#!/usr/bin/env python3
"""The soak results table, made from the summary JSONs only (``soak-<release>-<arm>.json`` under a results folder,
one row per file, named by its run's folder):
``python3 bench/gpu/server/soak_table.py bench/gpu/results/<date>/dp4`` prints it; ``--check README.md`` fails when
the README's table (between the two marker lines) is not what the files say."""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

BEGIN, END = "<!-- soak-table: begin (soak_table.py) -->", "<!-- soak-table: end -->"


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
            f"{r['stopped_by']}; rollcall {verdict} |")  # fmt: skip


def table(folder: str) -> str:
    paths = sorted(glob.glob(os.path.join(folder, "**", "soak-*.json"), recursive=True))
    rows = [(os.path.relpath(os.path.dirname(p), folder), json.load(open(p))) for p in paths]
    head = ("| run | release | DP | GPU | arm | KV | decode batches per rank | verify graph on/off per rank | "
            "draft graph/eager per rank | group-eager rounds | split rounds | served / asked | "
            "ms per round graph / eager (median) | draft step GPU ms graph / eager (median) | "
            "ended by |\n|" + "---|" * 15)  # fmt: skip
    return "\n".join([head, *(row(run, r) for run, r in rows)])


def main() -> int:
    folder = sys.argv[1]
    made = table(folder)
    if len(sys.argv) > 3 and sys.argv[2] == "--check":
        text = open(sys.argv[3]).read()
        have = text.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in text else ""
        if have != made:
            print(f"{sys.argv[3]}: the soak table differs from {folder}'s files; regenerate it:\n{made}")
            return 1
        return 0
    print(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
