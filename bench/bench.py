"""Benchmarks: patched vs stock SGLang side by side in one run, reported as medians and ratios.

Run inside a venv built by tools/mkvenv.sh (``bench/run.sh RELEASE`` does that) on an otherwise idle machine:
  1. collectives per decode round in SGLang's MLP sync (goal: ratio 1.00, no added collective);
  2. CPU time of the PD-decode round + MLP sync path, and of EAGLEDraftCudaGraphRunner.can_run_graph (goal <= 1.05x);
  3. plugin activation time per process beyond SGLang's own import (goal <= 50 ms);
  4. generic-graph and draft-graph rates on the embedded trace, against the correctness-first alternative that folds
     the seedless fallback into the generic vote (must keep 100 % generic where every rank is eligible).
Writes bench/results/<release>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import timeit
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEEDED = dict(kind="decode", seed=True, overlap=True, num_reqs=3)
SEEDLESS = dict(kind="decode", seed=False, overlap=True, num_reqs=2)


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def sync_path(pool, rounds: int) -> dict:
    """Median ms of SGLang's PD-decode round + MLP sync per rank, stock vs patched, interleaved blocks."""
    states = [[SEEDED if (i + r) % 5 else SEEDLESS for i in range(rounds)] for r in range(pool.world)]
    samples = {"stock": [], "patched": []}
    cpu = {"stock": [], "patched": []}
    collectives = {"stock": [], "patched": []}
    for block in range(6):
        for arm in ("stock", "patched") if block % 2 == 0 else ("patched", "stock"):
            pool.plugin("restore" if arm == "stock" else "apply")
            results = pool.rounds(states)
            samples[arm].extend(res.sync_ms for rank in results for res in rank)
            cpu[arm].extend(res.sync_cpu_ms for rank in results for res in rank)
            collectives[arm].extend(res.sync_collectives for rank in results for res in rank)
    pool.plugin("restore")
    med = {arm: statistics.median(v) for arm, v in samples.items()}
    med_cpu = {arm: statistics.median(v) for arm, v in cpu.items()}
    coll = {arm: statistics.mean(v) for arm, v in collectives.items()}
    return {
        "median_cpu_ms": med_cpu,
        "cpu_ratio": round(med_cpu["patched"] / med_cpu["stock"], 3),
        "median_wall_ms": med,
        "wall_ratio": round(med["patched"] / med["stock"], 3),
        "collectives_per_round": coll,
        "collectives_ratio": round(coll["patched"] / coll["stock"], 3) if coll["stock"] else None,
        "samples_per_arm": len(samples["stock"]),
    }


