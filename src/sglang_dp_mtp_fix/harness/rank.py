"""Code that runs inside one CPU rank process: its setup, and the commands the pool sends it.

REAL SGLang: ``ServerArgs`` + publish, ``init_distributed_environment`` (gloo) + ``initialize_model_parallel``; the
round itself is ``decode_round.py`` (its stand-ins: ``standins.py``), the collectives around it ``collectives.py``.

Commands are two tables, ``COMMANDS`` (what ``pool.py`` sends) and ``PLUGIN_COMMANDS`` (the ``plugin`` command's
own: apply, restore, stats, export_metrics); an unknown name raises ``UnknownCommand``. A file named by
``SGLANG_DP_MTP_FIX_HARNESS_EXTENSION`` is loaded at the end of setup and its ``install()`` called: it may register
more commands or wrap these (``bench/harness_ext.py`` adds the benchmarks' arms that way).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness.collectives import CollectiveCounter, path_collective
from sglang_dp_mtp_fix.harness.context import CONTEXT, RankContext, publish_server_args
from sglang_dp_mtp_fix.harness.decode_round import RoundResult, gather_answers, run_round
from sglang_dp_mtp_fix.harness.standins import ModelRunnerStandIn, decode_tensors, draft_runner_standin

# Names other modules, tests and bench/ import from here.
__all__ = [
    "COMMANDS",
    "CONTEXT",
    "EXTENSION_ENV",
    "PLUGIN_COMMANDS",
    "ModelRunnerStandIn",
    "PluginRequest",
    "RankContext",
    "RoundResult",
    "UnknownCommand",
    "configure",
    "decode_tensors",
    "draft_runner_standin",
    "handle",
    "plugin",
    "publish_server_args",
    "register_command",
    "register_plugin_command",
    "run_round",
    "run_rounds",
    "setup",
]

EXTENSION_ENV = "SGLANG_DP_MTP_FIX_HARNESS_EXTENSION"


class UnknownCommand(ValueError):
    """A command no table knows. Raised rather than ignored: a misspelt "apply" must not run SGLang stock while the
    caller believes it patched."""


def setup(rank: int, world: int, port: int, model_path: str, load_plugins: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    import sglang  # noqa: F401
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs

    if load_plugins:
        from sglang.srt.plugins import load_plugins as sglang_load_plugins

        sglang_load_plugins()
    sa = ServerArgs(
        model_path=model_path, device="cpu", tp_size=world, dp_size=world, enable_dp_attention=True,
        skip_tokenizer_init=True, load_format="dummy",
    )  # fmt: skip
    publish_server_args(sa, rank)
    CONTEXT.server_args = CONTEXT.baseline_server_args = sa
    ps.init_distributed_environment(
        backend="gloo", world_size=world, rank=rank, local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
        ps.initialize_model_parallel(tensor_model_parallel_size=world, attention_data_parallel_size=world)
    else:
        ps.initialize_model_parallel()
    import datetime

    import torch.distributed as dist

    # The draft step's emulated collectives run on their own group with a bounded timeout (10 s).
    CONTEXT.path_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
    CONTEXT.rank, CONTEXT.world = rank, world
    extension = os.environ.get(EXTENSION_ENV)
    if extension:
        _install_extension(extension)
    from importlib.metadata import version

    return {"rank": rank, "sglang": version("sglang"), "setup_s": round(time.perf_counter() - t0, 2)}


def _install_extension(path: str) -> None:
    spec = importlib.util.spec_from_file_location("sglang_dp_mtp_fix_harness_extension", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{EXTENSION_ENV}={path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


def configure(command: dict[str, Any]) -> dict[str, Any]:
    """One deployment on every rank together: ``{"backends": [TARGET, DRAFT] | None, "patched": bool}``.

    Publishes this rank's ServerArgs with ``--moe-a2a-backend TARGET --speculative-moe-a2a-backend DRAFT`` (the
    baseline ServerArgs of ``setup`` when None) and initializes the MoE config from it, as a scheduler process does
    at start; then applies the plugin afresh under it (its patches read the configuration at application, e.g.
    draft_token_counts' draft answer) or leaves SGLang stock."""
    from sglang_dp_mtp_fix.harness import draft_counts

    draft_counts.scale_up(False)
    backends = command.get("backends")
    if backends:
        target, draft = backends
        CONTEXT.server_args = draft_counts.server_args(target, draft, world=CONTEXT.world, rank=CONTEXT.rank)
    else:
        CONTEXT.server_args = CONTEXT.baseline_server_args
        publish_server_args(CONTEXT.server_args, CONTEXT.rank)
        draft_counts.initialize_moe_config(CONTEXT.server_args)
    CONTEXT.gather_answers = None
    answers = gather_answers()
    plugin("restore")
    statuses = plugin({"command": "apply", "env": command.get("env") or {}})["statuses"] if command["patched"] else {}
    return {"rank": CONTEXT.rank, "statuses": statuses, "target_gathers": answers[0], "draft_gathers": answers[1]}


def scale_up(expanded: bool) -> dict[str, Any]:
    """Elastic EP scale-up on this rank, mid-run (``draft_counts.scale_up``'s stand-in): SGLang's
    ``require_mlp_tp_gather`` answers True from the next round on; the round re-reads both answers."""
    from sglang_dp_mtp_fix.harness import draft_counts

    draft_counts.scale_up(expanded)
    CONTEXT.gather_answers = None
    target, draft = gather_answers()
    return {"rank": CONTEXT.rank, "target_gathers": target, "draft_gathers": draft}


def run_rounds(states: list[dict[str, Any]], collective: bool = True) -> list[RoundResult]:
    """Many rounds in a row (ranks stay in lock-step through SGLang's own sync); one reply for the batch.

    A state may carry ``"_unguarded": true`` to issue that round's draft-step collectives without the pre-flight.
    """
    out = []
    for state in states:
        with CollectiveCounter() as counter:
            result = run_round(state)
        result.sync_collectives = counter.count
        if collective and result.ran:
            # A draft that does not gather has no gathered MoE: only its path is compared (1 row each).
            rows = result.draft_rows if result.draft_rows is not None else 1
            result.collective, result.paths = path_collective(
                result.draft_path == "graph", rows, guarded=not state.get("_unguarded", False)
            )
        out.append(result)
    return out


# ---- commands -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginRequest:
    """``"apply"``, or ``{"command": "apply", "env": {...}, "labels": {...}}``: a plugin command and its arguments."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, command: str | dict[str, Any]) -> PluginRequest:
        if isinstance(command, str):
            return cls(command)
        return cls(command["command"], dict(command.get("env") or {}), dict(command.get("labels") or {}))


PluginHandler = Callable[[PluginRequest], dict[str, Any]]
Handler = Callable[[Any], Any]


def _stats(request: PluginRequest) -> dict[str, Any]:
    from sglang_dp_mtp_fix.diagnosis import stats

    counters = stats.active()
    return {"rank": CONTEXT.rank, "stats": counters.total.as_dict() if counters else None}


def _export_metrics(request: PluginRequest) -> dict[str, Any]:
    """What the end of Scheduler.__init__ does when SGLang runs with --enable-metrics, for a scheduler whose metrics
    collector carries ``labels`` (the stand-in holds only what metrics.install reads)."""
    from sglang_dp_mtp_fix import _version
    from sglang_dp_mtp_fix import plugin as p
    from sglang_dp_mtp_fix.config import PROMETHEUS_DIR_ENV
    from sglang_dp_mtp_fix.diagnosis import metrics

    # Set before prometheus_client is imported (it picks multiprocess mode then, as in SGLang), unset after: a
    # later apply in this rank must not see metrics on.
    os.environ[PROMETHEUS_DIR_ENV] = request.env[PROMETHEUS_DIR_ENV]
    scheduler = SimpleNamespace(metrics_collector=SimpleNamespace(labels=dict(request.labels)))
    try:
        line = metrics.install(scheduler, p.get_manager().outcomes or [], _version.__version__)
    finally:
        os.environ.pop(PROMETHEUS_DIR_ENV)
    return {"rank": CONTEXT.rank, "line": line}


def _apply(request: PluginRequest) -> dict[str, Any]:
    """Applies the plugin, under ``request.env`` when given (read at application: re-applied afresh then)."""
    from sglang_dp_mtp_fix import plugin as p

    env = request.env
    saved = {k: os.environ.get(k) for k in env}
    if env:
        p.restore()
    os.environ.update(env)
    try:
        outcomes = p.register()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"rank": CONTEXT.rank, "statuses": {o.id: o.status.value for o in outcomes}}


def _restore(request: PluginRequest) -> dict[str, Any]:
    from sglang_dp_mtp_fix import plugin as p

    p.restore()
    return {"rank": CONTEXT.rank, "statuses": {}}


PLUGIN_COMMANDS: dict[str, PluginHandler] = {
    "apply": _apply,
    "restore": _restore,
    "stats": _stats,
    "export_metrics": _export_metrics,
}


def plugin(command: str | dict[str, Any]) -> dict[str, Any]:
    """apply / restore the plugin in this rank (all ranks do it together), or read its vote counters.

    ``{"command": "apply", "env": {...}}`` applies under extra environment variables (e.g. the stats switch);
    ``{"command": "export_metrics", "env": {"PROMETHEUS_MULTIPROC_DIR": d}, "labels": {...}}`` exports the counters.
    """
    request = PluginRequest.parse(command)
    handler = PLUGIN_COMMANDS.get(request.name)
    if handler is None:
        raise UnknownCommand(f"unknown plugin command {request.name!r} (known: {', '.join(sorted(PLUGIN_COMMANDS))})")
    return handler(request)


COMMANDS: dict[str, Handler] = {
    "round": run_round,
    "rounds": run_rounds,
    "decisions": lambda states: run_rounds(states, collective=False),  # fuzz --fast: no draft-step emulation
    "plugin": plugin,
    "configure": configure,
    "scale_up": scale_up,
}


def handle(command: str, payload: Any) -> Any:
    """Runs one command the pool sent."""
    handler = COMMANDS.get(command)
    if handler is None:
        raise UnknownCommand(f"unknown harness command {command!r} (known: {', '.join(sorted(COMMANDS))})")
    return handler(payload)


def register_command(name: str, handler: Handler) -> Handler | None:
    """Adds or replaces a pool command; returns the handler it replaced, so a wrapper can call it."""
    previous = COMMANDS.get(name)
    COMMANDS[name] = handler
    return previous


def register_plugin_command(name: str, handler: PluginHandler) -> PluginHandler | None:
    """Adds or replaces a plugin command; returns the handler it replaced, so a wrapper can call it."""
    previous = PLUGIN_COMMANDS.get(name)
    PLUGIN_COMMANDS[name] = handler
    return previous
