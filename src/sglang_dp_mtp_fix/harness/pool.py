"""A pool of N CPU rank processes (started once, reused for many rounds), forked from a pristine process."""

from __future__ import annotations

import os
import queue
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sglang_dp_mtp_fix.diagnosis import recfile
from sglang_dp_mtp_fix.harness.ports import free_port

if TYPE_CHECKING:
    from sglang_dp_mtp_fix.harness.decode_round import RoundResult

DUMMY_MODEL = Path(__file__).with_name("dummy_model")

# What a scheduler process has imported when SGLang calls ``load_plugins()`` (``run_scheduler_process`` lives in this
# module and calls it first thing): the forkserver imports exactly this, once, and nothing of the plugin.
PRISTINE_PRELOAD = ("sglang.srt.managers.scheduler",)
START_ENV = "SGLANG_DP_MTP_FIX_HARNESS_START"  # "fork": fork the ranks from this (pristine) process; see below


def pristine_context() -> Any:
    """A multiprocessing context whose children start pristine — SGLang imported as a scheduler process has it, the
    plugin not loaded — without each paying SGLang's import (8–10 s on two cores): a forkserver imports
    ``PRISTINE_PRELOAD`` once per parent process and forks every child from there. Children must not rely on the
    parent's environment being inherited: pass it (``RankPool`` does).

    ``SGLANG_DP_MTP_FIX_HARNESS_START=fork`` forks the children from this process instead, which must itself be such
    a pristine process (the test suite's children of its own forkserver): checked, never assumed."""
    import multiprocessing as mp

    if os.environ.get(START_ENV) == "fork":
        problem = _not_pristine_here()
        if problem:
            raise RankError(f"{START_ENV}=fork, but this process is not pristine: {problem}")
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRISTINE_PRELOAD))
    return ctx


def _not_pristine_here() -> str | None:
    import sys
    import threading

    missing = [m for m in PRISTINE_PRELOAD if m not in sys.modules]
    if missing:
        return f"{', '.join(missing)} not imported"
    plugins = sys.modules.get("sglang.srt.plugins")
    if "sglang_dp_mtp_fix.plugin" in sys.modules or getattr(plugins, "_plugins_loaded", False):
        return "plugins were loaded"
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others:
        return f"other threads running: {', '.join(others)}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized"
    return None


class RankError(RuntimeError):
    """A rank failed or did not answer. ``error_type`` and ``error``: the rank's own exception (its class name and
    text), where one was raised, for callers that answer a kind of failure (``StrictModeAbort``) in one line."""

    def __init__(self, message: str, failure: dict[str, Any] | None = None):
        super().__init__(message)
        self.error_type: str | None = (failure or {}).get("error_type")
        self.error: str | None = (failure or {}).get("error")


