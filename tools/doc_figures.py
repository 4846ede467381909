"""Figures that README.md and docs/ state, written from their one source so that they cannot go stale.

A figure stands between ``<!-- fig:NAME -->`` and ``<!-- /fig -->`` in a page; its text is made here from the file
that holds it: the patch modules (how many patches), the soak results (``bench/results/soak-<release>.json``) and the
recorder's committed cost run (``bench/results/recorder-rounds-<release>.json``). ``tests/test_docs.py`` checks the
patch count against the plugin's own ``all_patches()``.

Usage: python tools/doc_figures.py [--check]   (--check: exit 1, naming each stale figure, instead of writing)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md")
FIGURE = re.compile(r"(<!-- fig:(?P<name>[\w-]+) -->)(?P<text>.*?)(<!-- /fig -->)", re.S)
RECORDER_RUN = "recorder-rounds-0.5.20.json"


def patch_count() -> int:
    return sum(1 for p in (ROOT / "src/sglang_dp_mtp_fix/patches").glob("*.py") if not p.name.startswith("_"))


def _soak() -> dict[str, dict[str, dict[str, object]]]:
    found = {}
    for path in sorted((ROOT / "bench/results").glob("soak-*.json")):
        data = json.loads(path.read_text())
        found[str(data["sglang_version"])] = data["arms"]
    return found


def soak_on() -> str:
    parts = []
    for release, arms in _soak().items():
        on = arms["on"]
        batches = " / ".join(f"{n:,}" for n in on["decode_batches_per_rank"].values())  # type: ignore[attr-defined]
        parts.append(
            f"on {release} {batches} decode batches per DP rank, {on['forced_rounds']} of them forced, "
            f"{on['rounds_ranks_disagree']} rounds where the ranks' draft paths differ, "
            f"{on['requests_ok']:,} of {on['requests']:,} requests exact"
        )
    return "; ".join(parts)


def soak_off() -> str:
    parts = []
    for release, arms in _soak().items():
        if "off" in arms:
            off = arms["off"]
            parts.append(f"on {release} in {off['rounds_ranks_disagree']} of {off['forced_rounds']} forced rounds")
    return "; ".join(parts) or "not run"


def recorder_cost() -> str:
    data = json.loads((ROOT / "bench/results" / RECORDER_RUN).read_text())
    cost = data["paired_median_vs_patched_us"]["recorder"]
    round_us = data["median_round_us"]["patched"]
    return (
        f"+{cost:.1f} µs per MLP-sync round over the patched round with the recorder off (the median of paired rounds; "
        f"the round itself {round_us:.0f} µs on CPU; SGLang {data['sglang_version']}, {data['date']}, "
        f"[`bench/results/{RECORDER_RUN}`](../bench/results/{RECORDER_RUN}))"
    )


FIGURES: dict[str, Callable[[], object]] = {
    "patches": patch_count,
    "soak-on": soak_on,
    "soak-off": soak_off,
    "recorder-cost": recorder_cost,
}


def render(text: str, where: str, problems: list[str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in FIGURES:
            problems.append(f"{where}: unknown figure {name!r}")
            return match.group(0)
        value = str(FIGURES[name]())
        if match.group("text") != value:
            problems.append(f"{where}: figure {name} says {match.group('text')!r}, its source {value!r}")
        return f"{match.group(1)}{value}{match.group(4)}"

    return FIGURE.sub(one, text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale: list[str] = []
    for page in PAGES:
        text = page.read_text()
        problems: list[str] = []
        new = render(text, str(page.relative_to(ROOT)), problems)
        stale += problems
        if not check and new != text:
            page.write_text(new)
    for problem in stale:
        print(f"doc_figures: {problem}")
    if check:
        return 1 if stale else 0
    return 1 if any("unknown figure" in p for p in stale) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
