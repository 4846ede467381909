"""What a run leaves behind, read back: node logs, the trigger plugin's observer records, each rank's stack while
stuck, and ``rollcall`` over the plugin's flight-recorder files."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from tier.conf import CPU, NODES
from tier.servers import Server

REPORT = re.compile(r"sglang-dp-mtp-fix \S+ on SGLang [^\n]*")
DECODE = re.compile(r"Decode batch[^\n]*?#running-req: (\d+)[^\n]*?(?:cuda|cpu) graph: (True|False)")  # cpu: DRIVE_CPU
ACCEPT = re.compile(r"Decode batch[^\n]*? accept len: ([\d.]+)")
EVIDENCE = {
    "plugin": r"sglang-dp-mtp-fix (?!stats)",
    "captures": r"Capture [\w -]*CUDA graph end",
    "errors": r"Traceback|Error|StubCalled|NCCL WARN|Watchdog caught|watchdog timeout",
    "nccl_comms": r"Init COMPLETE",
}
# what must never appear in a scheduler's log during a soak (the DP controllers of nodes 1..N-1 log a soft
# "DataParallelController watchdog timeout" every 30 s while they have nothing to route: not a scheduler's)
SCHEDULER_FAULT = re.compile(r"Traceback|AssertionError|Exception in|Scheduler watchdog|Watchdog caught|NCCL WARN")


def log_evidence(s: Server) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    for name, log in s.logs().items():
        lines = log.splitlines()
        graphs = [g for _, g in DECODE.findall(log)]
        ev[name] = {k: [ln[:400] for ln in lines if re.search(p, ln)][:12] for k, p in EVIDENCE.items()}
        ev[name]["decode_cuda_graph"] = {"True": graphs.count("True"), "False": graphs.count("False")}
        stats = [ln[:300] for ln in lines if "stats (last" in ln and "forced-eager=0" not in ln]
        ev[name]["stats_forced_eager"] = stats[:6]
    return ev


class DecodeCounter:
    """Each DP rank's decode batches so far, from its node's ``Decode batch`` lines (``--decode-log-interval 1``),
    read incrementally: the seed's own metric, with the target-verify graph on or off in each and the batch size."""

    def __init__(self, s: Server, offset: dict[int, int] | None = None) -> None:
        self.s = s
        self.offset = dict(offset) if offset else {r: 0 for r in s.ranks}
        self.graph = {r: {"on": 0, "off": 0} for r in s.ranks}
        self.max_running = {r: 0 for r in s.ranks}
        self.running_hist: dict[int, dict[int, int]] = {r: {} for r in s.ranks}
        self.accept: dict[int, list[float]] = {r: [] for r in s.ranks}

    @classmethod
    def from_now(cls, s: Server) -> DecodeCounter:
        """A counter of what the logs say from now on (a server that served an earlier leg, stage pd)."""
        past = cls(s)
        past.read()
        return cls(s, past.offset)

    def read(self) -> dict[int, int]:
        for r in self.s.ranks:
            with open(self.s.node_of(r).log_path, "rb") as f:
                f.seek(self.offset[r])
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1  # whole lines only
            self.offset[r] += cut
            text = chunk[:cut].decode("utf-8", "replace")
            self.accept[r] += [float(x) for x in ACCEPT.findall(text)]  # each decode batch's mean accepted length
            for running, graph in DECODE.findall(text):
                self.graph[r]["on" if graph == "True" else "off"] += 1
                k = int(running)
                self.max_running[r] = max(self.max_running[r], k)
                self.running_hist[r][k] = self.running_hist[r].get(k, 0) + 1
        return {r: g["on"] + g["off"] for r, g in self.graph.items()}


def log_sizes(s: Server) -> dict[str, int]:
    return {n.name: os.path.getsize(n.log_path) for n in s.all_nodes()}


def scheduler_faults(s: Server, since: dict[str, int] | None = None) -> dict[str, list[str]]:
    """Fault lines in each node's log after ``since`` (byte offsets, e.g. when traffic began: the soft watchdog also
    fires during a cold start's graph capture, which is not the soak's)."""
    out = {}
    for n in s.all_nodes():
        with open(n.log_path, "rb") as f:
            f.seek((since or {}).get(n.name, 0))
            text = f.read().decode("utf-8", "replace")
        out[n.name] = [ln[:300] for ln in text.splitlines() if SCHEDULER_FAULT.search(ln)][:8]
    return out


