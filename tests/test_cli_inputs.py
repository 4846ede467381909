"""Every command-line input the CLI refuses: exit 2, one line on stderr, no traceback (issue 45). In-process, through
the console script's ``main``; a closed pipe and Ctrl-C in a child process (they need a real pipe and a signal)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from support import release_free

from sglang_dp_mtp_fix import cli, simulate

TWO = '{"ranks": [{"kind": "decode"}, {"kind": "none"}]}'
THREE = '{"ranks": [{}, {}, {}]}'


def trace(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def state(**fields: object) -> str:
    return json.dumps({"ranks": [{"kind": "decode", **fields}, {"kind": "idle"}]})


# (id, argv, a trace file's content for {trace} or None, words the one line must hold). Each was a traceback, a hang,
# a silent wrong reading or a multi-line usage block before (the sweep).
CASES = [
    ("doctor-unknown-flag", ["doctor", "--bogus"], None, "unrecognized arguments: --bogus"),
    ("no-such-command", ["bogus"], None, "invalid choice: 'bogus'"),
    ("ranks-1", ["simulate", "--ranks", "1"], None, "--ranks: '1' is not an integer from 2 to 8"),
    ("ranks-9", ["simulate", "--ranks", "9"], None, "--ranks: '9' is not an integer from 2 to 8"),
    ("rounds-0", ["simulate", "--rounds", "0"], None, "--rounds: '0' is not an integer from 1 to 100000"),
    ("rounds-huge", ["simulate", "--rounds", "100000000"], None, "from 1 to 100000"),
    ("rounds-float", ["simulate", "--rounds", "1e9"], None, "--rounds: '1e9' is not an integer"),
    ("seed-no", ["simulate", "--seed", "no"], None, "--seed: 'no' is not an integer"),
    ("seed-negative", ["simulate", "--seed", "-1"], None, "--seed: '-1' is not an integer"),
    ("trace-missing", ["simulate", "--trace", "/nonexistent/trace.jsonl"], None, "no such file"),
    ("trace-not-utf8", ["simulate", "--trace", "{trace}"], b"\xff\xfe\x00{", "not UTF-8 text"),
    ("trace-null", ["simulate", "--trace", "{trace}"], b"null\n", 'expected {"ranks": [STATE, ...]}'),
    ("trace-5", ["simulate", "--trace", "{trace}"], b"5\n", 'expected {"ranks": [STATE, ...]}'),
    ("trace-list", ["simulate", "--trace", "{trace}"], b"[5, 6]\n", 'expected {"ranks": [STATE, ...]}'),
    ("trace-ranks-5", ["simulate", "--trace", "{trace}"], b'{"ranks": 5}\n', 'expected {"ranks": [STATE, ...]}'),
    ("trace-no-ranks", ["simulate", "--trace", "{trace}"], b'{"ranks": []}\n', "0 rank states; simulate runs 2 to 8"),
    ("trace-state-5", ["simulate", "--trace", "{trace}"], b'{"ranks": [5, 6]}\n', "a rank state is a JSON object"),
    ("trace-1-rank", ["simulate", "--trace", "{trace}"], b'{"ranks": [{}]}\n', "1 rank states; simulate runs 2 to 8"),
    ("trace-9-ranks", ["simulate", "--trace", "{trace}"], trace(json.dumps({"ranks": [{}] * 9})), "9 rank states"),
    ("trace-seed-no", ["simulate", "--trace", "{trace}"], trace(state(seed="no")), 'seed "no" is not true or false'),
    ("trace-reqs-x", ["simulate", "--trace", "{trace}"], trace(state(num_reqs="x")), 'num_reqs "x" is not an integer'),
    ("trace-reqs-neg", ["simulate", "--trace", "{trace}"], trace(state(num_reqs=-3)), "num_reqs -3 is not an integer"),
    ("trace-reqs-1e8", ["simulate", "--trace", "{trace}"], trace(state(num_reqs=10**8)), "from 1 to 1024"),
    ("trace-reqs-bool", ["simulate", "--trace", "{trace}"], trace(state(num_reqs=True)), "num_reqs true"),
    ("trace-flag-x", ["simulate", "--trace", "{trace}"], trace(state(future_flag="x")), "future_flag"),
    ("trace-kind", ["simulate", "--trace", "{trace}"], trace(state(kind="prefill")), "kind \"prefill\" is not"),
    ("trace-key", ["simulate", "--trace", "{trace}"], trace(state(sed=True)), "bad rank state of rank 0: unknown"),
    ("trace-widths", ["simulate", "--trace", "{trace}"], trace(TWO, THREE), "3 ranks, earlier"),
    ("trace-empty", ["simulate", "--trace", "{trace}"], b"\n\n", "empty trace"),
    ("trace-not-json", ["simulate", "--trace", "{trace}"], b"{ranks\n", "not JSON"),
    ("trace-deep", ["simulate", "--trace", "{trace}"], b"[" * 10**5 + b"]" * 10**5, "not JSON (maximum recursion"),
    ("trace-vs-ranks", ["simulate", "--ranks", "3", "--trace", "{trace}"], trace(TWO), "--ranks says 3"),
    ("settle-inf", ["rollcall", "--settle", "inf", "/x"], None, "--settle: 'inf' is not a number from 0 to 600"),
    ("settle-nan", ["rollcall", "--settle", "nan", "/x"], None, "--settle: 'nan' is not a number"),
    ("settle-negative", ["rollcall", "--settle", "-1", "/x"], None, "--settle: '-1' is not a number"),
    ("settle-huge", ["rollcall", "--settle", "1e9", "/x"], None, "--settle: '1e9' is not a number"),
    ("rollcall-no-dir", ["rollcall"], None, "the following arguments are required: DIR"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "content", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_refused_input_is_one_line_and_exit_2(tmp_path, capsys, argv, content, words):
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_bytes(content)
    code = cli.main([a.replace("{trace}", str(path)) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err and words in err, err


def test_help_shows_the_bounds(capsys):
    assert cli.main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "2-8 (default 4" in text and f"1-{simulate.MAX_ROUNDS} (default 2000)" in text
    assert f"num_reqs 1-{simulate.MAX_NUM_REQS}" in text and "checked whole before any rank starts" in text
    assert cli.main(["rollcall", "--help"]) == 0
    assert "0 to 600" in capsys.readouterr().out


READY = """
import sys
from sglang_dp_mtp_fix.cli import main
print("ready", file=sys.stderr, flush=True)
sys.exit(main(sys.argv[1:]))
"""


def child(args: list[str], **kwargs: object) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(READY), *args], stderr=subprocess.PIPE, **kwargs)
    assert proc.stderr is not None and proc.stderr.readline() == b"ready\n"
    return proc


@release_free
def test_ctrl_c_and_a_closed_pipe_end_quietly_with_the_shells_codes(tmp_path):
    """Before: a KeyboardInterrupt traceback (Ctrl-C), and a BrokenPipeError traceback with exit 1 (``| head``), which
    means something else in both commands."""
    from diagnosis.test_recorder import GRAPH, write_rank

    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    proc = child(["rollcall", "--settle", "30", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        assert proc.wait(0.5) is None
    except subprocess.TimeoutExpired:
        pass  # watching its 30 s
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130 and proc.stderr.read() == b""
    reader, writer = os.pipe()
    os.close(reader)  # `| head` that has gone
    proc = child(["rollcall", "--settle", "0", str(tmp_path)], stdout=writer)
    os.close(writer)
    assert proc.wait(30) == 141 and proc.stderr.read() == b""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_ctrl_c_while_the_cli_loads_is_exit_130_without_a_traceback(monkeypatch):
    """Issue 54 (lower-harm): the console script imported ``cli`` before ``cli.main``'s Ctrl-C handling existed, so a
    Ctrl-C in those ~0.1 s was a KeyboardInterrupt traceback. The script's own target, as pyproject.toml declares it."""
    import importlib
    import importlib.abc
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, attr = pyproject["project"]["scripts"]["sglang-dp-mtp-fix"].split(":")

    class CtrlC(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object, target: object = None) -> None:
            if name == "sglang_dp_mtp_fix.doctor":  # STAND-IN: the moment SIGINT lands, made exact (no timing)
                raise KeyboardInterrupt
            return None

    for name in ("sglang_dp_mtp_fix.cli", "sglang_dp_mtp_fix.doctor", module):
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [CtrlC(), *sys.meta_path])
    monkeypatch.setattr(sys, "argv", ["sglang-dp-mtp-fix", "--version"])
    try:
        assert getattr(importlib.import_module(module), attr)() == 130
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt reached the script wrapper (a traceback)")


