"""docs/dsa-backends.md's table (DSA decode backend x release -> which patch trims it), generated from the wheels.

For each release the plugin patches, the wheel's ``DeepseekSparseAttnBackend.forward_decode`` is read (not imported):
every branch comparing the decode impl name (``dsa_impl == "x"`` / ``self.dsa_decode_impl == "x"``) and the
``_forward_*`` it calls. A branch that returns before the shared prologue (the first
``transform_index_page_table_decode`` call) reaches ``_forward_*`` itself: it is trimmed by the patch wrapping that
method (``dsa_trtllm_trim`` for ``_forward_trtllm``); every branch after it is reached through the prologue and is
trimmed by the patch wrapping ``forward_decode`` (``dsa_decode_trim``). A backend with no such patch is flagged
``NOT TRIMMED`` (the table then says so, and ``--check`` fails until a verdict is added). A patch counts only where
the shipped fingerprints (``fingerprints/sglang.json``) hold its target for that release.

Usage: python tools/dsa_backend_table.py [--cache DIR] [--check]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

from gen_fingerprints import OUT as FINGERPRINTS  # noqa: E402
from gen_fingerprints import wheel_for  # noqa: E402

from sglang_dp_mtp_fix.core import AFFECTED_RELEASES, Kind  # noqa: E402
from sglang_dp_mtp_fix.fingerprints import find_definition  # noqa: E402
from sglang_dp_mtp_fix.patches import all_patches  # noqa: E402

DOC = ROOT / "docs" / "dsa-backends.md"
BEGIN, END = "<!-- dsa-table:begin -->", "<!-- dsa-table:end -->"
MODULE_PATH = "sglang/srt/layers/attention/dsa_backend.py"
FORWARD_DECODE = "DeepseekSparseAttnBackend.forward_decode"
PROLOGUE = "transform_index_page_table_decode"


def impl_name(test: ast.expr) -> str | None:
    """``"x"`` for ``dsa_impl == "x"`` or ``self.dsa_decode_impl == "x"``; None otherwise."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    left, right = test.left, test.comparators[0]
    named = (isinstance(left, ast.Name) and left.id == "dsa_impl") or (
        isinstance(left, ast.Attribute) and left.attr == "dsa_decode_impl"
    )
    return right.value if named and isinstance(right, ast.Constant) and isinstance(right.value, str) else None


def dispatch(forward_decode: ast.AST) -> dict[str, tuple[str, bool]]:
    """impl name -> (the ``_forward_*`` its branch calls, whether the branch comes before the shared prologue)."""
    prologue = min(
        (n.lineno for n in ast.walk(forward_decode) if isinstance(n, ast.Name) and n.id == PROLOGUE), default=None
    )
    if prologue is None:
        raise SystemExit(f"dsa_backend_table: no {PROLOGUE} call in forward_decode: the prologue changed")
    found: dict[str, tuple[str, bool]] = {}
    for node in ast.walk(forward_decode):
        name = impl_name(node.test) if isinstance(node, ast.If) else None
        if name is None or not isinstance(node, ast.If):
            continue
        calls = [
            c.func.attr
            for stmt in node.body
            for c in ast.walk(stmt)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr.startswith("_forward_")
        ]
        if calls:
            found.setdefault(name, (calls[0], node.lineno < prologue))
    return found


def trimming_patches() -> dict[str, str]:
    """Qualname of each DSA backend method a patch wraps -> the patch id."""
    return {
        t.qualname: p.id
        for p in all_patches()
        for t in p.targets
        if t.kind is Kind.WRAP and t.module.endswith("attention.dsa_backend")
    }


def verdicts(cache: Path) -> tuple[list[str], dict[str, dict[str, str]]]:
    known = json.loads(FINGERPRINTS.read_text())["targets"]
    wrapped = trimming_patches()
    table: dict[str, dict[str, str]] = {}
    for release in AFFECTED_RELEASES:
        with zipfile.ZipFile(wheel_for(release, cache)) as wheel:
            tree = ast.parse(wheel.read(MODULE_PATH).decode())
        node = find_definition(tree, FORWARD_DECODE)
        if node is None:
            raise SystemExit(f"dsa_backend_table: {FORWARD_DECODE} missing in {release}")
        for impl, (method, before_prologue) in dispatch(node).items():
            seam = f"DeepseekSparseAttnBackend.{method}" if before_prologue else FORWARD_DECODE
            patch = wrapped.get(seam)
            target = f"sglang.srt.layers.attention.dsa_backend:{seam}"
            fingerprinted = any(release in rels for rels in known.get(target, {}).values())
            cell = f"trimmed by `{patch}`" if patch and fingerprinted else f"NOT TRIMMED (`{method}`)"
            table.setdefault(impl, {})[release] = cell
    return list(AFFECTED_RELEASES), table


def render(releases: list[str], table: dict[str, dict[str, str]]) -> str:
    lines = [
        BEGIN,
        "<!-- generated by tools/dsa_backend_table.py from the release wheels; do not edit by hand -->",
        "| DSA decode impl | " + " | ".join(releases) + " |",
        "|---|" + "---|" * len(releases),
    ]
    lines += [f"| `{impl}` | " + " | ".join(row.get(r, "—") for r in releases) + " |" for impl, row in table.items()]
    lines.append(END)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "sglang-dp-mtp-fix" / "wheels")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    rendered = render(*verdicts(args.cache))
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"dsa_backend_table: {DOC.name} has no {BEGIN} ... {END} block")
        return 1
    head, rest = text.split(BEGIN, 1)
    new = head + rendered + rest.split(END, 1)[1]
    if args.check:
        same = new == text and "NOT TRIMMED" not in rendered
        stale = "stale or a backend is NOT TRIMMED: rerun tools/dsa_backend_table.py and review the diff"
        print(f"dsa_backend_table: {'docs/dsa-backends.md is up to date' if same else stale}")
        return 0 if same else 1
    DOC.write_text(new)
    print(f"dsa_backend_table: wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
