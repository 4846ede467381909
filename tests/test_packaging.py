"""Packaging promises: the entry point SGLang discovers, and no dependency that would re-resolve SGLang's stack."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points, requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_entry_point_is_registered():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dp_mtp_fix"]
    assert len(eps) == 1 and eps[0].value == "sglang_dp_mtp_fix.plugin:register"
    assert callable(eps[0].load())


def test_no_hard_dependency_on_sglang_torch_or_flashinfer():
    hard = [r for r in requires("sglang-dp-mtp-fix") or [] if "extra ==" not in r]
    assert not [r for r in hard if r.split()[0].lower().startswith(("sglang", "torch", "flashinfer"))], hard


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_pyproject_declares_sglang_only_as_an_extra():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []
    assert any(r.startswith("sglang") for r in project["optional-dependencies"]["sglang"])
    assert project["scripts"]["sglang-dp-mtp-fix"] == "sglang_dp_mtp_fix.console:main"
