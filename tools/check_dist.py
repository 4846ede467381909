"""Check the sdist and wheel a user installs (``tools/check-wheel.sh`` builds them from a clean checkout).

Fails (exit 1, one line per problem) unless the wheel declares the SGLang plugin entry point and the console script,
has no hard dependency on the stack it patches (sglang, torch, flashinfer: extras only), and ships ``py.typed``,
the generated fingerprint data, the harness's dummy model config and every patch module; and unless the sdist holds
what building that wheel needs.
Usage: python tools/check_dist.py DIST_DIR
"""

from __future__ import annotations

import configparser
import re
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

PATCHED_STACK = ("sglang", "torch", "flashinfer", "flashinfer-python")
WHEEL_FILES = (
    "sglang_dp_mtp_fix/py.typed",
    "sglang_dp_mtp_fix/fingerprints/sglang.json",
    "sglang_dp_mtp_fix/harness/dummy_model/config.json",
    "sglang_dp_mtp_fix/plugin.py",
    "sglang_dp_mtp_fix/cli.py",
    "sglang_dp_mtp_fix/_build_version.py",  # the version the build named (buildsys/version_backend.py)
)
SDIST_FILES = ("pyproject.toml", "README.md", "CHANGELOG.md", "src/sglang_dp_mtp_fix/py.typed",
               "src/sglang_dp_mtp_fix/fingerprints/sglang.json", "src/sglang_dp_mtp_fix/_build_version.py",
               "buildsys/version_backend.py")  # fmt: skip


def check_wheel(path: Path, root: Path) -> list[str]:
    problems = []
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        meta = Parser().parsestr(whl.read(f"{dist_info}/METADATA").decode())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(whl.read(f"{dist_info}/entry_points.txt").decode())
    if meta["Name"] != "sglang-dp-mtp-fix":
        problems.append(f"wheel Name is {meta['Name']!r}")
    for req in meta.get_all("Requires-Dist") or []:
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower()
        if name in PATCHED_STACK and "extra ==" not in req:
            problems.append(f"hard dependency on the patched stack: Requires-Dist: {req}")
    plugins = dict(entry_points["sglang.srt.plugins"]) if entry_points.has_section("sglang.srt.plugins") else {}
    if plugins.get("dp_mtp_fix") != "sglang_dp_mtp_fix.plugin:register":
        problems.append(f"entry point sglang.srt.plugins:dp_mtp_fix missing or wrong: {plugins}")
    scripts = dict(entry_points["console_scripts"]) if entry_points.has_section("console_scripts") else {}
    if scripts.get("sglang-dp-mtp-fix") != "sglang_dp_mtp_fix.console:main":
        problems.append(f"console script sglang-dp-mtp-fix missing or wrong: {scripts}")
    patches = sorted(
        p.relative_to(root / "src").as_posix() for p in (root / "src/sglang_dp_mtp_fix/patches").glob("*.py")
    )
    problems += [f"wheel lacks {name}" for name in (*WHEEL_FILES, *patches) if name not in names]
    return problems


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    return [f"sdist lacks {name}" for name in SDIST_FILES if name not in names]


def main() -> int:
    dist = Path(sys.argv[1])
    root = Path(__file__).resolve().parents[1]
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"check_dist: expected one wheel and one sdist in {dist}, found {wheels + sdists}")
        return 1
    problems = check_wheel(wheels[0], root) + check_sdist(sdists[0])
    for problem in problems:
        print(f"check_dist: {problem}")
    if not problems:
        print(f"check_dist: {wheels[0].name} and {sdists[0].name}: metadata, entry points and package files ok")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
