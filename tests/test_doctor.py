"""``sglang-dp-mtp-fix doctor [--json]`` on the installed release: statuses, reasons, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from releases import SGLANG_VERSION
from support import expected_status, expected_statuses, requires_sglang, run_cli, run_python

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


# "," and " " (what a template leaves): SGLang reads a non-empty value as a list, here an empty one, and loads nothing
@pytest.mark.parametrize(
    "env",
    [{"SGLANG_DP_MTP_FIX": "off"}, {"SGLANG_PLUGINS": "other"}, {"SGLANG_PLUGINS": ","}, {"SGLANG_PLUGINS": " "}],
)
def test_affected_but_not_patched_exits_1(env):
    proc = doctor("--json", **env)
    assert proc.returncode == (1 if expected_status() == "applied" else 0), proc.stdout


MISSING = "/nonexistent-sglang-dp-mtp-fix-dir"


def cases(tmp: str) -> list[tuple[dict[str, str], int, str, list[str]]]:
    """(environment, exit code, the verdict's words, words of other lines): what the launch would do, said."""
    applied = expected_status() == "applied"
    records = applied or expected_statuses()["upstream_vote_watch"] == "applied"
    return [
        # Before: "mode: auto" above the error, the error again on each patch's line, no verdict.
        ({"SGLANG_DP_MTP_FIX": "bogus"}, 2, "configuration error: SGLang is left stock at launch (auto)",
         ["mode:         not read", "patches:      none applied (bad configuration, above)"]),
        # Before: "mode: auto", "the fix will be applied", exit 0; the kill switch is SGLANG_DP_MTP_FIX=off.
        ({"SGLANG_DP_MTP_FIX_MODE": "off"}, 2, "configuration error: 1 unknown variable(s), ignored",
         ["UNKNOWN:      SGLANG_DP_MTP_FIX_MODE='off' is ignored (did you mean SGLANG_DP_MTP_FIX?)"]),
        ({"SGLANG_DP_MTP_FIX": "strict", "SGLANG_DP_MTP_FIX_MODE": "off"}, 2, "the launch stops (strict)",
         ["CONFIG ERROR: unknown variable(s) ignored: SGLANG_DP_MTP_FIX_MODE"]),
        # Before: "the fix will be applied" (exit 0) for a launch that stops at load.
        ({"SGLANG_DP_MTP_FIX": "strict", "SGLANG_DP_MTP_FIX_RECORDER_DIR": MISSING}, 2 if records else 0,
         "the launch stops (strict): SGLANG_DP_MTP_FIX_RECORDER_DIR" if records else "",
         [f"DIRECTORY:    SGLANG_DP_MTP_FIX_RECORDER_DIR directory '{MISSING}': No such file" if records else ""]),
        ({"SGLANG_DP_MTP_FIX_REPORT_DIR": MISSING}, 2,
         "configuration error: SGLANG_DP_MTP_FIX_REPORT_DIR: the launch goes on with no report files", []),
        # Before (issue 54, lower-harm): "SGLANG_DP_MTP_FIX_REPORT_DIR=<the path without its space>", not what was typed
        ({"SGLANG_DP_MTP_FIX_REPORT_DIR": f"{MISSING} "}, 2,
         "configuration error: SGLANG_DP_MTP_FIX_REPORT_DIR: the launch goes on with no report files",
         [f"SGLANG_DP_MTP_FIX_REPORT_DIR    '{MISSING} ' -> {MISSING}",
          f"DIRECTORY:    SGLANG_DP_MTP_FIX_REPORT_DIR directory '{MISSING}': No such file"]),
        ({"SGLANG_DP_MTP_FIX": "strict", "SGLANG_DP_MTP_FIX_REPORT_DIR": "/proc/sys"}, 2,
         "the launch stops (strict): SGLANG_DP_MTP_FIX_REPORT_DIR", ["cannot create a file there"]),
        # Before: neither variable shown.
        ({"SGLANG_DP_MTP_FIX_RECORDER_DIR": tmp, "SGLANG_DP_MTP_FIX_STALL_S": "15", "SGLANG_DP_MTP_FIX_STATS": "50",
          "SGLANG_DP_MTP_FIX_METRICS": "off"}, 0, "",
         [f"SGLANG_DP_MTP_FIX_RECORDER_DIR  '{tmp}' -> {tmp}", "SGLANG_DP_MTP_FIX_STALL_S       '15' -> stall line "
          "after 15 s", "SGLANG_DP_MTP_FIX_STATS         '50' -> vote counters logged every 50 decode batches",
          "SGLANG_DP_MTP_FIX_METRICS       'off' -> off", "SGLANG_DP_MTP_FIX_REPORT_DIR    unset -> no report files"]),
    ]  # fmt: skip


def test_doctor_checks_what_the_launch_checks(tmp_path):
    """Every case in one pristine child (one SGLang import): the verdict, the exit code and the lines."""
    table = cases(str(tmp_path))
    code = textwrap.dedent(f"""
        import contextlib, io, json, os
        from sglang_dp_mtp_fix.cli import main
        got = []
        for env in {[env for env, *_ in table]!r}:
            os.environ.update(env)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = main(["doctor"])
            got.append([rc, out.getvalue()])
            for name in env:
                del os.environ[name]
        print(json.dumps(got))
    """)
    proc = run_python(code, drop_prefixes=("SGLANG_",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (env, want_rc, verdict, words), (rc, out) in zip(table, last_json_list(proc.stdout), strict=True):
        (line,) = [x for x in out.splitlines() if x.startswith("  verdict:      ")]
        assert rc == want_rc and verdict in line, (env, rc, out)
        assert all(w in out for w in words), (env, out)
        assert out.count("SGLANG_DP_MTP_FIX='bogus'") <= 2, out  # the value and the error, never once per patch


def last_json_list(stdout: str) -> list:
    return json.loads(stdout.strip().splitlines()[-1])


# STAND-IN: os.statvfs says the directory's filesystem is full: this test runs doctor in-process, and a real full
# filesystem needs a mount of its own (test_recorder.py makes one in a private mount namespace, in a child).
# (f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, f_files, f_ffree, f_favail, f_flag, f_namemax)
FULL = os.statvfs_result((4096, 4096, 262144, 0, 0, 65536, 60000, 60000, 0, 255))


@requires_sglang
@pytest.mark.parametrize(
    ("env", "want_rc", "verdict"),
    [
        (
            {"SGLANG_DP_MTP_FIX": "strict", "SGLANG_DP_MTP_FIX_REPORT_DIR": "{d}"},
            2,
            "the launch stops (strict): SGLANG_DP_MTP_FIX_REPORT_DIR",
        ),
        (
            {"SGLANG_DP_MTP_FIX_RECORDER_DIR": "{d}"},
            2,
            "SGLANG_DP_MTP_FIX_RECORDER_DIR: the launch goes on with no flight recorder",
        ),
    ],  # fmt: skip
    ids=["strict-report-dir", "recorder-dir"],
)
def test_a_directory_on_a_full_filesystem_is_a_problem(env, want_rc, verdict, tmp_path, monkeypatch, capsys):
    """Before: doctor said the fix would be applied (exit 0), and a strict launch stopped at its report write."""
    from sglang_dp_mtp_fix.cli import main

    if "RECORDER" in verdict and expected_statuses().get("draft_graph_vote") != "applied":
        pytest.skip(f"nothing records on SGLang {SGLANG_VERSION}: the recorder directory is not checked")
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: FULL if os.fspath(p) == str(tmp_path) else real(p))
    for name in [n for n in os.environ if n.startswith("SGLANG_DP_MTP_FIX")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(d=tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", "dp_mtp_fix")
    capsys.readouterr()
    rc = main(["doctor"])
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("  verdict:      ")]
    assert rc == want_rc and verdict in line, out
    name = next(iter(env.keys() - {"SGLANG_DP_MTP_FIX"}))
    assert f"DIRECTORY:    {name} directory '{tmp_path}': its filesystem is full" in out
