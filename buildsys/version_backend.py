"""The build backend: setuptools, with the plugin's version stamped from git first.

The release number lives in ``src/sglang_dp_mtp_fix/_version.py`` (``RELEASE``). At a build the full version is worked
out and written to ``src/sglang_dp_mtp_fix/_build_version.py`` (kept out of git), which the package reads at run time:

- a git checkout: ``RELEASE`` at the commit that last changed that line, else ``<next>.dev<N>+g<commit>`` with N the
  commits since then (no tag needed: a fresh clone in CI may carry none), ``.dirty`` for uncommitted changes;
- a ``git archive`` tree: ``.git_archival.txt`` (export-subst) gives the commit, and the count where a ``v*`` tag
  reaches it (``dev0`` where none does);
- an sdist: the ``_build_version.py`` it carries.

In-tree, so building needs nothing but setuptools, and the installed package nothing at all.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every hook this module does not override

RELEASE_FILE = "src/sglang_dp_mtp_fix/_version.py"
STAMP_FILE = "src/sglang_dp_mtp_fix/_build_version.py"
# The release line; before 0.3.0 the number stood in ``__version__`` itself.
_RELEASE_LINE = r"^(RELEASE|__version__) = "


def release(root: Path) -> str:
    return _number((root / RELEASE_FILE).read_text(), RELEASE_FILE)


def _number(text: str, where: str) -> str:
    match = re.search(_RELEASE_LINE + r'"([^"]+)"', text, re.M)
    if not match:
        raise RuntimeError(f"{where} has no release line")
    return match.group(2)


def compose(number: str, count: int | None, commit: str | None, dirty: bool = False) -> str:
    """PEP 440: the release itself at its own clean commit, else the next patch release's dev build of ``commit``
    (``count`` None: the commits since the release are unknown, as in an untagged archive or a shallow clone)."""
    if count == 0 and not dirty:
        return number
    major, minor, patch = (int(p) for p in number.split(".")[:3])
    base = number if count == 0 else f"{major}.{minor}.{patch + 1}.dev{count or 0}"
    local = ".".join(p for p in (f"g{commit[:7]}" if commit else "", "dirty" if dirty else "") if p)
    return f"{base}+{local}" if local else base


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def from_git(root: Path, rev: str = "HEAD") -> str | None:
    """The version of ``rev`` in the checkout at ``root``; None where root is not a git checkout's top."""
    try:
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None  # e.g. an unpacked archive inside some other repository
        commit = _git(root, "rev-parse", rev)
    except (OSError, subprocess.CalledProcessError):
        return None
    number = _number_at(root, commit)
    since = _release_commit(root, commit, number)
    count = int(_git(root, "rev-list", "--count", f"{since}..{commit}")) if since else None  # None: a shallow clone
    dirty = rev == "HEAD" and bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    if number is None:
        raise RuntimeError(f"{RELEASE_FILE} at {commit} has no release line")
    return compose(number, count, commit, dirty)


def _number_at(root: Path, commit: str) -> str | None:
    try:
        return _number(_git(root, "show", f"{commit}:{RELEASE_FILE}"), f"{RELEASE_FILE} at {commit}")
    except (subprocess.CalledProcessError, RuntimeError):
        return None  # no such file there yet


def _release_commit(root: Path, commit: str, number: str | None) -> str | None:
    """The commit that set the number ``commit`` carries: the newest commit touching the release line whose parent
    carried another number (a line rewritten with the same number is not a release)."""
    touched = _git(root, "log", "--format=%H", "-E", "-G", _RELEASE_LINE, commit, "--", RELEASE_FILE).split()
    for candidate in touched:
        if _number_at(root, f"{candidate}^") != number:
            return candidate
    return None


def from_archival(root: Path) -> str | None:
    """The version of a ``git archive`` tree, from its expanded ``.git_archival.txt``; None where there is none."""
    path = root / ".git_archival.txt"
    if not path.is_file():
        return None
    fields = dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)
    commit = fields.get("node", "")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None  # not expanded: a checkout's own copy
    described = fields.get("describe-name", "")  # `git describe` of the commit, empty where no v* tag reaches it
    on_tag = re.fullmatch(r"v[0-9][0-9.]*", described)
    after_tag = re.fullmatch(r"v[0-9][0-9.]*-(\d+)-g[0-9a-f]+", described)
    count = 0 if on_tag else int(after_tag.group(1)) if after_tag else None
    return compose(release(root), count, commit)


def version(root: Path) -> str:
    stamp = root / STAMP_FILE
    found = from_git(root) or (_stamped(stamp) if stamp.is_file() else None) or from_archival(root)
    return found or release(root)


def _stamped(stamp: Path) -> str | None:
    match = re.search(r'^VERSION = "([^"]+)"', stamp.read_text(), re.M)
    return match.group(1) if match else None


def stamp(root: Path | None = None) -> str:
    root = root or Path.cwd()
    full = version(root)
    text = f'# Written by buildsys/version_backend.py at build time; not in git.\nVERSION = "{full}"\n'
    path = root / STAMP_FILE
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return full


def _stamp_first(hook: Callable[..., Any]) -> Callable[..., Any]:
    """setuptools' hook, with the version stamped first. Every hook a frontend may call first needs it: setuptools
    reads the version (from the stamp) as soon as it is asked what the build needs, and a fresh clone or an unpacked
    archive has no stamp yet."""

    @functools.wraps(hook)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        stamp()
        return hook(*args, **kwargs)

    return stamped


build_wheel = _stamp_first(_setuptools.build_wheel)
build_sdist = _stamp_first(_setuptools.build_sdist)
build_editable = _stamp_first(_setuptools.build_editable)
prepare_metadata_for_build_wheel = _stamp_first(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _stamp_first(_setuptools.prepare_metadata_for_build_editable)
get_requires_for_build_wheel = _stamp_first(_setuptools.get_requires_for_build_wheel)
get_requires_for_build_sdist = _stamp_first(_setuptools.get_requires_for_build_sdist)
get_requires_for_build_editable = _stamp_first(_setuptools.get_requires_for_build_editable)
