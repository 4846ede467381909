"""The tests' own release lists: what the suite expects the plugin to decide on each SGLang release, which releases
the test matrix runs, and where the launch tier runs. Written apart from the plugin's own release list, so that the
tests check that claim instead of importing it. Read by ``support``, the launch tier, ``tools/test-matrix.sh``
and ``tools/compat_table.py``; only the standard library, so any Python 3 can read it."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

try:
    SGLANG_VERSION: str | None = version("sglang")  # the release under test
except PackageNotFoundError:  # pure-Python tests (config) still run
    SGLANG_VERSION = None

AFFECTED = ("0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20")
SUPERSEDED = ("0.5.21", "0.5.22", "0.5.23")
NOT_AFFECTED = ("0.5.14", "0.5.15")
# Idle ranks run the full eager draft loop and its topk-1 assert: draft_local_rows applies.
LOCAL_ROWS_AFFECTED = ("0.5.16", "0.5.17", "0.5.18")

# What tools/test-matrix.sh runs by default, in its order: every affected release, then one where the fix is upstream
# and one from before the bug. tools/compat_table.py's table covers each of them.
MATRIX = (*AFFECTED, "0.5.23", "0.5.15")

# The launch tier (tests/launch). Releases whose launch in this shape has been made to run here; the others stop in
# SGLang's CPU path before the plugin matters, so every launch test skips there, naming why (NOT_YET).
LAUNCHES_HERE = ("0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.23")
if os.environ.get("LAUNCH_TIER_TRY") and SGLANG_VERSION:  # developers: try the tier on a release not listed yet
    LAUNCHES_HERE = (*LAUNCHES_HERE, SGLANG_VERSION)
# Where each scenario runs (docs/development.md, "Coverage", says why and where each dropped case now runs):
# a, g, metrics, recorder (the patched launch): every affected release that launches.
PATCHED_LAUNCH = tuple(r for r in AFFECTED if r in LAUNCHES_HERE)
# c (the vote through real schedulers: its patched launch and its plugin-off control) on the two distinct shapes of
# the vote path's code (0.5.16 and 0.5.18 share 0.5.17's, 0.5.19 0.5.20's); e and the plugin-off half of metrics read
# c's plugin-off launch.
PROBE = ("0.5.17", "0.5.20")
# b (no harm, two launches without PD) and d (two nodes, two pairs): one release each; test_peers.py runs d's
# comparisons (a rank off, another skip list, ranks alike) in-process on every affected release.
NO_HARM = ("0.5.20",)
TWO_NODES = ("0.5.17",)
# Tests of code that reads no SGLang and take a second or more (rollcall's reader on large or live files, the CLI
# under a closed pipe and SIGINT): one release.
RELEASE_FREE = ("0.5.20",)
# f (the plugin stands down): the matrix's releases that are not affected.
STAND_DOWN = tuple(r for r in MATRIX if r not in AFFECTED)
NOT_YET = {
    "0.5.15.post1": "scheduler start: 'RuntimeError: 0 active drivers ([]). There should only be one.' (the KV pool's "
    "Triton warm-up, copy_all_layer_kv_cache_tiled, runs on every device); with that stood in (tried, not kept): "
    "'ValueError: EAGLE is not supported in decode attention backend intel_amx' - 0.5.15.post1 has no EAGLE/NEXTN "
    "draft attention backend for CPU at all (IntelAMXMultiStepDraftBackend arrives in 0.5.16), which no stand-in "
    "of a kernel can supply",
    "0.5.15": "not launched: like 0.5.15.post1 it has no EAGLE/NEXTN draft attention backend for CPU (its "
    "speculative/draft_utils.py raises 'EAGLE is not supported in decode attention backend intel_amx' for the CPU "
    "backends; IntelAMXMultiStepDraftBackend arrives in 0.5.16), read from its source",
}


def runs_on(releases: tuple[str, ...]) -> str:
    """A skip reason that is true: where the scenario runs instead."""
    return f"runs on {', '.join(releases)} only, not on SGLang {SGLANG_VERSION}"


# test_faults.py: the faults that take another fault's code path ("renamed" resolves as "missing" does, "drifted"
# fails the fingerprint as "signature" does) run on this release only, where every patch applies.
FAULT_TWIN_RELEASE = "0.5.17"

# The fewest tests that must pass per release (tools/test-matrix.sh reads the junit xml and fails below it, with the
# numbers). Raise a line when tests are added; lower one only in the commit that removes tests, saying why.
# The passed counts of the fresh-clone run of the merged main (2026-12-03, docs/development.md "CI runs"; one more
# passes on 0.5.16-0.5.18, 0.5.20, 0.5.23 and 0.5.15 and two on 0.5.19 since the fixes that run found; 0.5.23 and
# 0.5.15 from their re-run after the collection fix). Issue 53 (arrival_seed) raised the releases it ran on by the
# tests it added there: 16 in test_arrival_seed, 15 in test_config, 2 (0.5.23: 1) in test_peers and arrival_seed's
# fault cases (29 on 0.5.17, 13 elsewhere).
PASS_FLOOR = {
    "0.5.15.post1": 543,
    "0.5.16": 535,
    "0.5.17": 702,
    "0.5.18": 542,
    "0.5.19": 512,
    "0.5.20": 586,
    "0.5.23": 212,
    "0.5.15": 166,
}
