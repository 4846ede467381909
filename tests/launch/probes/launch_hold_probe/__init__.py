"""Test-only SGLang plugin ``launch_hold_probe`` (``SGLANG_PLUGINS=...,launch_hold_probe``), the stall launch only.

Not a stand-in for the plugin under test: it never touches ``sglang_dp_mtp_fix``. It holds one scheduler's main thread,
alive, in the middle of a round, as a lazily loaded kernel or a slow collective outside the MLP sync would
(sglang#33642): while the file ``$LAUNCH_HOLD_PROBE_FILE`` exists, the scheduler of global rank
``LAUNCH_HOLD_PROBE_RANK`` (default 0; in the tier's shape, tp 2 and dp 2 with DP attention, DP rank k is global
rank k) sleeps before running each batch, after the round's MLP sync (and creates ``<file>.held`` when it
begins). Its peer then blocks in that round's forward collectives, so both ranks are alive (their heartbeats tick),
in the same round, with the same decisions: what ``rollcall`` must call a stall outside the vote.

Installed on the scheduler instance (``run_batch``, an instance attribute: no SGLang function is replaced) through
``probe_seam``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from probe_seam import after_draft_worker_init

MARK = "_launch_hold_probe"


def register() -> None:
    if os.environ.get("LAUNCH_HOLD_PROBE_FILE"):
        after_draft_worker_init(_install, MARK)


def _install(scheduler: Any) -> None:
    import torch.distributed as dist

    if dist.get_rank() != int(os.environ.get("LAUNCH_HOLD_PROBE_RANK", "0")):
        return
    hold_file = os.environ["LAUNCH_HOLD_PROBE_FILE"]
    run_batch = scheduler.run_batch  # the bound method

    @functools.wraps(run_batch)
    def held_run_batch(*args: Any, **kwargs: Any) -> Any:
        if os.path.exists(hold_file):
            open(hold_file + ".held", "w").close()  # tells the test the hold has begun, in a round with a batch
            while os.path.exists(hold_file):
                time.sleep(0.05)
        return run_batch(*args, **kwargs)

    scheduler.run_batch = held_run_batch
