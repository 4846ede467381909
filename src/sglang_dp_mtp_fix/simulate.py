"""``sglang-dp-mtp-fix simulate``: the hang reproduced and fixed on CPU, stock vs patched on the same trace.

N CPU rank processes (gloo) import the installed SGLang and run a PD-decode workload through its real code (see
``harness/decode_round.py`` and ``harness/standins.py`` for exactly which decisions come from SGLang and which
stand-ins are used). Each round every
rank then performs the draft step's collectives as its chosen path would, so a split between graph and eager shows
up as a collective mismatch naming the ranks. The same trace runs twice in the same rank processes: stock (plugin
restored) and patched (plugin applied, exactly as ``load_plugins()`` applies it).

Trace format (``--trace FILE``, JSON lines): one line per round, ``{"ranks": [STATE, ...]}`` with one STATE per rank:
  kind: "none" | "idle" | "decode"        num_reqs: int >= 1 (decode)
  seed: bool (DSA top-k seed present)      overlap: bool (overlap scheduling: future_indices set)
  future_flag: bool (the future seed flag; default = seed)
  merge_seedless_prebuilt: bool (a seeded running batch absorbs a seedless prebuilt batch)
  seed_from_draft_extend: bool (default true)   has_draft_worker: bool (default true; false = non-last PP rank)

``--moe-a2a-backend TARGET --speculative-moe-a2a-backend DRAFT`` (SGLang's flags): both arms run as that deployment
(ServerArgs published on every rank, the plugin applied under it). Where the draft answers ``require_mlp_tp_gather``
differently from the target (``deepep`` / ``none``: the FP4 NextN recipe), stock ranks split the draft bucket or path
on their own counts and the patched arm (draft_token_counts) does not; the embedded trace then also draws batch sizes
across the draft graph's buckets and above its ``max_bs``.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_dp_mtp_fix.harness.decode_round import RoundResult

STATE_KEYS = {
    "kind", "num_reqs", "seed", "overlap", "future_flag", "merge_seedless_prebuilt", "seed_from_draft_extend",
    "has_draft_worker",
}  # fmt: skip
CHUNK = 100
# What simulate takes (a run is seconds per thousand rounds on CPU; a request costs memory in every round it is in)
MIN_RANKS, MAX_RANKS = 2, 8
MAX_ROUNDS = 100_000
MAX_NUM_REQS = 1024
MAX_TRACE_BYTES = 64 << 20
BOOL_KEYS = frozenset(STATE_KEYS - {"kind", "num_reqs", "future_flag"})


class TraceError(ValueError):
    """A trace file simulate refuses: one line naming the file, the line and what is wrong (the CLI's exit 2)."""


REAL = [
    "SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run (PD-decode round)",
    "SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch + prepare_mlp_sync_batch_raw + MLPSyncBatchInfo.all_gather "
    "(DP MLP sync over gloo: generic decode/verify/draft-extend vote, and the plugin's draft vote)",
    "EagleDraftInput (+ merge_batch), ScheduleBatch, Req, ForwardBatch.init_new",
    "EAGLEWorkerV2.requires_dp_attention_eager_forward (plugin), EAGLEDraftCudaGraphRunner.can_run_graph",
]
STAND_INS = [
    "scheduler / DP-attention adapter shells (get_new_prebuilt_batch -> None, update_running_batch -> unchanged)",
    "EAGLE worker, draft worker and draft graph runner made without __init__ (it loads models / captures graphs); "
    "the draft graph's bucket choice of its replay (captured sizes 8/16/32/64)",
    "model runner for ForwardBatch.init_new (a null object), decode tensors of prepare_for_decode",
    "the seedless guard of EagleDraftWorker.draft on the seed the FutureMap resolves (draft() needs a model)",
    "draft-step collectives: 3 all-gathers padded to the graph bucket (graph) or to the live max (eager)",
]


VOTE_PATCH = "draft_graph_vote"


def generate_trace(ranks: int, rounds: int, seed: int, wide: bool = False) -> list[list[dict[str, Any]]]:
    """Embedded default: idle ranks, PD arrivals without seeds in ~10 % of rounds, overlap-style merges.

    ``wide``: decode batches of 1-20 requests, and 60-70 in one of ten (across the draft graph's buckets and above
    its max_bs), for a deployment whose draft gathers token counts differently from the target."""
    rng = random.Random(seed)
    trace: list[list[dict[str, Any]]] = []
    for _ in range(rounds):
        states: list[dict[str, Any]] = []
        for _r in range(ranks):
            roll = rng.random()
            if roll < 0.30:
                states.append({"kind": "none"})
            elif roll < 0.40:
                states.append({"kind": "idle"})
            else:
                if wide:
                    n = rng.randint(1, 20) if rng.random() > 0.1 else rng.randint(60, 70)
                else:
                    n = rng.randint(1, 7)
                states.append({"kind": "decode", "num_reqs": n, "seed": True, "overlap": True})
        if rng.random() < 0.10:  # a PD arrival without a DSA seed lands on one rank
            active = [i for i, s in enumerate(states) if s["kind"] == "decode"] or [rng.randrange(ranks)]
            i = rng.choice(active)
            if states[i]["kind"] == "decode" and rng.random() < 0.5:
                states[i]["merge_seedless_prebuilt"] = True  # seeded running batch absorbs it (overlap merge)
            else:
                states[i] = {"kind": "decode", "num_reqs": rng.randint(1, 3), "seed": False, "overlap": True}
        trace.append(states)
    return trace


def state_problem(state: Any) -> str | None:
    """What is wrong with one rank's state of a trace line (the schema in the module doc), None if nothing."""
    if not isinstance(state, dict):
        return f"a rank state is a JSON object, not {json.dumps(state)[:40]}"
    unknown = sorted(set(state) - STATE_KEYS)
    if unknown:
        return f"unknown key(s) {', '.join(map(repr, unknown))} (keys: {', '.join(sorted(STATE_KEYS))})"
    if state.get("kind", "decode") not in ("none", "idle", "decode"):
        return f"kind {json.dumps(state.get('kind'))[:40]} is not one of none, idle, decode"
    n = state.get("num_reqs", 1)
    if type(n) is not int or not 1 <= n <= MAX_NUM_REQS:
        return f"num_reqs {json.dumps(n)[:40]} is not an integer from 1 to {MAX_NUM_REQS}"
    for key in sorted(BOOL_KEYS & set(state)):
        if not isinstance(state[key], bool):
            return f"{key} {json.dumps(state[key])[:40]} is not true or false"
    if state.get("future_flag") is not None and not isinstance(state["future_flag"], bool):
        return f"future_flag {json.dumps(state['future_flag'])[:40]} is not true, false or null"
    return None


def load_trace(path: Path, ranks: int | None) -> list[list[dict[str, Any]]]:
    """Read and check a whole trace file before any rank starts; raises TraceError (one line) on the first problem."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)
        text = raw.decode("utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceError(f"{path}: larger than {MAX_TRACE_BYTES >> 20} MiB")
    trace: list[list[dict[str, Any]]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep for the decoder
            raise TraceError(f'{where}: not JSON ({exc}); expected {{"ranks": [STATE, ...]}}') from None
        states = row.get("ranks") if isinstance(row, dict) else None
        if not isinstance(states, list):
            raise TraceError(f'{where}: expected {{"ranks": [STATE, ...]}}, got {line.strip()[:40]}')
        for rank, state in enumerate(states):
            problem = state_problem(state)
            if problem:
                raise TraceError(f"{where}: bad rank state of rank {rank}: {problem}")
        if not MIN_RANKS <= len(states) <= MAX_RANKS:
            raise TraceError(f"{where}: {len(states)} rank states; simulate runs {MIN_RANKS} to {MAX_RANKS} ranks")
        if trace and len(states) != len(trace[0]):
            raise TraceError(f"{where}: {len(states)} ranks, earlier lines have {len(trace[0])}")
        if len(trace) == MAX_ROUNDS:
            raise TraceError(f"{path}: more than {MAX_ROUNDS} rounds")
        trace.append(states)
    if not trace:
        raise TraceError(f"{path}: empty trace")
    if ranks is not None and ranks != len(trace[0]):
        raise TraceError(f"{path}: the trace has {len(trace[0])} ranks, --ranks says {ranks}")
    return trace


@dataclass
class Arm:
    rounds: int = 0
    rounds_with_batches: int = 0
    divergent_rounds: int = 0
    bucket_splits: int = 0  # rounds whose ranks agree on the draft path but not on its gathered size
    hangs: int = 0
    generic_graph_rate: float = 0.0
    draft_graph_rate: float = 0.0
    draft_eager_rounds: int = 0
    draft_eager_causes: dict[str, int] = field(default_factory=dict)
    collectives_per_round: float = 0.0
    median_round_ms: float = 0.0
    hang_examples: list[str] = field(default_factory=list)
    real_failure: str | None = None  # --unguarded: what the real collective did in the first split round


def summarize(per_round: list[list[RoundResult]], wall_ms: list[float]) -> Arm:
    arm = Arm(rounds=len(per_round))
    generic = draft = 0
    causes: Counter[str] = Counter()
    collectives = []
    for i, results in enumerate(per_round):
        ran = [r for r in results if r.ran]
        collectives.append(max(r.sync_collectives for r in results))
        if not ran:
            continue
        arm.rounds_with_batches += 1
        paths = {r.draft_path for r in ran}
        decode_votes = {r.decode_graph for r in ran}
        rows = {r.rank: r.draft_rows for r in ran if r.draft_gathers}
        bucket_split = len(paths) == 1 and len(set(rows.values())) > 1
        arm.bucket_splits += bucket_split
        if len(paths) > 1 or len(decode_votes) > 1 or bucket_split:
            arm.divergent_rounds += 1
        if any(r.collective == "split" for r in ran):
            arm.hangs += 1
            if len(arm.hang_examples) < 3:
                graph = [r.rank for r in ran if r.draft_path == "graph"]
                eager = [r.rank for r in ran if r.draft_path == "eager"]
                if bucket_split:
                    what = "draft graph buckets" if paths == {"graph"} else "eager draft rows"
                    arm.hang_examples.append(f"round {i}: ranks take different {what} {rows}")
                else:
                    arm.hang_examples.append(
                        f"round {i}: ranks {graph} replay the draft graph, ranks {eager} run eager"
                    )
        if decode_votes == {True}:
            generic += 1
        if paths == {"graph"}:
            draft += 1
        else:
            arm.draft_eager_rounds += 1
            for r in ran:
                if r.draft_path == "eager":
                    causes[str(r.eager_cause)] += 1
    n = max(arm.rounds_with_batches, 1)
    arm.generic_graph_rate = round(generic / n, 4)
    arm.draft_graph_rate = round(draft / n, 4)
    arm.draft_eager_causes = dict(causes)
    arm.collectives_per_round = round(statistics.mean(collectives), 3) if collectives else 0.0
    arm.median_round_ms = round(statistics.median(wall_ms), 3) if wall_ms else 0.0
    return arm


def first_split_round(pool: Any, trace: list[list[dict[str, Any]]]) -> int | None:
    """Guarded pass over the trace to find the first round whose ranks split (None if they never do)."""
    for start in range(0, len(trace), CHUNK):
        for i, results in enumerate(pool.run_trace(trace[start : start + CHUNK])):
            if any(r.collective == "split" for r in results):
                return start + i
    return None


def unguarded_failure(
    world: int,
    trace: list[list[dict[str, Any]]],
    apply: bool,
    progress: bool,
    backends: tuple[str, str] | None = None,
) -> str | None:
    """Replay the trace up to its first split round, then issue that round's collectives without the pre-flight:
    the real failure (gloo aborts the ranks on the size mismatch, or the 10 s timeout fires). Fresh ranks, because
    the failing ones do not survive it."""
    from sglang_dp_mtp_fix.harness.pool import RankError, RankPool

    with RankPool(world, load_plugins=apply, env={"SGLANG_PLUGINS": "dp_mtp_fix"}) as pool:
        pool.configure(backends, apply)
        split = first_split_round(pool, trace)
    if split is None:
        return None
    with RankPool(world, load_plugins=apply, env={"SGLANG_PLUGINS": "dp_mtp_fix"}) as pool:
        pool.configure(backends, apply)
        states = [{**s, "_unguarded": True} for s in trace[split]]
        if progress:
            print(f"  unguarded: issuing round {split}'s draft-step all-gathers as each rank chose", file=sys.stderr)
        try:
            (results,) = pool.run_trace([states], timeout=60)
        except RankError as exc:
            return f"round {split}: {exc}"
        paths = [r.draft_path for r in results]
        return f"round {split}: completed without failure (paths {paths})"


def run_arm(pool: Any, trace: list[list[dict[str, Any]]], label: str, progress: bool) -> Arm:
    per_round: list[list[RoundResult]] = []
    wall_ms: list[float] = []
    for start in range(0, len(trace), CHUNK):
        chunk = trace[start : start + CHUNK]
        t0 = time.perf_counter()
        per_round.extend(pool.run_trace(chunk))
        elapsed = (time.perf_counter() - t0) * 1e3
        wall_ms.extend([elapsed / len(chunk)] * len(chunk))
        if progress:
            done = min(start + CHUNK, len(trace))
            bar = "#" * (30 * done // len(trace))
            print(f"\r  {label:<8} [{bar:<30}] {done}/{len(trace)} rounds", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return summarize(per_round, wall_ms)


def simulate(
    ranks: int,
    rounds: int,
    seed: int,
    trace_path: Path | None,
    progress: bool,
    unguarded: bool = False,
    backends: tuple[str, str] | None = None,
    trace: list[list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """``trace``: already loaded and checked (the CLI's, before any rank starts); else ``trace_path`` or the
    embedded trace."""
    from sglang_dp_mtp_fix.harness.pool import RankPool

    wide = backends is not None and backends[0] != backends[1]
    if trace is None and trace_path:
        trace = load_trace(trace_path, ranks if ranks else None)
    elif trace is None:
        trace = generate_trace(ranks, rounds, seed, wide)
    world = len(trace[0])
    if progress:
        print(f"starting {world} CPU ranks (gloo) with the installed SGLang ...", file=sys.stderr)
    with RankPool(world, load_plugins=True, env={"SGLANG_PLUGINS": "dp_mtp_fix"}) as pool:
        configured = pool.configure(backends, patched=True)[0]
        statuses: dict[str, str] = configured["statuses"]
        gathers = {"target": configured["target_gathers"], "draft": configured["draft_gathers"]}
        version = pool.setup[0]["sglang"]
        # The arms compare the draft vote; the DSA/draft-row patches may be not-affected on this release.
        applied = bool(statuses) and statuses.get(VOTE_PATCH) == "applied"
        pool.configure(backends, patched=False)
        stock = run_arm(pool, trace, "stock", progress)
        patched = None
        counters = None
        if applied:
            pool.configure(backends, patched=True, env={"SGLANG_DP_MTP_FIX_STATS": "10000000"})
            patched = run_arm(pool, trace, "patched", progress)
            counters = [r["stats"] for r in pool.plugin("stats")]
            pool.plugin("restore")
    if unguarded:
        stock.real_failure = (
            unguarded_failure(world, trace, apply=False, progress=progress, backends=backends) or "no split round"
        )
        if patched is not None:
            patched.real_failure = (
                unguarded_failure(world, trace, apply=True, progress=progress, backends=backends) or "no split round"
            )
    return {
        "sglang_version": version,
        "ranks": world,
        "rounds": len(trace),
        "moe_a2a_backend": backends[0] if backends else None,
        "speculative_moe_a2a_backend": backends[1] if backends else None,
        "require_mlp_tp_gather": gathers,
        "plugin_statuses": statuses,
        "stock": asdict(stock),
        "patched": asdict(patched) if patched else None,
        "patched_vote_counters_per_rank": counters,
        "patched_note": None if applied else f"the plugin stands down on SGLang {version}: {statuses}",
        "real_sglang": REAL,
        "stand_ins": STAND_INS,
    }


def print_table(data: dict[str, Any]) -> None:
    stock, patched = data["stock"], data["patched"]
    print(f"SGLang {data['sglang_version']}, {data['ranks']} DP ranks (CPU, gloo), {data['rounds']} decode rounds")
    if data.get("moe_a2a_backend"):
        gathers = data["require_mlp_tp_gather"]
        print(
            f"  --moe-a2a-backend {data['moe_a2a_backend']} (gathers token counts: {gathers['target']}) "
            f"--speculative-moe-a2a-backend {data['speculative_moe_a2a_backend']} (gathers: {gathers['draft']})"
        )
    rows = [
        ("rounds with a batch on some rank", "rounds_with_batches", "{}"),
        ("rounds with divergent decisions", "divergent_rounds", "{}"),
        ("  of which draft-bucket/row splits", "bucket_splits", "{}"),
        ("hangs (collective split)", "hangs", "{}"),
        ("generic-graph rate", "generic_graph_rate", "{:.1%}"),
        ("draft-graph rate", "draft_graph_rate", "{:.1%}"),
        ("draft-eager rounds", "draft_eager_rounds", "{}"),
        ("MLP-sync collectives per round", "collectives_per_round", "{:.2f}"),
        ("median time per round (ms)", "median_round_ms", "{:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"  {'':<{width}}  {'stock':>12}  {'patched':>12}")
    for label, key, fmt in rows:
        right = fmt.format(patched[key]) if patched else "-"
        print(f"  {label:<{width}}  {fmt.format(stock[key]):>12}  {right:>12}")
    for name, arm in (("stock", stock), ("patched", patched)):
        if arm and arm["draft_eager_causes"]:
            causes = ", ".join(f"{k}: {v}" for k, v in sorted(arm["draft_eager_causes"].items()))
            print(f"  draft-eager rank-rounds by cause ({name}): {causes}")
    for example in stock["hang_examples"]:
        print(f"  stock hang: {example}")
    for name, arm in (("stock", stock), ("patched", patched)):
        if arm and arm.get("real_failure"):
            print(f"  {name}, unguarded collective: {arm['real_failure']}")
    if data["patched_note"]:
        print(f"  patched arm not run: {data['patched_note']}")
    print("  decisions from SGLang's real code: " + "; ".join(data["real_sglang"]))
    print("  stand-ins: " + "; ".join(data["stand_ins"]))