def sync_path_local(rounds: int, blocks: int = 10, recorder_root: str | None = None) -> dict:
    """The same round with SGLang's all-gather replaced by a local copy of the gathered rows (``harness_ext.py``,
    loaded into the ranks): each rank times SGLang's own ``get_next_disagg_decode_batch_to_run`` call alone (thread
    CPU, no batch construction, no waiting on a peer), in the same processes, interleaved blocks (arm order rotated;
    after each switch a short warm-up block that is not counted), the cyclic GC collecting between blocks, never
    inside one (``harness_ext.py`` too). Six arms: stock; ``stock_again`` (stock once more: an A/A pair, so the figures
    carry their own resolution); ``passthrough`` (the plugin's seams wrapped by wrappers that only call the original:
    the cost of wrapping those seams at all, none of the plugin's work); patched; ``recorder`` (patched with the
    flight recorder on, ``SGLANG_DP_MTP_FIX_RECORDER_DIR``: a fresh directory per block, the file really mapped, the
    monitor thread writing its heartbeat); ``recorder_no_heartbeat`` (the same without the monitor thread: the
    heartbeat's A/A bracket). ``recorder_root``: where the recorder arms' directories go (default: a new temporary
    directory), so the file system under the mapped file can be compared."""

    from sglang_dp_mtp_fix.harness.pool import RankPool
    from sglang_dp_mtp_fix.harness.rank import EXTENSION_ENV

    # Rank 0 alone runs rounds (rank 1 waits, idle): with the gather local, a rank needs no peer, and two ranks timed
    # at once on a 2-core host disturb each other (bench/README.md).
    states = [[SEEDED if i % 5 else SEEDLESS for i in range(rounds)], []]
    warm = [states[0][:50], []]
    arms = ("stock", "stock_again", "passthrough", "patched", "recorder", "recorder_no_heartbeat")
    recorder_root = tempfile.mkdtemp(prefix="sdmf-bench-recorder-", dir=recorder_root)
    # "apply" re-reads the environment only when it carries one: the patched arm applies with the recorder unset.
    command: dict[str, Any] = {
        "stock": "restore", "stock_again": "restore", "passthrough": "passthrough",
        "patched": {"command": "apply", "env": {"SGLANG_DP_MTP_FIX_RECORDER_DIR": ""}},
    }  # fmt: skip
    env = {"SGLANG_PLUGINS": "dp_mtp_fix", EXTENSION_ENV: str(HERE / "harness_ext.py")}
    recorder_command = {"recorder": "apply", "recorder_no_heartbeat": "apply_no_monitor"}
    with RankPool(2, load_plugins=True, env=env) as pool:
        seams = pool.plugin("passthrough")[0]["seams"]
        pool.plugin("restore")
        cpu, block_medians = _interleaved_blocks(pool, arms, command, recorder_command, recorder_root, states, warm,
                                                 blocks)  # fmt: skip
    med = {arm: statistics.median(v) for arm, v in cpu.items()}
    # Each arm's block median against the stock block of the same rotation (seconds apart).
    block_ratios = {
        arm: [p / s for s, p in zip(block_medians["stock"], block_medians[arm], strict=True)] for arm in arms[1:]
    }
    # Headline: the fastest block of each arm. Interference on a shared host only ever adds time, so the minimum is
    # the estimator it moves least (bench/README.md).
    fastest = {arm: min(v) for arm, v in block_medians.items()}
    return {
        "median_cpu_ms": med,
        "cpu_ratio": round(med["patched"] / med["stock"], 3),
        "aa_ratio": round(med["stock_again"] / med["stock"], 3),
        "passthrough_ratio": round(med["passthrough"] / med["stock"], 3),
        "recorder_ratio": round(med["recorder"] / med["stock"], 3),
        "recorder_vs_patched_us": round((med["recorder"] - med["patched"]) * 1e3, 2),
        "min_block_recorder_vs_patched_us": round((fastest["recorder"] - fastest["patched"]) * 1e3, 2),
        "paired_recorder_vs_patched_us": round(
            statistics.median(r - p for r, p in zip(block_medians["recorder"], block_medians["patched"], strict=True))
            * 1e3,
            2,
        ),
        # The heartbeat's A/A bracket: the recorder arm with and without the monitor thread (issue 33)
        "min_block_heartbeat_us": round((fastest["recorder"] - fastest["recorder_no_heartbeat"]) * 1e3, 2),
        "paired_heartbeat_us": round(
            statistics.median(
                r - q for r, q in zip(block_medians["recorder"], block_medians["recorder_no_heartbeat"], strict=True)
            )
            * 1e3,
            2,
        ),
        "passthrough_seams": seams,
        "added_us": {arm: round((med[arm] - med["stock"]) * 1e3, 2) for arm in arms[1:]},
        **{f"block_median_{arm}_ratios": [round(r, 3) for r in block_ratios[arm]] for arm in arms[1:]},
        "paired_ratio": {arm: round(statistics.median(block_ratios[arm]), 3) for arm in arms[1:]},
        "min_block_ratio": {arm: round(fastest[arm] / fastest["stock"], 3) for arm in arms[1:]},
        "min_block_added_us": {arm: round((fastest[arm] - fastest["stock"]) * 1e3, 2) for arm in arms[1:]},
        "block_medians_us": {arm: [round(m * 1e3, 2) for m in block_medians[arm]] for arm in arms},
        "samples_per_arm": len(cpu["stock"]),
    }


