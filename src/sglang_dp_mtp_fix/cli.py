"""Command line: ``sglang-dp-mtp-fix doctor [--json]``, ``simulate``, ``rollcall DIR [DIR ...] [--json]``.

``doctor`` (``doctor``) runs the plugin's own checks and the launch's without a GPU and without starting SGLang, and
reports what ``load_plugins()`` would do in this environment. Exit codes: 0 fixed or not affected; 1 an affected
install would not be patched; 2 usage or configuration error (the verdict says whether the launch stops).

``rollcall`` reads the flight-recorder files (``SGLANG_DP_MTP_FIX_RECORDER_DIR``) of every rank and names the first
round where ranks decided differently (``recorder``). Exit codes: 0 all agree; 1 a divergence, or a rank without a
file; 2 unreadable or incompatible files.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import math
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.doctor import doctor_lines, doctor_report
from sglang_dp_mtp_fix.harness import fuzz
from sglang_dp_mtp_fix.rollcall import escape

if TYPE_CHECKING:
    from _typeshed import SupportsWrite


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit 2 (argparse's usage block is ``--help``'s). A failed write of
    ``--help``/``--version`` reaches ``main`` (argparse's own ``_print_message`` swallows it: ``--help > /dev/full``
    exited 0 with nothing written)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if message:
            (file or sys.stderr).write(message)


def _bounded(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` from ``low`` to ``high`` (NaN and infinities refused)."""

    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # NaN fails both
            what = f"an integer from {low} to {high}" if kind is int else f"a number from {low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    from sglang_dp_mtp_fix import simulate
    from sglang_dp_mtp_fix.rollcall import MAX_SETTLE_S

    parser = _Parser(prog="sglang-dp-mtp-fix", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command")
    doc = sub.add_parser("doctor", help="report what the plugin would do here (no GPU, SGLang not started)")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    sim = sub.add_parser("simulate", help="reproduce the hang and the fix on CPU ranks, stock vs patched")
    low, high = simulate.MIN_RANKS, simulate.MAX_RANKS
    sim.add_argument(
        "--ranks",
        type=_bounded(int, low, high),
        default=None,
        help=f"DP ranks, {low}-{high} (default 4, or the trace's width)",
    )
    sim.add_argument(
        "--rounds",
        type=_bounded(int, 1, simulate.MAX_ROUNDS),
        default=2000,
        help=f"decode rounds of the embedded trace, 1-{simulate.MAX_ROUNDS} (default 2000)",
    )
    sim.add_argument(
        "--seed", type=_bounded(int, 0, 2**63 - 1), default=0, help="seed of the embedded trace, 0-2^63-1 (default 0)"
    )
    sim.add_argument(
        "--trace",
        type=str,
        default=None,
        help=f"JSON-lines trace file (schema: docs/simulate.md): {low}-{high} ranks, up to {simulate.MAX_ROUNDS} "
        f"rounds, num_reqs 1-{simulate.MAX_NUM_REQS}; checked whole before any rank starts",
    )
    sim.add_argument("--json", action="store_true", help="machine-readable output")
    fuzz.add_backend_arguments(sim)
    sim.add_argument(
        "--unguarded",
        action="store_true",
        help="also issue the first split round's collectives for real (the ranks abort or time out), per arm",
    )
    roll = sub.add_parser("rollcall", help="name the first round where DP ranks decided differently (flight recorder)")
    roll.add_argument("dirs", nargs="+", metavar="DIR", help="recorder directories (every node's, copied together)")
    roll.add_argument("--json", action="store_true", help="machine-readable output")
    roll.add_argument(
        "--settle",
        type=_bounded(float, 0, MAX_SETTLE_S),
        default=1.5,
        metavar="S",
        help="watch the ranks' heartbeats and rounds this long before judging (0 to 600, default 1.5; a rank not seen "
        "ticking is watched up to 5 s; 0: not watched, no stall judged, e.g. for copied files)",
    )
    return parser


# sysexits.h EX_IOERR: the answer could not be written (a full disk, a quota, an I/O error on the output). Apart from
# 1 (not patched; a divergence) so that a script never reads a lost answer as one.
OUTPUT_FAILED = 74
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def _flush_stdout() -> None:
    if sys.stdout is not None:  # None: started with stdout closed (``>&-``); print() then writes nothing
        sys.stdout.flush()  # a closed pipe or a full disk shows here, not at the interpreter's exit


def main(argv: list[str] | None = None) -> int:
    """The console script. A closed pipe (``| head``) and Ctrl-C end quietly with the shell's codes (141, 130); an
    output that cannot be written (``> /dev/full``) is one line on stderr and OUTPUT_FAILED."""
    for stream in (sys.stdout, sys.stderr):  # an ASCII terminal gets escapes, never a UnicodeEncodeError
        if isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, io.UnsupportedOperation):
                stream.reconfigure(errors="backslashreplace")
    try:
        try:
            code = _main(argv)
        except SystemExit as exc:  # argparse (--help, --version, a bad argument)
            code = exc.code if isinstance(exc.code, int) else (2 if exc.code else 0)
        _flush_stdout()
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except OSError as exc:
        if exc.errno not in OUTPUT_ERRNOS:
            raise
        _stdout_to_devnull()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            print(f"sglang-dp-mtp-fix: cannot write the output: {exc.strerror}", file=sys.stderr)
        return OUTPUT_FAILED


