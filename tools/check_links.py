"""Check every relative link in the project's Markdown: README.md, CHANGELOG.md, docs/ and bench/ (CI: ``.ci/run``).

A relative link must name a file or folder that exists in the tree; a ``#fragment`` (on a Markdown file, or alone for
the page itself) must name a heading of that page, spelled as GitHub spells its anchors. Links with a scheme
(``https:``, ``mailto:``) are not fetched: CI has no network and they are not this tree's to keep. Code (fenced blocks
and inline spans) is skipped, so ``x[i](j)`` in code is never read as a link.
Usage: python tools/check_links.py [FILE.md ...]   (default: the pages above). Exit 1, one line per broken link.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
INLINE = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?\1", re.S)  # may span lines, never a blank one
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    found += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "bench").rglob("*.md"))
    return [p for p in found if p.is_file()]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks, inline code blanked unless told."""
    kept, fence = [], ""
    for line in text.splitlines():
        marker = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if marker and (not fence or marker[1].startswith(fence[0] * len(fence))):
            fence = "" if fence else marker[1]
            kept.append("")
        else:
            kept.append("" if fence else line)
    blanked = "\n".join(kept)
    if blank_code:
        blanked = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), blanked)
    return [(no, line) for no, line in enumerate(blanked.split("\n"), 1) if line.strip()]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, formatting and punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text(), blank_code=False):
        heading = HEADING.match(line)
        if not heading:
            continue
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading[2])  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def check(page: Path) -> list[str]:
    problems = []
    rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    for no, line in prose_lines(page.read_text()):
        targets = [m[1] for m in INLINE.finditer(line)]
        ref = REFERENCE.match(line)
        if ref:
            targets.append(ref[1])
        for target in targets:
            if SCHEME.match(target) or target.startswith("//"):
                continue
            path_part, _, fragment = target.partition("#")
            dest = (page.parent / unquote(path_part)).resolve() if path_part else page
            if not dest.exists():
                shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
                problems.append(f"{rel}:{no}: broken link {target!r}: {shown} does not exist")
            elif fragment and dest.suffix == ".md" and unquote(fragment).lower() not in anchors(dest):
                problems.append(f"{rel}:{no}: broken link {target!r}: no heading #{fragment} in {dest.name}")
    return problems


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or pages()
    problems = [p for f in files for p in check(f)]
    for problem in problems:
        print(f"check_links: {problem}")
    if problems:
        print(f"check_links: {len(problems)} broken relative link(s); fix the link or the page it names")
        return 1
    print(f"check_links: every relative link resolves ({len(files)} pages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