def _failure(rank: int, exc: BaseException) -> dict[str, Any]:
    return {"rank": rank, "error_type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}


ORPHAN_POLL_S = 1.0


def _gone(pid: int) -> bool:
    """Has process ``pid`` exited (a zombie counts: it runs no more code)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return recfile.proc_state(pid) in ("Z", "X", "x")  # None (unreadable): taken as running


def _next_command(inbox: Any, owner: int) -> Any:
    """The next command, or None once the pool's owner is gone: nobody will send the stop. Without this, killing
    ``simulate`` by its PID left its ranks (each with SGLang imported, ~0.5 GB) waiting here for good, and with them
    the forkserver (each rank holds its liveness pipe) and the resource tracker."""
    while True:
        try:
            return inbox.get(timeout=ORPHAN_POLL_S)
        except queue.Empty:
            if _gone(owner):
                return None


def _rank_main(
    rank: int, world: int, port: int, load_plugins: bool, inbox: Any, outbox: Any, env: dict[str, str], owner: int
) -> None:
    # A forkserver child inherits the forkserver's environment, not the pool owner's: take the owner's (``env``).
    os.environ.clear()
    os.environ.update(env)
    try:
        from sglang_dp_mtp_fix.harness import rank as r

        outbox.put(("ok", r.setup(rank, world, port, str(DUMMY_MODEL), load_plugins)))
    except BaseException as exc:  # noqa: BLE001 - report, then exit
        outbox.put(("error", _failure(rank, exc)))
        return
    while True:
        item = _next_command(inbox, owner)
        if item is None:
            break
        command, payload = item
        try:
            result = r.handle(command, payload)
            outbox.put(("ok", result))
        except BaseException as exc:  # noqa: BLE001
            outbox.put(("error", _failure(rank, exc)))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """``RankPool(4, load_plugins=True)``: ranks call SGLang's ``load_plugins()`` at start-up."""

    def __init__(self, world: int, load_plugins: bool = False, env: dict[str, str] | None = None, timeout: float = 600):
        self.world = world
        self.timeout = timeout
        ctx = pristine_context()
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outboxes = [ctx.Queue() for _ in range(world)]
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    world,
                    port,
                    load_plugins,
                    self._inboxes[r],
                    self._outboxes[r],
                    {**os.environ, **(env or {})},
                    os.getpid(),
                ),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        try:
            self.setup = self._collect()
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """One answer per rank. A rank that failed while its peers wait in a collective is reported after a short
        grace period (its peers cannot answer: the pool is then unusable and should be closed)."""
        import time

        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + (timeout or self.timeout)
        first_error_at: float | None = None
        while len(answers) < self.world:
            progressed = False
            for rank, box in enumerate(self._outboxes):
                if rank in answers:
                    continue
                try:
                    answers[rank] = box.get_nowait()
                    progressed = True
                except queue.Empty:
                    if not self._procs[rank].is_alive():
                        time.sleep(1.0)  # let the other ranks fail or finish too, then name them all
                        raise RankError(self.describe_failure()) from None
            errors = [(r, a[1]) for r, a in sorted(answers.items()) if a[0] != "ok"]
            if errors and first_error_at is None:
                first_error_at = time.monotonic()
            if (
                errors
                and first_error_at is not None
                and len(answers) < self.world
                and time.monotonic() - first_error_at > 5.0
            ):
                r, payload = errors[0]
                pending = sorted(set(range(self.world)) - set(answers))
                raise RankError(
                    f"rank {r} failed (ranks {pending} blocked):\n{payload.get('traceback', payload)}", payload
                )
            if time.monotonic() > deadline:
                pending = sorted(set(range(self.world)) - set(answers))
                raise RankError(f"ranks {pending} did not answer within {timeout or self.timeout}s")
            if not progressed:
                time.sleep(0.002)
        # Every rank has answered (so the queues stay in step); now report the first failure, if any.
        for rank in range(self.world):
            status, payload = answers[rank]
            if status != "ok":
                raise RankError(f"rank {rank} failed:\n{payload.get('traceback', payload)}", payload)
        return [answers[rank][1] for rank in range(self.world)]

    def describe_failure(self) -> str:
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
        alive = [r for r, p in enumerate(self._procs) if p.is_alive()]
        parts = [f"rank {r} exited (code {code}{', SIGABRT' if code == -6 else ''})" for r, code in dead]
        if alive:
            parts.append(f"ranks {alive} still alive (blocked in or failed the collective)")
        return "; ".join(parts)

    def _send(self, command: str, payloads: list[Any], timeout: float | None = None) -> list[Any]:
        for box, payload in zip(self._inboxes, payloads, strict=True):
            box.put((command, payload))
        return self._collect(timeout)

    def round(self, states: list[dict[str, Any]], timeout: float | None = 120) -> list[RoundResult]:
        assert len(states) == self.world
        return self._send("round", states, timeout)

    def rounds(
        self, per_rank_states: list[list[dict[str, Any]]], timeout: float | None = 600, collective: bool = True
    ) -> list[list[RoundResult]]:
        """Run len(per_rank_states[0]) rounds; returns one list of round results per rank.

        ``collective=False``: each rank still runs SGLang's real PD-decode round and MLP sync and reports its
        decisions, but does not emulate the draft step's collectives afterwards (compare the decisions instead).
        """
        assert len(per_rank_states) == self.world
        return self._send("rounds" if collective else "decisions", per_rank_states, timeout)

    def run_trace(
        self, trace: list[list[dict[str, Any]]], timeout: float | None = 600, collective: bool = True
    ) -> list[list[RoundResult]]:
        """Run a trace given round by round (one state per rank in each round); results come back the same way."""
        per_rank = self.rounds([[states[r] for states in trace] for r in range(self.world)], timeout, collective)
        return [[per_rank[r][i] for r in range(self.world)] for i in range(len(trace))]

    def plugin(self, command: str | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
        """'apply' / 'restore' / 'stats' on every rank, or one command per rank (a misconfigured-node scenario). An
        unknown command fails on every rank (``RankError``); the pool stays usable."""
        commands = command if isinstance(command, list) else [command] * self.world
        return self._send("plugin", commands)

    def configure(
        self, backends: tuple[str, str] | list[str] | None, patched: bool, env: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """One deployment on every rank together (one scheduler process has one ServerArgs): re-publish ServerArgs
        with ``--moe-a2a-backend`` / ``--speculative-moe-a2a-backend`` = ``backends`` (None: the pool's baseline
        ServerArgs), then apply the plugin afresh (``patched``) or stay stock. Each rank answers with its plugin
        statuses and SGLang's (target, draft) ``require_mlp_tp_gather``."""
        payload = {"backends": list(backends) if backends else None, "patched": patched, "env": env or {}}
        return self._send("configure", [payload] * self.world)

    def scale_up(self, expanded: bool = True) -> list[dict[str, Any]]:
        """Elastic EP scale-up on every rank between two rounds (a stand-in: ``draft_counts.scale_up``); the next
        ``configure`` undoes it. Each rank answers with SGLang's (target, draft) ``require_mlp_tp_gather`` after."""
        return self._send("scale_up", [expanded] * self.world)

    def close(self) -> None:
        for box in self._inboxes:
            try:
                box.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
