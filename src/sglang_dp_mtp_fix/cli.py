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
import json
import math
import re
import sys

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.doctor import doctor_lines, doctor_report
from sglang_dp_mtp_fix.doctor import entry_point_selected as entry_point_selected  # re-exported: its old home
from sglang_dp_mtp_fix.harness import fuzz
from sglang_dp_mtp_fix.rollcall import escape


def _settle_seconds(raw: str) -> float:
    from sglang_dp_mtp_fix.rollcall import MAX_SETTLE_S

    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_SETTLE_S:  # NaN fails both
        raise argparse.ArgumentTypeError(f"{raw!r} is not seconds from 0 to {MAX_SETTLE_S:g}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-dp-mtp-fix", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command")
    doc = sub.add_parser("doctor", help="report what the plugin would do here (no GPU, SGLang not started)")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    sim = sub.add_parser("simulate", help="reproduce the hang and the fix on CPU ranks, stock vs patched")
    sim.add_argument("--ranks", type=int, default=None, help="DP ranks, 2-8 (default 4, or the trace's width)")
    sim.add_argument("--rounds", type=int, default=2000, help="decode rounds of the embedded trace (default 2000)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the embedded trace (default 0)")
    sim.add_argument("--trace", type=str, default=None, help="JSON-lines trace file (schema: docs/simulate.md)")
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
        type=_settle_seconds,
        default=1.5,
        metavar="S",
        help="watch the ranks' heartbeats and rounds this long before judging (0 to 600, default 1.5; a rank not seen "
        "ticking is watched up to 5 s; 0: not watched, no stall judged, e.g. for copied files)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
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
    from sglang_dp_mtp_fix.harness.pool import RankError

    ranks = args.ranks if args.ranks is not None else (None if args.trace else 4)
    if ranks is not None and not 2 <= ranks <= 8:
        parser.error(f"--ranks must be between 2 and 8 (got {ranks})")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.trace and not Path(args.trace).is_file():
        parser.error(f"--trace {args.trace}: no such file")
    trace = Path(args.trace) if args.trace else None
    backends = fuzz.backend_pair(args)
    try:
        data = simulate.simulate(
            ranks or 0,
            args.rounds,
            args.seed,
            trace,
            progress=not args.json,
            unguarded=args.unguarded,
            backends=backends,
        )
    except RankError as exc:
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