def _interleaved_blocks(
    pool: Any,
    arms: tuple[str, ...],
    command: dict[str, Any],
    recorder_command: dict[str, str],
    recorder_root: str,
    states: list[list[dict]],
    warm: list[list[dict]],
    blocks: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The rounds of ``--sync-local``: interleaved blocks, the arm order rotated, a short uncounted warm-up after each
    switch; a recorder arm (``recorder_command``: its plugin command) gets a fresh directory per block. Returns each
    arm's round CPU times and its block medians."""
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    block_medians: dict[str, list[float]] = {arm: [] for arm in arms}
    pool.rounds(states, collective=False)  # warm-up: first-call costs out of the figures
    for block in range(blocks):
        for arm in arms[block % len(arms) :] + arms[: block % len(arms)]:
            if arm in recorder_command:
                directory = os.path.join(recorder_root, f"{arm}-{block}")
                os.mkdir(directory)
                env = {"SGLANG_DP_MTP_FIX_RECORDER_DIR": directory}
                command[arm] = {"command": recorder_command[arm], "env": env}
            pool.plugin(command[arm])
            pool.rounds(warm, collective=False)
            results = pool.rounds(states, collective=False)
            got = [res.round_cpu_ms for rank in results for res in rank]
            cpu[arm].extend(got)
            block_medians[arm].append(statistics.median(got))
    pool.plugin("restore")
    return cpu, block_medians


def recorder_split(rounds: int, blocks: int, recorder_root: str | None = None) -> dict:
    """Where the recorder's cost goes (issue 33), in ``--sync-local``'s round: patched, ``patched_again`` (its A/A
    pair), the recorder (no heartbeat thread), and the recorder with its ring left in the process's private buffer
    (``recorder_private_ring``: the file is never created or mapped, every store the same; ``harness_ext``)."""
    from sglang_dp_mtp_fix.harness.pool import RankPool
    from sglang_dp_mtp_fix.harness.rank import EXTENSION_ENV

    states = [[SEEDED if i % 5 else SEEDLESS for i in range(rounds)], []]
    warm = [states[0][:50], []]
    arms = ("patched", "patched_again", "recorder_no_heartbeat", "recorder_private_ring")
    root = tempfile.mkdtemp(prefix="sdmf-bench-recorder-", dir=recorder_root)
    patched = {"command": "apply", "env": {"SGLANG_DP_MTP_FIX_RECORDER_DIR": ""}}
    command: dict[str, Any] = {"patched": patched, "patched_again": patched}
    recorder_command = {"recorder_no_heartbeat": "apply_no_monitor", "recorder_private_ring": "apply_private_ring"}
    env = {"SGLANG_PLUGINS": "dp_mtp_fix", EXTENSION_ENV: str(HERE / "harness_ext.py")}
    with RankPool(2, load_plugins=True, env=env) as pool:
        pool.plugin("restore")
        cpu, block_medians = _interleaved_blocks(pool, arms, command, recorder_command, root, states, warm, blocks)
    fastest = {arm: min(v) for arm, v in block_medians.items()}
    return {
        "fastest_block_us": {arm: round(v * 1e3, 2) for arm, v in fastest.items()},
        "min_block_vs_patched_us": {arm: round((fastest[arm] - fastest["patched"]) * 1e3, 2) for arm in arms[1:]},
        "paired_vs_patched_us": {
            arm: round(
                statistics.median(a - p for a, p in zip(block_medians[arm], block_medians["patched"], strict=True))
                * 1e3,
                2,
            )
            for arm in arms[1:]
        },
        "block_medians_us": {arm: [round(m * 1e3, 2) for m in block_medians[arm]] for arm in arms},
        "samples_per_arm": len(cpu["patched"]),
    }


def recorder_rounds(cycles: int, epochs: int, recorder_root: str | None = None) -> dict:
    """The recorder's cost per round, round by round (issue 33): ``--sync-local``'s round on rank 0, three
    configurations applied once per epoch, their rounds interleaved one by one (``harness_ext.interleaved_rounds``):
    patched, ``patched_again`` (its A/A pair: the estimator's own resolution) and the recorder (the file really
    mapped, the heartbeat thread running in the process, which all arms share). Estimator: the median over cycles of
    each arm's round minus patched's round of the same cycle."""
    from sglang_dp_mtp_fix.harness.pool import RankPool
    from sglang_dp_mtp_fix.harness.rank import EXTENSION_ENV

    directory = tempfile.mkdtemp(prefix="sdmf-bench-recorder-", dir=recorder_root)
    patched = {"command": "apply", "env": {"SGLANG_DP_MTP_FIX_RECORDER_DIR": ""}}
    recording = {"command": "apply", "env": {"SGLANG_DP_MTP_FIX_RECORDER_DIR": directory}}
    arms = [["patched", patched], ["patched_again", patched], ["recorder", recording]]
    states = [SEEDED if i % 5 else SEEDLESS for i in range(50)]
    warm = 50
    payload = {"arms": arms, "states": states, "cycles": cycles, "epochs": epochs, "warm": warm, "seed": 33}
    env = {"SGLANG_PLUGINS": "dp_mtp_fix", EXTENSION_ENV: str(HERE / "harness_ext.py")}
    with RankPool(2, load_plugins=True, env=env) as pool:
        pool.plugin("restore")
        pool.rounds([states, []], collective=False)  # first-call costs out of the figures
        idle = {"arms": arms, "states": [], "cycles": 0, "epochs": 0, "warm": 0}
        got = pool._send("interleaved_rounds", [payload, idle], timeout=3600)[0]  # noqa: SLF001 - bench-only command
    expected = epochs * (warm + cycles)
    if got["recorded"] != expected:  # a hollow run: the recorder arm did not record each of its rounds (or others did)
        raise SystemExit(f"recorder arm recorded {got['recorded']} rounds into its file, expected {expected}")
    times = got["times"]
    base = times["patched"]
    diffs = {arm: sorted(a - b for a, b in zip(v, base, strict=True)) for arm, v in times.items() if arm != "patched"}
    cut = len(base) // 10
    return {
        "protocol": f"{epochs} epochs x {cycles} cycles, one round of each arm per cycle in a shuffled order",
        "recorded_rounds": got["recorded"],
        "median_round_us": {arm: round(statistics.median(v), 2) for arm, v in times.items()},
        "p10_round_us": {arm: round(statistics.quantiles(v, n=10)[0], 2) for arm, v in times.items()},
        "paired_median_vs_patched_us": {arm: round(statistics.median(d), 2) for arm, d in diffs.items()},
        "paired_trimmed_mean_vs_patched_us": {
            arm: round(statistics.mean(d[cut : len(d) - cut]), 2) for arm, d in diffs.items()
        },
        "rounds_per_arm": len(base),
    }


def can_run_graph_time() -> dict:
    """In-process timing of the real can_run_graph on the real class (stand-in instance), stock vs patched, and
    patched with the flight recorder on (``recorder``: the round's path is marked unwritten before each call, so every
    call writes it as the first draft decision of a real round does; the other arms make the same store elsewhere)."""
    import functools
    import tempfile
    from types import SimpleNamespace

    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dp_mtp_fix import plugin
    from sglang_dp_mtp_fix.config import RECORDER_DIR_ENV
    from sglang_dp_mtp_fix.diagnosis import recorder
    from sglang_dp_mtp_fix.harness.standins import draft_runner_standin

    runner = draft_runner_standin(EAGLEDraftCudaGraphRunner, SpeculativeAlgorithm.from_string("EAGLE"))
    fb = SimpleNamespace(
        spec_info=None, batch_size=3, global_num_tokens_cpu=[3, 0, 2, 1], original_global_num_tokens_cpu=[3, 0, 2, 1],
        can_run_dp_cuda_graph=True, can_run_decode_cuda_graph=True, can_run_dp_draft_cuda_graph=True,
    )  # fmt: skip
    out: dict[str, list[float]] = {"stock": [], "patched": [], "recorder": []}
    directory = tempfile.mkdtemp(prefix="sdmf-bench-recorder-")

    for block in range(10):
        arms = ("stock", "patched", "recorder")
        for arm in arms[block % 3 :] + arms[: block % 3]:
            plugin.restore()
            if arm == "recorder":
                os.environ[RECORDER_DIR_ENV] = directory
            if arm != "stock":
                plugin.register()
            os.environ.pop(RECORDER_DIR_ENV, None)
            rec = recorder.active()
            if rec is not None:
                rec.enter()
                rec.sync(3, 2, 15)  # the round's record (its path goes into it)
            step = functools.partial(setattr, rec if rec is not None else SimpleNamespace(), "path_round", 0)
            n = 20000
            out[arm].append(timeit.timeit(lambda s=step: (s(), runner.can_run_graph(fb)), number=n) / n * 1e9)
    plugin.restore()
    med = {arm: statistics.median(v) for arm, v in out.items()}
    return {
        "median_ns": med,
        "ratio": round(med["patched"] / med["stock"], 3),
        "recorder_vs_patched_ns": round(med["recorder"] - med["patched"], 1),
    }


ACTIVATION = """
import json, sys, time
import sglang.srt.managers.scheduler  # what a scheduler process has imported before load_plugins()
if sys.argv[1] in ("warm", "dsa-warm"):  # the speculative modules SGLang imports moments later for EAGLE anyway
    import sglang.srt.speculative.eagle_worker_v2, sglang.srt.speculative.eagle_draft_cuda_graph_runner
if sys.argv[1] == "dsa-warm":  # ... and the DSA modules a GLM-5.2 (DSA) scheduler imports when it builds the model
    import sglang.srt.layers.attention.dsa_backend, sglang.srt.layers.attention.dsa.dsa_indexer
t0 = time.perf_counter()
from sglang_dp_mtp_fix import plugin
outcomes = plugin.register()
print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3, "statuses": [o.status.value for o in outcomes]}))
"""


def compile_as_installed(package_dir: str) -> None:
    """Compile the plugin as pip does at install time, so a measured process reads its bytecode. Without it (a fresh
    ``git archive``, or PYTHONDONTWRITEBYTECODE=1) every fresh process recompiles the sources inside its figure."""
    import compileall

    compileall.compile_dir(package_dir, quiet=1)


def activation_time(repeats: int = 5) -> dict:
    """register() in a fresh process after SGLang's own imports ('warm': the speculative modules an EAGLE scheduler
    imports anyway are loaded; 'dsa-warm': the DSA attention modules a DSA model imports are loaded too; 'cold': our
    checks import all of them first, shifting that cost earlier)."""
    import sglang_dp_mtp_fix

    compile_as_installed(os.path.dirname(sglang_dp_mtp_fix.__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DP_MTP_FIX")}
    out = {}
    for mode in ("warm", "dsa-warm", "cold"):
        runs, statuses = [], None
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ACTIVATION), mode], env=env,
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append(run["ms"])
            statuses = run["statuses"]
        out[mode] = {"median_ms": round(statistics.median(runs), 2), "runs_ms": [round(r, 2) for r in runs],
                     "statuses": statuses}  # fmt: skip
    out["median_ms"] = out["warm"]["median_ms"]
    return out


def graph_rates(rounds: int, ranks: int) -> dict:
    from sglang_dp_mtp_fix import simulate

    data = simulate.simulate(ranks, rounds, 0, None, progress=False)
    patched, stock = data["patched"], data["stock"]
    # The correctness-first alternative folds the seedless fallback into the generic vote: every round whose draft
    # vote is "no" also loses target-verify/draft-extend graphs, i.e. generic rate == draft rate on the same trace.
    folded_generic = round(1 - patched["draft_eager_rounds"] / patched["rounds_with_batches"], 4)
    return {
        "rounds": rounds,
        "ranks": ranks,
        "ours": {"generic_graph_rate": patched["generic_graph_rate"], "draft_graph_rate": patched["draft_graph_rate"]},
        "folded_alternative": {"generic_graph_rate": folded_generic, "draft_graph_rate": patched["draft_graph_rate"]},
        "stock": {
            "generic_graph_rate": stock["generic_graph_rate"],
            "draft_graph_rate": stock["draft_graph_rate"],
            "hangs": stock["hangs"],
        },  # fmt: skip
        "median_round_ms": {"stock": stock["median_round_ms"], "patched": patched["median_round_ms"]},
    }


def activation_only() -> None:
    """``bench.py --activation``: only the activation figures, to results/activation-<release>.json."""
    from importlib.metadata import version

    from sglang_dp_mtp_fix import _version

    release = version("sglang")
    result = activation_time()
    result.update(sglang_version=release, date=time.strftime("%Y-%m-%d"), machine=machine(),
                  plugin_version=_version.__version__)  # fmt: skip
    out = HERE / "results" / f"activation-{release}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"SGLang {release} on {result['machine']['cpu']} ({result['machine']['cores']} cores): activation "
        + ", ".join(f"{m} {result[m]['median_ms']} ms" for m in ("warm", "dsa-warm", "cold"))
        + f"; wrote {out}"
    )


