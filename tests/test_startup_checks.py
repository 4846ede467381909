"""SGLANG_SCHEDULER_SKIP_ALL_GATHER=1 with DP > 1 in an EAGLE + DSA-seed deployment: one WARNING (auto), a stop
(strict), nothing otherwise; checked once, at the end of the first ``Scheduler.__init__``.

REAL: ``ServerArgs`` (SGLang's own construction and validation), SGLang's ``envs.SGLANG_SCHEDULER_SKIP_ALL_GATHER``
reading the process environment, the real ``EAGLEWorkerV2`` / ``EagleDraftWorker`` / ``EAGLEDraftCudaGraphRunner``
classes (created without ``__init__``, which loads a model / captures graphs, with only the attributes the check
reads), the plugin's ``check_startup_hazards`` and its ``_after_scheduler_init`` wrapper of the real
``Scheduler.__init__`` slot.
STAND-INs: the scheduler object (``SchedulerStandIn``: a real ``Scheduler`` needs a model and GPUs; it carries the
two attributes a built scheduler has, ``server_args`` and ``draft_worker``) and, for the wiring test, the original
``Scheduler.__init__`` (sets those two attributes) and ``check_peers`` (no launch to compare with).
"""

from __future__ import annotations

import inspect
import logging
import os
from types import SimpleNamespace
from typing import Any

import pytest
from support import affected_only

from sglang_dp_mtp_fix.config import MODE_ENV, load_config
from sglang_dp_mtp_fix.patches import PATCH_IDS
from sglang_dp_mtp_fix.patches._startup_checks import SKIP_ENV

pytestmark = affected_only

DUMMY_MODEL = os.path.join(os.path.dirname(__import__("sglang_dp_mtp_fix.harness").harness.__file__), "dummy_model")


def server_args(dp_size: int = 2, speculative: bool = True) -> Any:
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.server_args import ServerArgs

    from sglang_dp_mtp_fix.harness.rank import publish_server_args

    extra = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": DUMMY_MODEL} if speculative else {}
    sa = ServerArgs(
        model_path=DUMMY_MODEL, device="cpu", tp_size=dp_size, dp_size=dp_size, enable_dp_attention=dp_size > 1,
        skip_tokenizer_init=True, load_format="dummy", **extra,
    )  # fmt: skip
    publish_server_args(sa)  # as the scheduler process does before Scheduler.__init__ (the checks read them)
    init = moe_utils.initialize_moe_config
    init(sa) if inspect.signature(init).parameters else init()
    return sa


def spec_worker(seeds: bool = True, draft_graph: bool = True) -> Any:
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2

    worker = object.__new__(EAGLEWorkerV2)  # real class; __init__ loads a model
    draft = object.__new__(EagleDraftWorker)
    draft.seed_dsa_topk_from_draft_extend = seeds  # index_share_for_mtp_iteration and a DSA seed width
    draft.cuda_graph_runner = object.__new__(EAGLEDraftCudaGraphRunner) if draft_graph else None
    worker._draft_worker = draft
    return worker


class SchedulerStandIn(SimpleNamespace):
    """STAND-IN for a built ``Scheduler`` (needs a model and GPUs): the attributes the check reads."""


def _hazard_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("sglang_dp_mtp_fix") and r.levelno >= logging.WARNING and SKIP_ENV in r.getMessage()
    ]


def _check(scheduler: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_dp_mtp_fix import plugin

    monkeypatch.setenv(MODE_ENV, mode)
    plugin.check_startup_hazards(scheduler, load_config(list(PATCH_IDS)))


def test_skip_all_gather_with_dp_eagle_dsa_warns_once_in_auto(monkeypatch, caplog):
    monkeypatch.setenv(SKIP_ENV, "1")
    scheduler = SchedulerStandIn(server_args=server_args(), draft_worker=spec_worker())
    with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
        _check(scheduler, "auto", monkeypatch)
    lines = _hazard_lines(caplog)
    assert len(lines) == 1, lines
    assert "dp_size=2" in lines[0] and "EAGLE" in lines[0] and "split the ranks" in lines[0], lines[0]


def test_skip_all_gather_stops_in_strict(monkeypatch):
    from sglang_dp_mtp_fix.errors import StartupHazard

    monkeypatch.setenv(SKIP_ENV, "1")
    scheduler = SchedulerStandIn(server_args=server_args(), draft_worker=spec_worker())
    with pytest.raises(StartupHazard, match=f"{SKIP_ENV}=1 .*strict: stopping"):
        _check(scheduler, "strict", monkeypatch)


@pytest.mark.parametrize(
    ("env", "dp_size", "seeds", "draft_graph"),
    [
        ("0", 2, True, True),  # the variable off: the sync gathers
        (None, 2, True, True),  # unset (SGLang's default)
        ("1", 1, True, True),  # one DP rank: nothing to agree on
        ("1", 2, False, True),  # no DSA seeds: the seedless eager fallback cannot trigger
        ("1", 2, True, False),  # no draft CUDA graph (e.g. --disable-cuda-graph, DWDP): every rank drafts eagerly
    ],
    ids=["env-0", "env-unset", "dp1", "no-dsa-seeds", "no-draft-graph"],
)
def test_no_line_where_ranks_cannot_split(env, dp_size, seeds, draft_graph, monkeypatch, caplog):
    if env is None:
        monkeypatch.delenv(SKIP_ENV, raising=False)
    else:
        monkeypatch.setenv(SKIP_ENV, env)
    scheduler = SchedulerStandIn(server_args=server_args(dp_size), draft_worker=spec_worker(seeds, draft_graph))
    with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
        _check(scheduler, "strict", monkeypatch)  # strict: any hazard would raise
    assert _hazard_lines(caplog) == []


def test_no_line_without_speculative_decoding(monkeypatch, caplog):
    monkeypatch.setenv(SKIP_ENV, "1")
    scheduler = SchedulerStandIn(server_args=server_args(speculative=False), draft_worker=None)
    with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
        _check(scheduler, "strict", monkeypatch)
    assert _hazard_lines(caplog) == []


def test_checked_once_at_the_end_of_the_first_scheduler_init(monkeypatch, caplog):
    """The plugin's real ``Scheduler.__init__`` wrapper runs the check after the original, once per process."""
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_dp_mtp_fix import plugin, report
    from sglang_dp_mtp_fix.core import PatchManager

    monkeypatch.setenv(SKIP_ENV, "1")
    monkeypatch.setenv(MODE_ENV, "auto")
    sa, worker = server_args(), spec_worker()

    def init_standin(self: Any, *args: Any, **kwargs: Any) -> None:  # STAND-IN: the real one loads a model
        self.server_args, self.draft_worker = sa, worker

    monkeypatch.setattr(Scheduler, "__init__", init_standin)
    monkeypatch.setattr(plugin, "check_peers", lambda *a: None)  # STAND-IN: no launch to compare with
    manager = PatchManager([])
    config = load_config(list(PATCH_IDS))
    plugin._after_scheduler_init(manager, [], config, report.PendingLine(lambda: None))  # no held report line
    try:
        with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
            for _ in range(2):
                Scheduler.__init__(object.__new__(Scheduler))
    finally:
        manager.restore()
    assert len(_hazard_lines(caplog)) == 1
