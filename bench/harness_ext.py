"""The benchmarks' additions to the rank harness, loaded into every rank by ``bench.py --sync-local`` through the
harness's extension hook (``SGLANG_DP_MTP_FIX_HARNESS_EXTENSION`` = this file; ``install()`` runs at the end of the
rank's setup). Never loaded by the tests or by ``simulate``.

  * local gather: SGLang's MLP-sync all-gather replaced by a local copy, so a rank's round is timed without waiting
    on (or spinning for) its peer;
  * quiet GC: no cyclic GC inside a batch of rounds (collected before it instead);
  * the ``passthrough`` plugin command: SGLang stock, except that every function the plugin wraps is wrapped by a
    wrapper that only calls the original (the cost of wrapping those seams at all). ``apply`` and ``restore`` undo it
    first;
  * the ``apply_no_monitor`` plugin command: ``apply``, with the monitor thread (heartbeat and stall watcher) never
    started in this process until the next command: the ``recorder_no_heartbeat`` arm, the A/A bracket of the
    heartbeat. Every other command puts the monitor back first;
  * the ``apply_private_ring`` plugin command: ``apply_no_monitor`` with the recorder's ring never mapped to a file
    (``--recorder-split``);
  * the ``interleaved_rounds`` command: several plugin configurations applied once each, then their rounds
    interleaved one by one (``--recorder-rounds``).
"""

from __future__ import annotations

import functools
import gc
import random
from collections.abc import Callable
from typing import Any

from sglang_dp_mtp_fix.diagnosis import monitor
from sglang_dp_mtp_fix.harness import rank

_MONITOR_START = monitor.Monitor.start
# (owner, attribute, original) of every seam the passthrough arm wrapped, in the order wrapped.
_passthrough: list[tuple[Any, str, Any]] = []


def install() -> None:
    import torch.distributed as dist

    _install_local_gather(dist)
    for name in ("rounds", "decisions"):
        rounds = rank.COMMANDS[name]
        rank.register_command(name, functools.partial(_with_quiet_gc, rounds))
    for name in ("apply", "restore"):
        command = rank.PLUGIN_COMMANDS[name]
        rank.register_plugin_command(name, functools.partial(_after_undoing_passthrough, command))
    rank.register_plugin_command("passthrough", functools.partial(_after_undoing_passthrough, _passthrough_seams))
    quiet_apply = _without_monitor(rank.PLUGIN_COMMANDS["apply"])
    rank.register_plugin_command("apply_no_monitor", functools.partial(_after_undoing_passthrough, quiet_apply))
    private_ring = _with_private_ring(quiet_apply)
    rank.register_plugin_command("apply_private_ring", functools.partial(_after_undoing_passthrough, private_ring))
    rank.register_command("interleaved_rounds", interleaved_rounds)


# (owner, attribute, value) of every attribute one plugin configuration sets, its ``from X import Y`` copies included
Snapshot = list[tuple[Any, str, Any]]


def _snapshot() -> Snapshot:
    """The live values of every attribute the plugin replaced in this process, the re-pointed copies included."""
    from sglang_dp_mtp_fix import plugin as p

    return p.get_manager().live_values()


def _switch(snapshot: Snapshot) -> None:
    for owner, attr, value in snapshot:
        setattr(owner, attr, value)


def interleaved_rounds(payload: dict[str, Any]) -> dict[str, Any]:
    """``--recorder-rounds``: per epoch, apply each configuration of ``arms`` (``[name, plugin request]``, the last one
    the recorder's: applying another closes the recorder) and keep its attributes; then ``cycles`` cycles, each one
    round of every arm in a shuffled order, each round preceded by switching the attributes to its arm's. Rounds that
    follow one another are seconds apart in the block protocol and microseconds apart here, so slow drifts of a shared
    host cancel in each cycle's differences. Returns each arm's round CPU times (µs) by cycle, and what the recorder
    wrote (so a hollow run, one whose recorder arm never recorded, is refused by the caller)."""
    from sglang_dp_mtp_fix.diagnosis import recorder

    arms, states = payload["arms"], payload["states"]
    times: dict[str, list[float]] = {name: [] for name, _ in arms}
    if not states:
        return {"times": times, "recorded": 0}
    rng = random.Random(payload.get("seed", 0))
    names = [name for name, _ in arms]
    recorded = 0
    for epoch in range(payload["epochs"]):
        # the patched arms in a rotated order each epoch (where each one's objects land in memory moves with it)
        first = arms[:-1][epoch % max(1, len(arms) - 1) :] + arms[:-1][: epoch % max(1, len(arms) - 1)]
        snapshots: dict[str, Snapshot] = {}
        for name, request in [*first, arms[-1]]:
            rank.plugin(request)
            snapshots[name] = _snapshot()
        seams = {name: [(id(o), a) for o, a, _ in snap] for name, snap in snapshots.items()}
        if any(s != seams[names[0]] for s in seams.values()):
            raise RuntimeError("the arms do not replace the same attributes: not one round measured two ways")
        rec = recorder.active()
        before = rec.round if rec is not None else 0
        order = list(names)
        gc.collect()
        gc.disable()
        try:
            for cycle in range(payload["warm"] + payload["cycles"]):
                rng.shuffle(order)
                for name in order:
                    _switch(snapshots[name])
                    result = rank.run_round(states[cycle % len(states)])
                    if cycle >= payload["warm"]:
                        times[name].append(result.round_cpu_ms * 1e3)
        finally:
            gc.enable()
            _switch(snapshots[names[-1]])  # leave the last-applied configuration live, as the manager knows it
        if rec is not None and rec.path is not None:
            recorded += rec.round - before
    rank.plugin("restore")
    return {"times": times, "recorded": recorded}


