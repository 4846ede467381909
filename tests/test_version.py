"""The version names the build: from git in a checkout (no tag needed), from ``.git_archival.txt`` in a ``git archive``
tree, and the same string wherever the plugin shows it (``--version``, doctor, the report line, the recorder header).

The build backend (``buildsys/version_backend.py``) runs here on real git repositories made in tmp_path; the release
venv's editable install was stamped by that same backend (tools/mkvenv.sh)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import version as dist_version
from pathlib import Path
from types import ModuleType

import pytest

from sglang_dp_mtp_fix import __version__, cli

ROOT = Path(__file__).resolve().parents[1]
# PEP 440: a release, or a dev build naming its commit (and .dirty for uncommitted changes)
BUILD = re.compile(r"\d+\.\d+\.\d+(\.dev\d+)?(\+g[0-9a-f]{7}(\.dirty)?|\+dirty)?")


def _backend() -> ModuleType:
    spec = importlib.util.spec_from_file_location("version_backend", ROOT / "buildsys/version_backend.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env)
    return done.stdout.strip()


def _commit(repo: Path, name: str, text: str) -> str:
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", name)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """A repository laid out like this one: the release file, the archival file and its export-subst attribute."""
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    for name in (".git_archival.txt", ".gitattributes"):
        (r / name).write_text((ROOT / name).read_text())
    _commit(r, "src/sglang_dp_mtp_fix/_version.py", 'RELEASE = "0.3.0"\n')
    return r


def test_a_checkout_names_its_commit_without_any_tag(repo: Path):
    backend = _backend()
    assert backend.from_git(repo) == "0.3.0"  # the release commit itself
    _commit(repo, "a.txt", "1")
    head = _commit(repo, "b.txt", "2")
    assert _git(repo, "tag") == ""
    assert backend.from_git(repo) == f"0.3.1.dev2+g{head[:7]}"
    (repo / "b.txt").write_text("edited")
    assert backend.from_git(repo) == f"0.3.1.dev2+g{head[:7]}.dirty"
    assert backend.from_git(repo, "HEAD~1") == f"0.3.1.dev1+g{_git(repo, 'rev-parse', 'HEAD~1')[:7]}"
    head = _commit(repo, "src/sglang_dp_mtp_fix/_version.py", 'RELEASE = "0.3.0"  # the line rewritten\n')
    assert backend.from_git(repo) == f"0.3.1.dev3+g{head[:7]}"  # the same number: not a release, the count goes on
    _commit(repo, "src/sglang_dp_mtp_fix/_version.py", 'RELEASE = "0.3.1"\n')
    assert backend.from_git(repo) == "0.3.1"  # the next release starts the count again


def test_a_git_archive_tree_carries_its_version(repo: Path, tmp_path: Path):
    backend = _backend()
    _commit(repo, "a.txt", "1")

    def unpacked(name: str) -> Path:
        subprocess.run(["git", "-C", str(repo), "archive", "-o", str(tmp_path / f"{name}.tar"), "HEAD"], check=True)
        with tarfile.open(tmp_path / f"{name}.tar") as tar:
            tar.extractall(tmp_path / name, filter="data")
        return tmp_path / name

    head = _git(repo, "rev-parse", "HEAD")
    assert backend.version(unpacked("untagged")) == f"0.3.1.dev0+g{head[:7]}"  # no tag: the count is unknown
    _git(repo, "tag", "v0.3.0", "HEAD~1")
    assert backend.version(unpacked("tagged")) == f"0.3.1.dev1+g{head[:7]}"  # as from git
    assert backend.from_git(repo) == f"0.3.1.dev1+g{head[:7]}"
    assert backend.from_archival(repo) is None  # a checkout's own, unexpanded copy is not read


def test_an_sdist_tree_keeps_the_version_it_was_stamped_with(tmp_path: Path):
    backend = _backend()
    tree = tmp_path / "sdist"
    (tree / "src/sglang_dp_mtp_fix").mkdir(parents=True)
    (tree / "src/sglang_dp_mtp_fix/_version.py").write_text('RELEASE = "0.3.0"\n')
    assert backend.version(tree) == "0.3.0"  # nothing but the number: no git, no archival, no stamp
    (tree / "src/sglang_dp_mtp_fix/_build_version.py").write_text('VERSION = "0.3.1.dev4+g1a2b3c4"\n')
    assert backend.stamp(tree) == "0.3.1.dev4+g1a2b3c4"


def test_the_installed_version_is_this_checkouts_build_everywhere_it_is_shown(capsys, tmp_path):
    assert BUILD.fullmatch(__version__), __version__
    assert dist_version("sglang-dp-mtp-fix") == __version__
    if (ROOT / ".git").exists():
        assert __version__ == _backend().from_git(ROOT), "the editable install is stale: run tools/mkvenv.sh again"
    cli.main(["--version"])
    assert capsys.readouterr().out.strip() == __version__
    cli.main(["doctor", "--json"])
    assert json.loads(capsys.readouterr().out)["plugin_version"] == __version__
    from sglang_dp_mtp_fix import report
    from sglang_dp_mtp_fix.config import Config

    assert f"sglang-dp-mtp-fix {__version__} on SGLang" in report.summary_line([], Config())
    from diagnosis.test_recorder import GRAPH, files, write_rank

    from sglang_dp_mtp_fix.diagnosis import reader

    write_rank(tmp_path, 0, 1, [GRAPH])
    assert reader.read_file(str(files(tmp_path)[0])).plugin_version == __version__


@pytest.mark.parametrize("hook", ["get_requires_for_build_wheel", "get_requires_for_build_sdist",
                                  "get_requires_for_build_editable"])  # fmt: skip
def test_a_frontends_first_question_already_has_the_version(hook: str, tmp_path: Path):
    """pip and ``build`` first ask what the build needs, and setuptools reads the version right then: in a fresh clone
    or an unpacked archive (no stamp yet) that question must stamp it, or the install fails before any build."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "buildsys", tree / "buildsys", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "_build_version.py"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    code = f"import sys; sys.path.insert(0, 'buildsys'); import version_backend as b; print(b.{hook}())"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    stamp = (tree / "src/sglang_dp_mtp_fix/_build_version.py").read_text()
    assert f'VERSION = "{_backend().release(tree)}"' in stamp  # no git, no archival: the release number alone
