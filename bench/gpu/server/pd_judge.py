#!/usr/bin/env python3
"""Stage pd's judge across calls: ``python3 bench/gpu/server/pd_judge.py RESULTS_FOLDER [--check]``.

A device call holds at most three DP4 servers under one MPS daemon (four, 16 nodes, ran out of MPS clients: a CUDA
context could not be created), so a release's legs can come from several calls, and a leg's reference leg from
another call. Each leg's served tokens are kept beside its JSON (``pd-tokens-<release>-<prefill>-<arm>.json.xz``);
this judges every leg that has them against the reference leg of the same release found anywhere under the folder
(a:stock; a:stock itself against a:patched) with the stage's own judge (tier/judge.py), and writes ``judge``,
``tokens_compared``, ``tokens_identical`` and ``tokens_served`` into the leg's JSON. ``--check`` changes nothing and
exits 1 when a JSON's judgement is not what its tokens say (CI runs it on committed results).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import lzma
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("tier_judge", os.path.join(HERE, "tier", "judge.py"))
assert _spec and _spec.loader
judge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(judge)
REFERENCES = (("a", "stock"), ("a", "patched"))


def tokens_of(path: str) -> dict[str, Any] | None:
    for name in (path, path + ".xz"):
        if os.path.exists(name):
            opener = lzma.open if name.endswith(".xz") else open
            with opener(name, "rt") as f:
                data: dict[str, Any] = json.load(f)
                return data
    return None


def legs(folder: str) -> dict[tuple[str, str, str], tuple[str, dict[str, Any] | None]]:
    """(release, prefill, arm) -> (the leg JSON's path, its tokens or None)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "pd-*.json"), recursive=True)):
        name = os.path.basename(path)
        if name.startswith("pd-tokens-"):
            continue
        with open(path) as f:
            rec = json.load(f)
        tokens = tokens_of(os.path.join(os.path.dirname(path), "pd-tokens-" + name[len("pd-") :]))
        out[(rec["release"], rec["prefill"], rec["arm"])] = (path, tokens)
    return out


def judgement(key: tuple[str, str, str], found: dict[tuple[str, str, str], tuple[str, Any]]) -> dict[str, Any]:
    release, prefill, arm = key
    mine = found[key][1]
    ref = next((r for r in REFERENCES if r != (prefill, arm) and found.get((release, *r), ("", None))[1]), None)
    if not mine or ref is None:
        return {"judge": {"reference": None, "why": "no served tokens in this leg or in a reference leg"}}
    made: dict[str, Any] = judge.judge_leg(mine, found[(release, *ref)][1], f"{ref[0]}:{ref[1]}")
    made["judge"]["reference_file"] = os.path.relpath(found[(release, *ref)][0], os.path.dirname(found[key][0]))
    return made


def main() -> int:
    folder, check = sys.argv[1], "--check" in sys.argv[2:]
    found, stale = legs(folder), []
    for key, (path, _) in found.items():
        with open(path) as f:
            rec = json.load(f)
        made = judgement(key, found)
        if all(rec.get(k) == v for k, v in made.items()):
            continue
        stale.append(path)
        if not check:
            rec.update(made)
            with open(path, "w") as f:
                json.dump(rec, f, indent=1)
    for path in stale:
        print(f"{path}: {'its judgement differs from its tokens' if check else 'judged'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
