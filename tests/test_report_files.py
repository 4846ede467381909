"""Report files (``SGLANG_DP_MTP_FIX_REPORT_DIR``): nothing is written unless configured; then exactly one file per
process, created safely (no link followed, nothing clobbered, mode 0644 or tighter), and a failure is one warning
(``auto``) or a stop (``strict``), never a crash.

The "writes nothing anywhere" checks run SGLang's own ``load_plugins()`` in a fresh process with a Python audit
hook that records every file opened for writing while a frame of this package is on the stack.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
from support import expected_status, last_json, requires_sglang, run_python

from sglang_dp_mtp_fix import report
from sglang_dp_mtp_fix.config import REPORT_DIR_ENV, Config, Mode
from sglang_dp_mtp_fix.core import Outcome, Status
from sglang_dp_mtp_fix.errors import ReportFileError

OUTCOMES = [Outcome("draft_graph_vote", Status.APPLIED, "checked")]


def write(directory: Path | str, **config: object) -> str | None:
    return report.write_report_file(OUTCOMES, Config(report_dir=str(directory), **config))  # type: ignore[arg-type]


def test_unset_writes_nothing():
    assert report.write_report_file(OUTCOMES, Config()) is None


def test_one_file_with_its_name_content_and_mode(tmp_path):
    path = write(tmp_path, mode=Mode.STRICT)
    assert path == str(tmp_path / report.report_file_name()) and os.listdir(tmp_path) == [report.report_file_name()]
    assert re.fullmatch(
        rf"sglang-dp-mtp-fix-[A-Za-z0-9._-]+-{os.getpid()}-[0-9a-f]{{8}}\.json", report.report_file_name()
    )
    data = json.loads(Path(path).read_text())
    assert data["plugin_version"] and data["sglang_version"] and data["pid"] == os.getpid()
    assert data["config"]["mode"] == "strict" and data["config"]["report_dir"] == str(tmp_path)
    assert data["patches"] == [o.as_dict() for o in OUTCOMES]
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    assert mode & ~0o644 == 0, oct(mode)
    assert stat.S_ISREG(os.lstat(path).st_mode)


def test_a_link_planted_at_the_file_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / report.report_file_name()).symlink_to(victim)
    with pytest.raises(ReportFileError, match="already exists"):
        write(reports)
    assert victim.read_text() == "keep me" and (reports / report.report_file_name()).is_symlink()
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / report.report_file_name()).symlink_to(tmp_path / "would-be-created")
    with pytest.raises(ReportFileError, match="already exists"):
        write(dangling)
    assert not (tmp_path / "would-be-created").exists()


def test_an_existing_file_is_never_clobbered(tmp_path):
    (tmp_path / report.report_file_name()).write_text("another process's report")
    with pytest.raises(ReportFileError, match="already exists"):
        write(tmp_path)
    assert (tmp_path / report.report_file_name()).read_text() == "another process's report"


def test_a_symlinked_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ReportFileError, match="symbolic link"):
        write(tmp_path / "link")
    assert os.listdir(real) == []


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_missing_directory_or_a_file_is_refused_and_nothing_is_created(tmp_path, kind):
    target = tmp_path / "reports"
    if kind == "a file":
        target.write_text("")
    with pytest.raises(ReportFileError, match=REPORT_DIR_ENV):
        write(target)
    assert os.listdir(tmp_path) == ([] if kind == "missing" else ["reports"])


def test_an_unwritable_directory_is_an_error_not_a_crash(tmp_path, monkeypatch):
    reports = tmp_path / "reports"
    reports.mkdir()
    reports.chmod(0o555)
    if os.access(reports, os.W_OK):
        # STAND-IN: root ignores directory permissions; the kernel's answer for a non-root user is simulated.
        real_open = os.open

        def refusing_open(path, flags, mode=0o777, *, dir_fd=None):
            if dir_fd is not None and flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied")
            return real_open(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(report.os, "open", refusing_open)
    try:
        with pytest.raises(ReportFileError, match="cannot create .*Permission denied"):
            write(reports)
    finally:
        reports.chmod(0o755)
    assert os.listdir(reports) == []


# -- through SGLang's load_plugins() in fresh processes ----------------------------------------------------------

AUDITED_LOAD = """
import json, os, sys, sysconfig
WRITES = []
STDLIB = sysconfig.get_paths()["stdlib"]
def audit(event, args):
    if event != "open":
        return
    path, mode, flags = args
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if not writing:
        return
    # The code that asked for the write: the innermost frame outside the standard library and frozen importlib
    # (SGLang's or torch's own import-time writes, e.g. to /dev/null or ~/.cache, are theirs, not the plugin's).
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith((STDLIB, "<"))):
        frame = frame.f_back
    if frame is not None and "sglang_dp_mtp_fix" in frame.f_code.co_filename:
        WRITES.append(str(path))