def _stdout_to_devnull() -> None:
    """Nothing more to flush at exit (the interpreter would report the same failure again)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "doctor":
        data, code = doctor_report()
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            for line in doctor_lines(data):
                print(escape(line))
        return code
    if args.command == "simulate":
        return _simulate(args, parser)
    if args.command == "rollcall":
        from sglang_dp_mtp_fix import rollcall

        data, code = rollcall.rollcall(args.dirs, settle_s=args.settle)
        if args.json:
            print(rollcall.rollcall_json(data))
        else:
            rollcall.print_rollcall(data)
        return code
    return 2


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from sglang_dp_mtp_fix import simulate
    from sglang_dp_mtp_fix.config import load_config
    from sglang_dp_mtp_fix.harness.pool import RankError
    from sglang_dp_mtp_fix.patches import PATCH_IDS

    config_error = load_config(PATCH_IDS).error  # the ranks load the plugin under this environment
    if config_error:  # else the patched arm "stands down on SGLang X", which reads like the release's doing
        parser.error(escape(f"{config_error} (the plugin's settings here, which the patched arm runs under)"))
    ranks = args.ranks if args.ranks is not None else (None if args.trace else 4)
    trace = None
    if args.trace:
        if not Path(args.trace).is_file():
            parser.error(escape(f"--trace {args.trace}: no such file"))
        try:
            trace = simulate.load_trace(Path(args.trace), ranks)  # the whole trace, before any rank starts
        except simulate.TraceError as exc:
            parser.error(escape(f"--trace {exc}"))  # the file's own text, never raw to a terminal
    backends = fuzz.backend_pair(args)
    try:
        data = simulate.simulate(
            ranks or 0,
            args.rounds,
            args.seed,
            Path(args.trace) if args.trace else None,
            progress=not args.json,
            unguarded=args.unguarded,
            backends=backends,
            trace=trace,
        )
    except RankError as exc:
        if exc.error_type == "StrictModeAbort":  # what a launch under these settings does too (doctor: exit 2)
            print(f"simulate: the patched arm's ranks stopped, as a launch would: {escape(exc.error or '')}",
                  file=sys.stderr)  # fmt: skip
            return 2
        if backends is None:
            raise
        # e.g. 0.5.23 validates the built EP group against the re-published ServerArgs (the harness builds EP 1)
        lines = str(exc).strip().splitlines()
        error = [i for i, line in enumerate(lines) if re.match(r"[\w.]+(Error|Exception)\b", line)]
        last = " ".join(line.strip() for line in lines[error[-1] if error else -1 :])
        print(
            f"simulate: the ranks could not run --moe-a2a-backend {backends[0]} --speculative-moe-a2a-backend "
            f"{backends[1]} on this SGLang: {last}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(data))
    else:
        simulate.print_table(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