def _with_private_ring(apply: Callable[[rank.PluginRequest], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``apply_no_monitor``, with the recorder's file never created: its ``open`` (an instance attribute here) only
    marks it open, so every round's stores go to the ring's private buffer instead of the shared map
    (``bench.py --recorder-split``)."""

    def command(request: rank.PluginRequest) -> dict[str, Any]:
        from sglang_dp_mtp_fix.diagnosis import recorder

        result = apply(request)
        rec = recorder.active()
        if rec is not None:

            def open_nothing(*args: Any, **kwargs: Any) -> None:
                rec.opened = True

            rec.open = open_nothing  # type: ignore[method-assign]
        return result

    return command


def _without_monitor(apply: Callable[[rank.PluginRequest], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def command(request: rank.PluginRequest) -> dict[str, Any]:
        result = apply(request)
        monitor.Monitor.start = _no_thread  # type: ignore[method-assign]
        return result

    return command


def _no_thread(self: Any) -> None:
    """The monitor's ``start`` in the ``recorder_no_heartbeat`` arm: no thread."""


def _install_local_gather(dist: Any) -> None:
    """STAND-IN for ``torch.distributed.all_gather_into_tensor``: every slot of the gathered tensor gets this rank's
    own row, as if every peer sent the same. The rest of SGLang's sync (its group objects, the tensors, the decoding
    of the gathered rows) is unchanged."""

    def all_gather_into_tensor(output: Any, input: Any, group: Any = None, async_op: bool = False) -> None:
        rows = output.numel() // input.numel()
        output.view(rows, input.numel()).copy_(input.reshape(1, -1).expand(rows, -1))

    dist.all_gather_into_tensor = all_gather_into_tensor


def _with_quiet_gc(rounds: Callable[[Any], Any], states: Any) -> Any:
    """A batch of rounds with the cyclic GC collected before it, never inside a timed round: its pauses are the
    largest noise of the per-round timings (bench/README.md)."""
    gc.collect()
    gc.disable()
    try:
        return rounds(states)
    finally:
        gc.enable()


def _after_undoing_passthrough(
    command: Callable[[rank.PluginRequest], dict[str, Any]], request: rank.PluginRequest
) -> dict[str, Any]:
    while _passthrough:
        owner, attr, original = _passthrough.pop()
        setattr(owner, attr, original)
    monitor.Monitor.start = _MONITOR_START  # type: ignore[method-assign]
    return command(request)


def _passthrough_seams(request: rank.PluginRequest) -> dict[str, Any]:
    """The plugin is applied once to learn its seams, then restored; each seam that is a function is then wrapped by
    a wrapper that only calls the original (same seams, same number of frames, none of the plugin's work)."""
    from sglang_dp_mtp_fix import plugin as p

    p.register()
    seams = [(ch.owner, ch.attr, ch.original, ch.patch_id or "plugin") for ch in p.get_manager().changes()]
    p.restore()
    names = []
    for owner, attr, original, patch_id in seams:
        bound = isinstance(original, classmethod)
        if not (callable(original) or bound):
            continue  # an ADD (hook or class default): stock has no such attribute and never calls it
        func = original.__func__ if bound else original

        def through(*args: Any, _f: Any = func, **kwargs: Any) -> Any:
            return _f(*args, **kwargs)

        wrapper = functools.wraps(func)(through)
        setattr(owner, attr, classmethod(wrapper) if bound else wrapper)
        _passthrough.append((owner, attr, original))
        names.append(f"{patch_id}:{getattr(owner, '__name__', owner)}.{attr}")
    return {"rank": rank.CONTEXT.rank, "seams": names}
