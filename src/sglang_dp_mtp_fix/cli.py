"""Command line: ``sglang-dp-mtp-fix doctor [--json]``, ``simulate``, ``rollcall DIR [DIR ...] [--json]``.

``doctor`` runs the plugin's own checks without a GPU and without starting SGLang (it imports the target modules,
changes nothing) and reports what ``load_plugins()`` would do in this environment. For a deferred patch (applied when
its module is imported, e.g. the DSA patches) it imports that module in the doctor's own process and reports what the
post-import hook would decide ("applied when ... is imported", or why not); superseded checks read the source text.
Exit codes: 0 fixed or not affected; 1 an affected install would not be patched; 2 usage or configuration error.

``rollcall`` reads the flight-recorder files (``SGLANG_DP_MTP_FIX_RECORDER_DIR``) of every rank and names the first
round where ranks decided differently (``recorder``). Exit codes: 0 all agree; 1 a divergence, or a rank without a
file; 2 unreadable or incompatible files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from importlib.metadata import entry_points
from typing import Any

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import MODE_ENV, PEER_TIMEOUT_ENV, REPORT_DIR_ENV, SKIP_ENV, Config, Mode, load_config
from sglang_dp_mtp_fix.harness import fuzz

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "dp_mtp_fix"


def entry_point_selected(environ: dict[str, str] | None = None) -> tuple[bool, str]:
    """Would SGLang's ``load_plugins()`` run our entry point? (Same whitelist rule as SGLang.)"""
    env = os.environ if environ is None else environ
    installed = any(ep.name == ENTRY_POINT_NAME for ep in entry_points(group=ENTRY_POINT_GROUP))
    if not installed:
        return False, f"entry point {ENTRY_POINT_NAME!r} is not installed in group {ENTRY_POINT_GROUP}"
    allowed = env.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if not names:
        return True, "SGLANG_PLUGINS is unset or empty: SGLang loads every installed plugin"
    if ENTRY_POINT_NAME in names:
        return True, f"SGLANG_PLUGINS selects {ENTRY_POINT_NAME}"
    return False, f"SGLANG_PLUGINS={allowed!r} does not include {ENTRY_POINT_NAME}"


def doctor_report() -> tuple[dict[str, Any], int]:
    from sglang_dp_mtp_fix import report
    from sglang_dp_mtp_fix.core import Status, plan
    from sglang_dp_mtp_fix.patches import PATCH_IDS, all_patches

    config = load_config(PATCH_IDS)
    outcomes = plan(all_patches(), config).check_deferred_all().outcomes  # checks only: nothing is changed
    selected, why = entry_point_selected()
    data: dict[str, Any] = {
        "sglang_version": report.sglang_version(),
        "plugin_version": __version__,
        "mode": config.mode.value,
        "skip": sorted(config.skip),
        "peer_timeout_s": config.peer_timeout_s,
        "report_dir": config.report_dir,
        "config_error": config.error,
        "entry_point_selected": selected,
        "entry_point_reason": why,
        "patches": [o.as_dict() for o in outcomes],
    }
    if config.error:
        return data, 2
    # The verdict is about the patches that fix; a diagnostic one (upstream_vote_watch) changes no decision.
    fixing = {p.id for p in all_patches() if p.fixes}
    statuses = {o.status for o in outcomes if o.id in fixing}
    if Status.DISABLED in statuses:
        # Disabled by the operator: is this install affected at all? (A not-affected or already fixed SGLang is fine
        # whatever the switches say.)
        underlying = plan(all_patches(), Config(mode=Mode.AUTO)).check_deferred_all().outcomes
        data["without_switches"] = [o.as_dict() for o in underlying]
        fixing_underlying = {o.status for o in underlying if o.id in fixing}
        if fixing_underlying <= {Status.SUPERSEDED, Status.NOT_AFFECTED}:
            statuses = fixing_underlying
    fixed_or_clean = statuses <= {Status.APPLIED, Status.SUPERSEDED, Status.NOT_AFFECTED}
    would_patch = Status.APPLIED in statuses
    code = 0 if fixed_or_clean and (selected or not would_patch) else 1
    watching = [o.id for o in outcomes if o.id not in fixing and o.status is Status.APPLIED]
    data["verdict"] = _verdict(code, statuses, selected)
    if code == 0 and watching and selected:
        data["verdict"] += f"; the hang diagnosis ({', '.join(watching)}) will be applied when SGLang loads plugins"
    return data, code


def _verdict(code: int, statuses: set[Any], selected: bool) -> str:
    from sglang_dp_mtp_fix.core import Status

    if code == 0 and Status.APPLIED in statuses:
        return "affected release; the fix will be applied when SGLang loads plugins"
    if code == 0:
        return "nothing to do: this SGLang is not affected or already contains the fix"
    if Status.APPLIED in statuses and not selected:
        return "affected release, but SGLang will not load this plugin (see entry_point_reason)"
    return "affected release, but the fix would NOT be applied (see the patch reasons)"


def _print_text(data: dict[str, Any]) -> None:
    print(f"sglang-dp-mtp-fix {data['plugin_version']} doctor")
    print(f"  SGLang:       {data['sglang_version']}")
    print(f"  mode:         {data['mode']} ({MODE_ENV})   skip: {', '.join(data['skip']) or '-'} ({SKIP_ENV})")
    print(
        f"  cross-rank:   wait up to {data['peer_timeout_s']:g}s ({PEER_TIMEOUT_ENV})   report files: "
        f"{data['report_dir'] or '-'} ({REPORT_DIR_ENV})"
    )
    if data["config_error"]:
        print(f"  CONFIG ERROR: {data['config_error']}")
    selected = "selected" if data["entry_point_selected"] else "NOT selected"
    print(f"  entry point:  {selected} - {data['entry_point_reason']}")
    width = max(len(p["id"]) for p in data["patches"])
    for p in data["patches"]:
        print(f"  {p['id']:<{width}}  {p['status']:<13} {p['reason']}")
    if "verdict" in data:
        print(f"  verdict:      {data['verdict']}")


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
            _print_text(data)
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
