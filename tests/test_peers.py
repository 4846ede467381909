"""Start-up cross-rank patch-state check (``sglang_dp_mtp_fix.peers``) on 3 real processes.

Each rank imports the real SGLang, initializes a real gloo process group (whose default store is a real TCPStore),
applies the plugin through ``plugin.register()`` with its own environment, then runs ``Scheduler.__init__`` — the seam
where the plugin runs the check. STAND-IN: the body of ``Scheduler.__init__`` (it loads a model on a GPU and builds KV
pools); the plugin wraps whatever ``Scheduler.__init__`` is at load, exactly as in a real scheduler process.
STAND-IN (one scenario): a rank reporting another plugin version (two releases cannot be installed in one venv).
The ranks live for the whole module; each scenario uses a fresh process group (fresh store) on a new port.
"""

from __future__ import annotations

import os
import queue
import traceback
from typing import Any

import pytest
from support import affected_only, load_scaled_timeout

from sglang_dp_mtp_fix import peers
from sglang_dp_mtp_fix.core import Outcome, Status
from sglang_dp_mtp_fix.harness.pool import pristine_context
from sglang_dp_mtp_fix.harness.ports import free_port

WORLD = 3
# SGLANG_DP_MTP_FIX_PEER_TIMEOUT for the scenarios (the default is 120 s): only a scenario with a rank that never
# publishes waits it out, so it can follow the host's load (2 s flaked under load).


def _scheduler_init_standin(self: Any, *args: Any, **kwargs: Any) -> None:
    """STAND-IN for the body of Scheduler.__init__ (model loading needs a GPU)."""


