"""``sglang-dp-mtp-fix doctor [--json]`` on the installed release: statuses, reasons, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from releases import SGLANG_VERSION
from support import expected_status, expected_statuses, requires_sglang, run_cli

pytestmark = requires_sglang


def doctor_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The installed console script, in a new interpreter (what an operator runs)."""
    exe = shutil.which("sglang-dp-mtp-fix", path=os.path.dirname(sys.executable))
    assert exe, "console script not installed"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    return subprocess.run([exe, "doctor", *args], env={**clean, **env}, capture_output=True, text=True, timeout=300)


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The console script's ``main`` in a pristine forked process (same code path, without a fresh SGLang import)."""
    return run_cli(["doctor", *args], env)


def test_json_shape_and_statuses():
    proc = doctor_cli("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    for key in ("sglang_version", "plugin_version", "mode", "entry_point_selected", "patches"):
        assert key in data
    assert data["sglang_version"] == SGLANG_VERSION and data["mode"] == "auto" and data["entry_point_selected"]
    assert data["peer_timeout_s"] == 120 and data["report_dir"] is None
    assert {p["id"]: p["status"] for p in data["patches"]} == expected_statuses()
    assert all(p["reason"] for p in data["patches"])


def test_text_output():
    proc = doctor()
    assert proc.returncode == 0 and "verdict:" in proc.stdout and SGLANG_VERSION in proc.stdout


def test_config_error_exits_2():
    proc = doctor("--json", SGLANG_DP_MTP_FIX="sometimes")
    assert proc.returncode == 2
    assert "SGLANG_DP_MTP_FIX" in json.loads(proc.stdout)["config_error"]


def test_usage_error_exits_2():
    assert doctor("--bogus").returncode == 2


@pytest.mark.parametrize("env", [{"SGLANG_DP_MTP_FIX": "off"}, {"SGLANG_PLUGINS": "someone_else"}])
def test_affected_but_not_patched_exits_1(env):
    proc = doctor("--json", **env)
    assert proc.returncode == (1 if expected_status() == "applied" else 0), proc.stdout
