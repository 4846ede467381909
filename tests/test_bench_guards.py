"""The benchmarks refuse to measure something other than what they report (fast: no SGLang is imported).

``bench/ab_activation.py`` compares an older checkout ("before", ``BEFORE_SRC``) with this one ("after"); when the
before arm would import the same package as the after arm, it must exit before measuring, not report an A/A run as
an A/B. ``REPEATS`` 0 runs only that check, and the compilation of both arms that precedes any measurement."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AB = ROOT / "bench" / "ab_activation.py"


def _env(before_src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DP_MTP_FIX")}
    return {**env, "BEFORE_SRC": str(before_src)}


def _ab(before_src: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(AB), "0"],
        env={**_env(before_src), **extra_env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/tmp",
    )


def _installed_src() -> Path:
    """The directory the after arm imports the plugin from."""
    import sglang_dp_mtp_fix

    return Path(os.path.realpath(sglang_dp_mtp_fix.__file__)).parent.parent


def test_missing_before_path_is_refused(tmp_path):
    proc = _ab(tmp_path / "no-such-checkout" / "src")
    assert proc.returncode != 0, proc.stdout
    assert "BEFORE_SRC" in proc.stderr and "does not exist" in proc.stderr, proc.stderr


def test_before_path_that_resolves_to_the_installed_package_is_refused():
    proc = _ab(_installed_src())
    assert proc.returncode != 0, proc.stdout
    assert "A/A" in proc.stderr, proc.stderr


def test_before_path_without_the_package_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    proc = _ab(tmp_path / "src")
    assert proc.returncode != 0, proc.stdout
    assert "A/A" in proc.stderr, proc.stderr


def test_an_older_checkout_passes_the_check(tmp_path):
    shutil.copytree(_installed_src() / "sglang_dp_mtp_fix", tmp_path / "src" / "sglang_dp_mtp_fix")
    proc = _ab(tmp_path / "src")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "{}"


def test_an_arm_without_bytecode_is_compiled_before_measuring(tmp_path):
    # A fresh `git archive` has no bytecode and PYTHONDONTWRITEBYTECODE=1 keeps an import from writing it: every
    # measured process would then compile the arm's sources inside its figure, as pip's install-time compile avoids.
    package = tmp_path / "src" / "sglang_dp_mtp_fix"
    shutil.copytree(_installed_src() / "sglang_dp_mtp_fix", package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = _ab(tmp_path / "src", PYTHONDONTWRITEBYTECODE="1")
    assert proc.returncode == 0, proc.stderr
    assert list(package.glob("__pycache__/plugin.*.pyc")), "the before arm was measured from source"