def read_records(records: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(records, "rank*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    return {"n": len(v), "median": round(statistics.median(v), 3), "p10": round(v[len(v) // 10], 3),
            "p90": round(v[9 * len(v) // 10], 3)}  # fmt: skip


def step_table(drafts: list[dict[str, Any]]) -> dict[int, dict[int, dict[str, Any]]]:
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for r in drafts:
        steps.setdefault(r["step"], {})[r["rank"]] = r
    return steps


def round_times(drafts: list[dict[str, Any]], steps: dict[int, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """ms per decode round on rank 0: the gap from one draft step to the next (one a round), by the group's path in
    the earlier step (eager: every rank eager; graph: every rank graph); gaps over 2 s are idle time, left out."""
    ts = sorted((r["t"], r["step"]) for r in drafts if r["rank"] == 0)
    by: dict[str, list[float]] = {"graph": [], "eager": []}
    for (a, step), (b, _) in zip(ts, ts[1:], strict=False):
        paths = {x["path"] for x in steps[step].values()}
        if b - a < 2 and len(paths) == 1:
            by[paths.pop()].append(1000 * (b - a))
    return {k: spread(v) for k, v in by.items()}


def analyze(records: str) -> dict[str, Any]:
    return summarize(read_records(records))


def summarize(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The observer's records of one arm, every rank's: draft steps by path, seedless, eager and split steps, round
    and draft-step times."""
    drafts = [r for r in recs if r["kind"] == "draft"]
    steps = step_table(drafts)
    keys = ("mode", "bs", "rids", "seed", "can_run", "stock_guard_eager", "path")
    brief = {s: {rk: {k: r.get(k) for k in keys} for rk, r in p.items()} for s, p in steps.items()}
    seedless = [s for s, p in sorted(steps.items()) if any(x["mode"] != "IDLE" and x["seed"] is None
                                                           for x in p.values())]  # fmt: skip
    split = [s for s, p in sorted(steps.items()) if len({x["path"] for x in p.values()}) > 1]
    group_eager = [s for s, p in steps.items() if len(p) == NODES and all(x["path"] == "eager" for x in p.values())]
    paths = {rk: {p: sum(1 for r in drafts if r["rank"] == rk and r["path"] == p) for p in ("graph", "eager")}
             for rk in range(NODES)}  # fmt: skip
    timed = [r for r in recs if r["kind"] == "draft-time"]
    return {
        "meta": [r for r in recs if r["kind"] in ("meta", "init-comms")],
        "observer_errors": [r for r in recs if r["kind"] == "observer-error"][:3],
        "draft_steps": {rk: sum(1 for r in drafts if r["rank"] == rk) for rk in range(NODES)}, "paths": paths,
        "steps_all_ranks": sum(1 for p in steps.values() if len(p) == NODES),
        "group_eager_steps": len(group_eager),
        "seedless_steps": seedless, "eager_steps": sorted({r["step"] for r in drafts if r["path"] == "eager"}),
        "split_steps": split,
        "seedless_step_records": {s: brief[s] for s in seedless[:6]},
        "split_step_records": {s: brief[s] for s in split[:4]},
        "last_step": max(steps, default=None), "t_last_step": max((r["t"] for r in drafts), default=None),
        "round_ms": round_times(drafts, steps),
        "draft_ms": {f"{w}_{p}": spread([r[f"{w}_ms"] for r in timed if r["path"] == p])
                     for w in ("gpu", "host") for p in ("graph", "eager")},
    }  # fmt: skip


def scheduler_pids(records: str) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in read_records(records) if r["kind"] == "meta"}


def stacks(records: str) -> dict[str, Any]:
    """Each scheduler's stack, three ways, so that one failing leaves the others: py-spy (native frames too), the
    trigger's faulthandler on SIGUSR1, and the trigger's own thread that dumps on a request file."""
    pids = scheduler_pids(records)
    for pid in pids.values():
        open(os.path.join(records, f"dump-{pid}.req"), "w").close()
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2)
    ev: dict[str, Any] = {"scheduler_pids": pids, "pyspy": {}, "faulthandler": {}, "thread_dump": {}}
    for rank, pid in sorted(pids.items()):
        for kind, name in (("faulthandler", f"stack-{pid}.txt"), ("thread_dump", f"stack-{pid}-thread.txt")):
            path = os.path.join(records, name)
            text = open(path).read() if os.path.exists(path) else ""
            blocks = [b for b in text.split("\n\n") if "run_scheduler_process" in b] or [text]
            ev[kind][rank] = blocks[-1].splitlines()[:40]
        try:
            r = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
            ev["pyspy"][rank] = (r.stdout or r.stderr).splitlines()[:60]
        except Exception as exc:  # noqa: BLE001 - evidence is best effort
            ev["pyspy"][rank] = [repr(exc)]
    ev["have_stack"] = {rank: [k for k in STACK_KINDS if is_stack(ev[k][rank])] for rank in pids}
    return ev


STACK_KINDS = ("pyspy", "thread_dump", "faulthandler")  # in the order a reader prefers them


def is_stack(lines: list[str]) -> bool:
    """More than a header or an error line came back."""
    return len(lines) > 2


def stacks_text(stuck: dict[str, Any]) -> str:
    """Each rank's stack as the evidence holds it: py-spy's, else the thread dump's, else faulthandler's."""
    out = []
    for rank in sorted(stuck.get("scheduler_pids", {})):
        kind = next((k for k in STACK_KINDS if is_stack(stuck[k].get(rank, []))), None)
        lines = stuck[kind][rank][:24] if kind else ["no stack came back"]
        out.append(f"  rank {rank} ({kind}):\n    " + "\n    ".join(lines))
    return "\n".join(out)


def stuck_evidence(s: Server, records: str) -> dict[str, Any]:
    """Where each rank is while requests are pending (the processes still run)."""
    ev: dict[str, Any] = {"alive": {n.name: n.alive() for n in s.all_nodes()}, **stacks(records)}
    if not CPU:
        ev["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"],
                                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    ev["log_tails"] = {k: [ln[:300] for ln in v.splitlines()[-25:]] for k, v in s.logs().items()}
    ev["watchdog"] = {k: [ln[:300] for ln in v.splitlines() if re.search(r"watchdog|Watchdog", ln)][:10]
                      for k, v in s.logs().items()}  # fmt: skip
    return ev


def rollcall(recorder_dir: str) -> dict[str, Any]:
    """The plugin's own ``rollcall`` over every rank's recorder file, as an operator runs it (copied files: no
    stall judged)."""
    cmd = [sys.executable, "-c", "import sys; from sglang_dp_mtp_fix.cli import main; sys.exit(main(sys.argv[1:]))",
           "rollcall", recorder_dir, "--settle", "0"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    try:
        data = json.loads(js.stdout)
    except ValueError:
        data = {"unparsed": js.stdout[-2000:], "stderr": js.stderr[-2000:]}
    return {"exit": text.returncode, "text": text.stdout.splitlines()[:30], "stderr": text.stderr[-1000:],
            "verdict": data.get("verdict"), "agreed_up_to": data.get("agreed_up_to"),
            "files": sorted(os.listdir(recorder_dir))}  # fmt: skip


def _cpu_snapshot(pgids: set[int]) -> tuple[float, dict[tuple[int, str, str], float]]:
    """Machine busy jiffies, and each thread's (pid, process title, thread name) CPU jiffies in the given groups."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    threads: dict[tuple[int, str, str], float] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                pid_fields = f.read().rsplit(")", 1)[1].split()
            if int(pid_fields[2]) not in pgids:
                continue
            pid = int(stat.split("/")[2])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")[:60]
        except (OSError, ValueError, IndexError):
            continue
        for task in glob.glob(f"/proc/{pid}/task/[0-9]*/stat"):
            try:  # per thread: a thread that ends between the listing and the read must not hide its process
                with open(task) as f:
                    raw = f.read()
            except OSError:
                continue
            name = raw[raw.index("(") + 1 : raw.rindex(")")]
            rest = raw.rsplit(")", 1)[1].split()
            threads[(pid, title, name)] = float(rest[11]) + float(rest[12])
    return busy, threads


def cpu_profile(s: Server, window_s: float = 5.0) -> dict[str, Any]:
    """Where the host's cores go while the server decodes: the machine's busy share of all cores, and per process
    title and thread-name class the cores used (1.0 = one core busy the whole window)."""
    pgids = {n.proc.pid for n in s.all_nodes()}
    hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    b0, t0 = _cpu_snapshot(pgids)
    time.sleep(window_s)
    b1, t1 = _cpu_snapshot(pgids)
    by: dict[str, float] = {}
    for key, jiffies in t1.items():
        used = (jiffies - t0.get(key, jiffies)) / hz / window_s
        if used > 0.005:
            cls = f"{key[1]} | {re.sub(r'[0-9]+', '#', key[2])}"
            by[cls] = round(by.get(cls, 0.0) + used, 3)
    return {"machine_busy_share": round((b1 - b0) / hz / window_s / ncpu, 3), "cores": ncpu,
            "server_cores_used": round(sum(by.values()), 2),
            "by_thread": dict(sorted(by.items(), key=lambda kv: -kv[1])[:25])}  # fmt: skip