def test_a_trace_is_checked_whole_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Before: a bad state in a later line came from inside a rank, after the ranks had started."""
    from sglang_dp_mtp_fix.harness import pool

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank started")

    monkeypatch.setattr(pool, "RankPool", never)
    path = tmp_path / "trace.jsonl"
    path.write_bytes(trace(*[TWO] * 500, state(num_reqs=-3)))
    assert cli.main(["simulate", "--trace", str(path)]) == 2
    assert f"{path}:501: bad rank state of rank 0: num_reqs -3" in capsys.readouterr().err


@release_free
def test_an_output_that_cannot_be_written_is_one_line_and_exit_74(tmp_path):
    """Before: ``--version``/``--help`` into /dev/full exit 0 with nothing written; ``rollcall > /dev/full`` a traceback
    and exit 1, which means "a divergence"."""
    from diagnosis.test_recorder import GRAPH, write_rank

    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    for args in (["--version"], ["--help"], ["rollcall", "--settle", "0", str(tmp_path)]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run(
                [shutil.which("sglang-dp-mtp-fix", path=os.path.dirname(sys.executable)) or "", *args],
                stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
            )  # fmt: skip
        assert proc.returncode == 74, (args, proc.returncode, proc.stderr)
        assert proc.stderr == "sglang-dp-mtp-fix: cannot write the output: No space left on device\n", proc.stderr


@release_free
def test_a_closed_stdout_and_an_ascii_terminal_answer_without_a_traceback(tmp_path):
    """Before: ``>&-`` gave AttributeError on flush; an ASCII stdout UnicodeEncodeError on a non-ASCII path."""
    from diagnosis.test_recorder import GRAPH, write_rank

    where = tmp_path / "réc\u202e"
    where.mkdir()
    for rank in range(2):
        write_rank(where, rank, 2, [GRAPH] * 3)
    empty = tmp_path / "vide\u202eé"  # rollcall names an empty directory
    empty.mkdir()
    exe = shutil.which("sglang-dp-mtp-fix", path=os.path.dirname(sys.executable)) or ""
    closed = subprocess.run(
        [exe, "rollcall", "--settle", "0", str(where)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        timeout=120, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr
    ascii_env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run([exe, "rollcall", "--settle", "0", str(empty)], capture_output=True, text=True, timeout=120,
                          env=ascii_env)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "\\u202e" in proc.stdout + proc.stderr and "\u202e" not in proc.stdout + proc.stderr, proc


def test_a_missing_trace_is_named_escaped(tmp_path, capsys):
    """Before: the path reached the terminal raw (a U+202E bidi override, C1 controls)."""
    path = tmp_path / "trace\u202e\x9b.jsonl"
    assert cli.main(["simulate", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "\u202e" not in err and "\x9b" not in err and "\\u202e" in err, err


def test_a_bad_plugin_setting_stops_simulate_before_any_rank_starts(capsys, monkeypatch):
    """Issue 54 (lower-harm): a bad SGLANG_DP_MTP_FIX ran both arms and said "the plugin stands down on SGLang
    0.5.20", which reads like the release's doing."""
    from sglang_dp_mtp_fix.harness import pool

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank started")

    monkeypatch.setattr(pool, "RankPool", never)
    monkeypatch.setenv("SGLANG_DP_MTP_FIX", "sometimes")
    assert cli.main(["simulate", "--rounds", "10"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "SGLANG_DP_MTP_FIX" in line and "sometimes" in line, line


def test_rollcall_json_names_a_non_utf8_directory_without_lone_surrogates(tmp_path, capsys):
    """Issue 54 (lower-harm): a non-UTF-8 path reached --json as lone surrogates ("\\udcff"), which strict readers
    refuse."""
    where = os.path.join(os.fsencode(tmp_path), b"rec\xff")
    os.mkdir(where)
    cli.main(["rollcall", "--json", "--settle", "0", os.fsdecode(where)])
    out = capsys.readouterr().out
    assert "\\udcff" not in out and "rec\\\\xff" in out, out
    json.loads(out)
    out.encode("utf-8")  # strict: every character encodable