def _rank_main(rank: int, inbox: Any, outbox: Any) -> None:
    try:
        import torch.distributed as dist
        from sglang.srt.managers.scheduler import Scheduler

        from sglang_dp_mtp_fix import _version, plugin

        Scheduler.__init__ = _scheduler_init_standin  # type: ignore[method-assign]
        real_version = _version.__version__
        outbox.put("ready")
    except BaseException:  # noqa: BLE001
        outbox.put(("setup failed", traceback.format_exc()))
        return
    while (item := inbox.get()) is not None:
        port, env, fake_version = item
        for key in [k for k in os.environ if k.startswith("SGLANG_DP_MTP_FIX")]:
            del os.environ[key]
        os.environ.update(env)
        _version.__version__ = fake_version or real_version
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        try:
            statuses = {o.id: o.status.value for o in plugin.register()}
            # Line the ranks up before the seam: the short peer timeout then measures the check itself, not how long
            # each rank took to load the plugin on two busy cores (a real launch's ranks are lined up by SGLang's own
            # start-up collectives before the end of Scheduler.__init__).
            outbox.put("registered")
            assert inbox.get() == "go"
            try:
                Scheduler.__init__(Scheduler.__new__(Scheduler))
                result: dict[str, Any] = {"error": None}
            except Exception as exc:  # noqa: BLE001 - what SGLang's run_scheduler_process would log
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["statuses"] = statuses
        except BaseException:  # noqa: BLE001
            result = {"error": "harness: " + traceback.format_exc(), "statuses": {}}
        outbox.put(result)
        # Rank 0 hosts the store: tear down only once every rank has answered (else a slower rank's wait would see
        # the store vanish instead of its own timeout).
        assert inbox.get() == "teardown"
        plugin.restore()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    ctx = pristine_context()  # forked from a process that imported SGLang once (see harness.pool)
    inboxes, outboxes = [ctx.Queue() for _ in range(WORLD)], [ctx.Queue() for _ in range(WORLD)]
    procs = [ctx.Process(target=_rank_main, args=(r, inboxes[r], outboxes[r]), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        ready = [box.get(timeout=300) for box in outboxes]
        assert ready == ["ready"] * WORLD, ready

        def run(envs: dict[int, dict[str, str]] | None = None, fake_version: dict[int, str] | None = None) -> list:
            port = free_port()
            timeout = load_scaled_timeout(2, per_load_s=2)
            for r, box in enumerate(inboxes):
                env = {"SGLANG_DP_MTP_FIX_PEER_TIMEOUT": str(timeout), **(envs or {}).get(r, {})}
                box.put((port, env, (fake_version or {}).get(r)))
            try:
                registered = [box.get(timeout=300) for box in outboxes]
                assert registered == ["registered"] * WORLD, registered
                for box in inboxes:
                    box.put("go")
                return [box.get(timeout=120) for box in outboxes]
            except queue.Empty:
                pytest.fail("a rank did not answer: the check must never hang")
            finally:
                for box in inboxes:
                    box.put("teardown")

        yield run
    finally:
        for box in inboxes:
            box.put(None)
        for p in procs:
            p.join(timeout=3)  # they exit on None; a slow interpreter teardown is not worth waiting for
            if p.is_alive():
                p.kill()


@affected_only
def test_identical_ranks_start(ranks):
    results = ranks()
    assert [r["error"] for r in results] == [None] * WORLD, results
    assert all("applied" in r["statuses"].values() and "unsupported" not in r["statuses"].values() for r in results)
    assert all(r["statuses"] == results[0]["statuses"] for r in results)


@affected_only
def test_a_rank_with_the_kill_switch_stops_the_others_naming_it(ranks):
    results = ranks({2: {"SGLANG_DP_MTP_FIX": "off"}})
    assert results[2]["error"] is None and set(results[2]["statuses"].values()) == {"disabled"}
    for r in (0, 1):
        assert results[r]["error"].startswith("PeerStateMismatch"), results[r]
        assert "no patch-state from ranks [2]" in results[r]["error"] and "SGLANG_DP_MTP_FIX=off" in results[r]["error"]


@affected_only
def test_a_rank_with_a_skip_list_is_named(ranks):
    results = ranks({1: {"SGLANG_DP_MTP_FIX_SKIP": "draft_graph_vote"}})
    assert "disabled" in results[1]["statuses"].values()
    for r in (0, 2):
        error = results[r]["error"] or ""
        # With one patch group a skip leaves that rank stock (it publishes nothing); with several, its statuses differ.
        assert "ranks [1]" in error and ("no patch-state" in error or "disabled" in error), results[r]


@affected_only
def test_a_rank_with_another_arrival_seed_setting_is_named(ranks):
    """The setting is compared by value (``settings`` in the published state), beside arrival_seed's status."""
    results = ranks({r: {"SGLANG_DP_MTP_FIX_ARRIVAL_SEED": "exact" if r == 1 else "recent"} for r in range(WORLD)})
    assert [r["statuses"]["arrival_seed"] for r in results] == ["applied"] * WORLD, results
    for r in range(WORLD):
        error = results[r]["error"] or ""
        assert "ranks [1] differ from ranks [0, 2]: setting SGLANG_DP_MTP_FIX_ARRIVAL_SEED: recent vs exact" in error


@affected_only
def test_a_rank_with_another_build_of_the_same_release_stops_every_rank_naming_both(ranks):
    # Another commit since the same release: its build's version, worked out by the build backend from git (as a
    # node installed from that commit would carry it); the other ranks run this checkout's own build.
    from test_version import ROOT, _backend

    from sglang_dp_mtp_fix import __version__, _version

    other = _backend().from_git(ROOT, "HEAD~1") or _backend().compose(_version.RELEASE, 4, "1a2b3c4d")
    assert other != __version__, other
    results = ranks(fake_version={0: other})
    for r in range(WORLD):
        error = results[r]["error"] or ""
        assert "ranks [0] differ from ranks [1, 2]" in error, results[r]
        assert f"plugin version: {__version__} vs {other}" in error, error


@affected_only
def test_strict_ranks_agree_too(ranks):
    results = ranks({r: {"SGLANG_DP_MTP_FIX": "strict"} for r in range(WORLD)})
    assert [r["error"] for r in results] == [None] * WORLD, results


# -- the comparison itself (pure) ------------------------------------------------------------------------------------


def _state(version: str = "1", status: str = "applied", fingerprint: str = "abc") -> dict[str, Any]:
    outcomes = [Outcome("p1", Status(status), ""), Outcome("p2", Status.APPLIED, "")]
    state = peers.local_state(outcomes, {"mod:f": fingerprint})
    state["plugin_version"] = version
    return state


def test_compare_names_a_setting_that_differs():
    def state(mode: str) -> dict[str, Any]:
        return peers.local_state([Outcome("p1", Status.APPLIED, "")], {}, {"SGLANG_DP_MTP_FIX_ARRIVAL_SEED": mode})

    assert peers.compare({0: state("off"), 1: state("off")}, 5) is None
    message = peers.compare({0: state("off"), 1: state("off"), 2: state("exact")}, 5)
    assert "ranks [2] differ from ranks [0, 1]: setting SGLANG_DP_MTP_FIX_ARRIVAL_SEED: off vs exact" in message


def test_compare_names_statuses_fingerprints_and_missing_ranks():
    same = {r: _state() for r in range(4)}
    assert peers.compare(same, 5) is None
    message = peers.compare({**same, 3: _state(status="disabled")}, 5)
    assert "ranks [3] differ from ranks [0, 1, 2]: p1: applied vs disabled" in message
    message = peers.compare({**same, 1: _state(fingerprint="def"), 2: None}, 5)
    assert "no patch-state from ranks [2] within 5s" in message
    assert "ranks [1] differ from ranks [0, 3]: fingerprint of mod:f: abc vs def" in message


def test_no_process_group_means_no_check():
    # a single process: nothing published, nothing waited for (no store needed), nothing agreed
    assert peers.check([Outcome("p1", Status.APPLIED, "")], {}, 1) is None
