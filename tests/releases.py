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

# The launch tier. All of its scenarios a-g run here (the distinct shapes of the vote path's code); a and g on the
# other affected releases.
FULL = ("0.5.15.post1", "0.5.17", "0.5.20")
# f (the plugin stands down): the matrix's releases that are not affected.
STAND_DOWN = tuple(r for r in MATRIX if r not in AFFECTED)
# Releases whose launch in this shape has been made to run here. The others stop in SGLang's CPU path before the
# plugin matters, so their scenarios skip, naming why (NOT_YET).
LAUNCHES_HERE = ("0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.23")
if os.environ.get("LAUNCH_TIER_TRY") and SGLANG_VERSION:  # developers: try the tier on a release not listed yet
    LAUNCHES_HERE = (*LAUNCHES_HERE, SGLANG_VERSION)
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