sys.addaudithook(audit)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_dp_mtp_fix import plugin
statuses = {o.id: o.status.value for o in plugin.get_manager().outcomes or []}
print(json.dumps({"writes": WRITES, "statuses": statuses}))
"""


def load(tmp_path: Path, **env: str):
    # the working directory is tmp_path, so a stray relative write would also land where the test can see it
    base = {"SGLANG_PLUGINS": "dp_mtp_fix"}
    proc = run_python(f"import os; os.chdir({str(tmp_path)!r})\n" + AUDITED_LOAD, {**base, **env})
    return proc, (last_json(proc.stdout) if proc.returncode == 0 else None)


@requires_sglang
def test_unset_the_plugin_writes_no_file_anywhere(tmp_path):
    proc, out = load(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["writes"] == [] and expected_status() in out["statuses"].values()
    assert os.listdir(tmp_path) == []


@requires_sglang
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_set_exactly_one_file_is_written(tmp_path, mode):
    reports = tmp_path / "reports"
    reports.mkdir()
    proc, out = load(tmp_path, SGLANG_DP_MTP_FIX_REPORT_DIR=str(reports), SGLANG_DP_MTP_FIX=mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = os.listdir(reports)
    assert len(files) == 1 and out["writes"] == [files[0]], (files, out)
    data = json.loads((reports / files[0]).read_text())
    assert {p["id"]: p["status"] for p in data["patches"]} == out["statuses"]  # what this process decided
    assert (
        set(out["statuses"].values()) == {"disabled"}
        if mode == "off"
        else expected_status() in out["statuses"].values()
    )
    assert sorted(os.listdir(tmp_path)) == ["reports"]


@requires_sglang
def test_a_write_failure_is_one_warning_in_auto_and_a_stop_in_strict(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    proc, out = load(tmp_path, SGLANG_DP_MTP_FIX_REPORT_DIR=missing)
    assert proc.returncode == 0 and expected_status() in out["statuses"].values(), proc.stderr[-3000:]
    assert "unsupported" not in out["statuses"].values()
    lines = [line for line in proc.stderr.splitlines() if "report file not written" in line]
    assert len(lines) == 1 and missing in lines[0], proc.stderr[-2000:]
    proc, _ = load(tmp_path, SGLANG_DP_MTP_FIX_REPORT_DIR=missing, SGLANG_DP_MTP_FIX="strict")
    assert proc.returncode != 0 and "report file not written" in proc.stderr and "strict: stopping" in proc.stderr


@requires_sglang
def test_a_relative_directory_is_bad_input(tmp_path):
    proc, out = load(tmp_path, SGLANG_DP_MTP_FIX_REPORT_DIR="reports")
    assert proc.returncode == 0 and set(out["statuses"].values()) == {"unsupported"}
    lines = [line for line in proc.stderr.splitlines() if "SGLang left stock" in line]
    assert len(lines) == 1 and REPORT_DIR_ENV in lines[0] and "absolute" in lines[0]
    assert out["writes"] == [] and os.listdir(tmp_path) == []


def test_the_problem_line_names_the_root_cause_from_the_outcome_fields():
    """The root cause is the first patch held back by its own problem (``held_back``), whatever its reason says;
    a patch held back by another is named only when no root cause is listed."""
    from sglang_dp_mtp_fix.core import HeldBack

    held = Outcome("a", Status.UNSUPPORTED, "its group member b is unsupported", HeldBack.GROUP_MEMBER, "b")
    root = Outcome("b", Status.UNSUPPORTED, "not applied: words that read like another's", HeldBack.OWN_CHECK)
    line = report.problem_line([held, root], Config())
    assert line == "sglang-dp-mtp-fix: SGLang left stock: b: not applied: words that read like another's"
    assert report.problem_line([held], Config()) == f"sglang-dp-mtp-fix: SGLang left stock: a: {held.reason}"
    assert json.loads(json.dumps(held.as_dict())) == {
        "id": "a",
        "status": "unsupported",
        "reason": held.reason,
        "held_back": "group-member",
        "blocked_by": "b",
    }


def test_a_report_write_that_fails_leaves_no_file(tmp_path, monkeypatch):
    """Before: a full disk left a 0-byte report file behind the error."""
    import errno

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)  # STAND-IN: a full disk at the report's first write
    with pytest.raises(ReportFileError, match="No space left"):
        report.write_report_file([], Config(report_dir=str(tmp_path)))
    assert os.listdir(tmp_path) == []
