"""Generate ``src/sglang_dp_mtp_fix/fingerprints/sglang.json`` from the real SGLang release wheels.

For every fingerprinted target of every patch (and every release listed below) the wheel is downloaded from PyPI
(``pip download --no-deps``, cached), the target's defining module is read from the wheel without installing or
importing it, and the definition's AST fingerprint is recorded. Never edit the JSON by hand: rerun this tool.

Usage: python tools/gen_fingerprints.py [--cache DIR] [--check]
  --check   exit 1 if the committed file differs from a fresh generation (CI-friendly).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sglang_dp_mtp_fix.core import Kind  # noqa: E402
from sglang_dp_mtp_fix.fingerprints import (  # noqa: E402
    definition_span,
    find_definition,
    fingerprint_node,
    text_digest,
)
from sglang_dp_mtp_fix.patches import all_patches  # noqa: E402
from sglang_dp_mtp_fix.sglang_versions import FINGERPRINTED_RELEASES  # noqa: E402

OUT = ROOT / "src" / "sglang_dp_mtp_fix" / "fingerprints" / "sglang.json"


def wheel_for(release: str, cache: Path) -> Path:
    found = sorted(cache.glob(f"sglang-{release}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache), f"sglang=={release}"],
            check=True,
        )
        found = sorted(cache.glob(f"sglang-{release}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel for sglang=={release}")
    return found[0]


def targets() -> list[tuple[str, str, str]]:
    seen: dict[str, tuple[str, str, str]] = {}
    for patch in all_patches():
        for t in patch.targets:
            if t.fingerprinted and t.kind is not Kind.ADD:
                seen[t.name] = (t.name, t.module, t.qualname)
    return sorted(seen.values())


def generate(cache: Path) -> dict:
    table: dict[str, dict[str, list[str]]] = {}
    absent: dict[str, list[str]] = {}
    texts: dict[str, dict[str, tuple[int, str]]] = {}
    for release in FINGERPRINTED_RELEASES:
        with zipfile.ZipFile(wheel_for(release, cache)) as wheel:
            names = set(wheel.namelist())
            parsed: dict[str, ast.Module | None] = {}
            sources: dict[str, list[str]] = {}
            for name, module, qualname in targets():
                if module not in parsed:
                    base = module.replace(".", "/")
                    path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in names), None)
                    text = wheel.read(path).decode() if path else ""
                    parsed[module] = ast.parse(text) if path else None
                    sources[module] = text.splitlines(keepends=True)
                tree = parsed[module]
                node = find_definition(tree, qualname) if tree is not None else None
                if node is None:
                    absent.setdefault(name, []).append(release)
                    continue
                fingerprint = fingerprint_node(node)
                table.setdefault(name, {}).setdefault(fingerprint, []).append(release)
                first, last = definition_span(node)
                span = sources[module][first - 1 : last]
                texts.setdefault(name, {})[text_digest(span)] = (len(span), fingerprint)
    return {
        "_generated_by": "tools/gen_fingerprints.py from the PyPI wheels of the releases below; do not edit",
        "releases": list(FINGERPRINTED_RELEASES),
        "targets": table,
        "absent": absent,
        "texts": texts,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "sglang-dp-mtp-fix" / "wheels")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    text = json.dumps(generate(args.cache), indent=1, sort_keys=True) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("fingerprints up to date" if same else f"{OUT} is stale: rerun tools/gen_fingerprints.py")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