def _fs_type(path: str) -> str:
    """The file system type under ``path`` (from /proc/mounts: the longest mount point that holds it)."""
    real, best = os.path.realpath(path), ("", "unknown")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fs = line.split()[:3]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                best = (point, fs)
    return best[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--activation", action="store_true", help="only the activation figures")
    mode.add_argument("--sync-local", action="store_true", help="only the sync path without a collective")
    mode.add_argument(
        "--recorder-split", action="store_true", help="--sync-local's round: where the recorder's cost goes (issue 33)"
    )
    mode.add_argument(
        "--recorder-rounds", action="store_true", help="--sync-local's round: the recorder's cost, rounds interleaved"
    )
    ap.add_argument("--rounds", type=int, default=150, help="--sync-local: rounds per block (default 150)")
    ap.add_argument("--blocks", type=int, default=40, help="--sync-local: blocks per arm (default 40)")
    ap.add_argument("--cycles", type=int, default=2000, help="--recorder-rounds: cycles per epoch (default 2000)")
    ap.add_argument("--epochs", type=int, default=4, help="--recorder-rounds: epochs (default 4)")
    ap.add_argument(
        "--out", type=Path, default=None, help="--sync-local: write here (default results/sync-local-<release>.json)"
    )
    ap.add_argument(
        "--recorder-root", default=None, help="--sync-local: the recorder arms' files go under here (default: $TMPDIR)"
    )
    return ap.parse_args(argv)


def main() -> None:
    from importlib.metadata import version

    from sglang_dp_mtp_fix.harness.pool import RankPool

    args = parse_args()
    if args.activation:
        activation_only()
        return
    if args.recorder_split or args.sync_local or args.recorder_rounds:
        # the same round, three protocols: the six arms, where the recorder's cost goes, or rounds interleaved
        release = version("sglang")
        root = args.recorder_root or tempfile.gettempdir()
        if args.recorder_rounds:
            name, figures = "recorder-rounds", recorder_rounds(args.cycles, args.epochs, recorder_root=root)
        else:
            run, name = (recorder_split, "recorder-split") if args.recorder_split else (sync_path_local, "sync-local")
            figures = run(rounds=args.rounds, blocks=args.blocks, recorder_root=root)
        result = {"sglang_version": release, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                  "load_avg_before": os.getloadavg(), "recorder_root_fs": _fs_type(root), **figures,
                  "load_avg_after": os.getloadavg()}  # fmt: skip
        out = args.out or HERE / "results" / f"{name}-{release}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return
    release = version("sglang")
    t0 = time.time()
    result = {"sglang_version": release, "machine": machine(), "date": time.strftime("%Y-%m-%d")}
    # Two ranks, one per core: CPU time of the round is then not inflated by ranks contending for a core.
    with RankPool(2, load_plugins=True, env={"SGLANG_PLUGINS": "dp_mtp_fix"}) as pool:
        result["mlp_sync_path"] = sync_path(pool, rounds=400)
    result["can_run_graph"] = can_run_graph_time()
    result["activation"] = activation_time()
    result["graph_rates"] = graph_rates(rounds=2000, ranks=4)
    result["wall_s"] = round(time.time() - t0, 1)
    out = HERE / "results" / f"{release}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    s, c, a, g = result["mlp_sync_path"], result["can_run_graph"], result["activation"], result["graph_rates"]
    print(f"SGLang {release} on {result['machine']['cpu']} ({result['machine']['cores']} cores)")
    print(f"  MLP-sync collectives per decode round: stock {s['collectives_per_round']['stock']:.2f}, "
          f"patched {s['collectives_per_round']['patched']:.2f} (ratio {s['collectives_ratio']})")  # fmt: skip
    print(f"  PD-decode round + MLP sync, median CPU per rank: stock {s['median_cpu_ms']['stock']:.3f} ms, "
          f"patched {s['median_cpu_ms']['patched']:.3f} ms (ratio {s['cpu_ratio']}); wall "
          f"{s['median_wall_ms']['stock']:.3f} vs {s['median_wall_ms']['patched']:.3f} ms "
          f"(ratio {s['wall_ratio']})")  # fmt: skip
    print(f"  can_run_graph: stock {c['median_ns']['stock']:.0f} ns, patched {c['median_ns']['patched']:.0f} ns "
          f"(ratio {c['ratio']})")  # fmt: skip
    print(f"  plugin activation beyond SGLang's import: median {a['warm']['median_ms']} ms warm, "
          f"{a['dsa-warm']['median_ms']} ms with the DSA modules imported ({a['cold']['median_ms']} ms when it is the "
          "first to import SGLang's speculative modules)")  # fmt: skip
    print(f"  generic-graph rate: ours {g['ours']['generic_graph_rate']:.1%}, folded alternative "
          f"{g['folded_alternative']['generic_graph_rate']:.1%}; draft-graph rate {g['ours']['draft_graph_rate']:.1%}; "
          f"stock hangs {g['stock']['hangs']} / {g['rounds']} rounds")  # fmt: skip
    print(f"  wrote {out}")


if __name__ == "__main__":
    main()
