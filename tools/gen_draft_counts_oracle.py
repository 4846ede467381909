"""Record upstream's answers (SGLang 0.5.23, stock) for the draft's DP token counts: the differential oracle of
``tests/test_draft_token_counts.py``. Never edit the JSON by hand: rerun this tool in a 0.5.23 venv.

Usage: $(tools/mkvenv.sh 0.5.23 | tail -1)/bin/python tools/gen_draft_counts_oracle.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

from sglang_dp_mtp_fix.harness import draft_counts

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "draft_counts_oracle.json"
COMMAND = "$(tools/mkvenv.sh 0.5.23 | tail -1)/bin/python tools/gen_draft_counts_oracle.py"


def generate() -> dict[str, object]:
    rows = draft_counts.rows_by_case(draft_counts.cases())
    cases = [
        {"target": t, "draft": d, "counts": list(c), "gathered": g, "shape": list(shape), "ranks": rows[case]}
        for case in draft_counts.cases()
        for t, d, c, g, shape in [case]
    ]
    return {"sglang": version("sglang"), "command": COMMAND, "max_bs": draft_counts.MAX_BS,
            "capture_bs": list(draft_counts.CAPTURE_BS), "cases": cases}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed oracle differs from a fresh one")
    args = ap.parse_args()
    text = json.dumps(generate(), indent=1) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("draft-counts oracle is current" if same else f"{OUT} is stale: rerun {COMMAND}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
