#!/usr/bin/env python3
"""GPU server tier driver (on demand; never CI): real ``python -m sglang.launch_server`` servers on ONE GPU.

Called by run.sh on the device machine: ``python3 drive.py STAGE [STAGE ...]``, stages in order, within
``DRIVE_BUDGET_S``. Results: ``$OUT/summary-<release>.json`` (every figure), node logs under ``DRIVE_LOGS``.

Two DP ranks on one GPU. SGLang turns DP attention off for ``--dp 1`` and ``--gpu-id-step`` must be >= 1, so a
server is ``--tp 2 --dp 2 --enable-dp-attention`` as two "nodes" (``--nnodes 2``) on the one GPU, each with its own
``NCCL_HOSTID``: NCCL then links the two ranks through its socket transport over loopback. Node 1 starts first and
node 0 once node 1's DP controller runs (both derive the same ``port_base``; node 0 binds it, node 1 only checks it).

Stages:
  hang  The seed's hang, stock vs patched, same flags and trigger (trigger/seedless_trigger) on both arms.
        HANG_SETS (default "first steady"): "first" = the split is the group's first eager collective (torch's NCCL
        communicator does not exist yet); "steady" = SEEDLESS_TRIGGER_INIT_COMMS=1 creates it at start-up, so the
        split leaves the two ranks in two existing communicators. All servers start side by side; then per set the
        patched arm is triggered, then the stock arm (HANG_ARMS: which arms, in which order), which gets
        HANG_WAIT_S (60) and, while still pending, the evidence (records, faulthandler, py-spy, log tails, watchdog
        lines), then SIGKILL before the next arm.
  ab    Decode cost, plugin applied (A) vs SGLANG_DP_MTP_FIX=off (B), no trigger, plus T: the same flags with
        ``--tp 1`` (no DP, no NCCL): the share of the two-node transport. Up side by side, measured one at a time in
        rounds A B T B A T A B T ... (AB_ROUNDS rounds of A and of B).
DRIVE_CPU=1 runs the driver against CPU launches (the launch tier's stand-ins) to check it here before device time.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CARRY = os.environ.get("G", os.path.join(HERE, "..", "..", "..", ".gpuserver"))
OUT = os.environ.get("OUT") or "/tmp/out"
LOGS = os.environ.get("DRIVE_LOGS", "/tmp/gslogs")
RELEASE = os.environ.get("SGLANG_RELEASE", "unknown")
CPU = os.environ.get("DRIVE_CPU") == "1"
T0 = time.monotonic()
BUDGET = float(os.environ.get("DRIVE_BUDGET_S", "480"))
READY_S = float(os.environ.get("DRIVE_READY_S", "300"))
READY = "The server is fired up and ready to roll"
MODEL = os.environ.get("DRIVE_MODEL", os.path.join(CARRY, "model"))
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SUMMARY: dict[str, Any] = {"release": RELEASE, "t_start": time.time()}

# The model tier (the carry decides it: fetch.sh TIER): "qwen" (Qwen3-MoE, triton attention, the trigger emulates the
# seeding draft worker) or "dsa" (GlmMoeDsaForCausalLM, DSA attention, MTP IndexShare from the model's own config:
# SGLang makes every PD arrival seedless itself, and the trigger plugin only observes). DSA_KV picks the DSA KV cache
# and backends: bf16 with flashmla_sparse (Hopper's bf16 default, fa3, is not carried: 342 MB) or fp8 with flashmla_kv
# (SGLang's Hopper FP8 default).
TIER = os.environ.get("DRIVE_TIER") or ("dsa" if os.path.isdir(os.path.join(CARRY, "dg")) else "qwen")
DSA_KV = os.environ.get("DSA_KV", "bf16")


def attention_flags(tier: str, kv: str = DSA_KV) -> list[str]:
    if CPU:
        return ["--attention-backend", "torch_native"]
    if tier != "dsa":
        return ["--attention-backend", "triton"]
    backend = "flashmla_kv" if kv == "fp8" else "flashmla_sparse"
    return ["--attention-backend", "dsa", "--kv-cache-dtype", "fp8_e4m3" if kv == "fp8" else "bfloat16",
            "--dsa-prefill-backend", backend, "--dsa-decode-backend", backend, "--page-size", "64"]  # fmt: skip


def release_has_flag(flag: str) -> bool:
    """0.5.15.post1 has no --mm-feature-transport; later releases need it set to cpu here."""
    spec = importlib.util.find_spec("sglang.srt.server_args")
    return spec is not None and spec.origin is not None and flag in open(spec.origin).read()


if CPU:
    BASE = ["--model-path", MODEL, "--load-format", "dummy", "--host", "127.0.0.1", "--device", "cpu",
            "--disable-cuda-graph", "--max-total-tokens", "2048", "--random-seed", "1"]  # fmt: skip
else:
    BASE = [
        "--model-path", MODEL, "--load-format", "dummy", "--host", "127.0.0.1",
        "--sampling-backend", "pytorch", "--moe-runner-backend", "triton",
        "--disable-custom-all-reduce", "--enforce-disable-flashinfer-allreduce-fusion",
        "--mem-fraction-static", "0.25", "--max-total-tokens", "16384", "--max-running-requests", "16",
        "--cuda-graph-max-bs-decode", "16", "--disable-prefill-cuda-graph", "--decode-log-interval", "10",
        "--random-seed", "1",
    ] + (["--mm-feature-transport", "cpu"] if release_has_flag("--mm-feature-transport") else [])  # fmt: skip
MTP = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
       "--speculative-num-draft-tokens", "3"]  # fmt: skip
PD = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake"]
# the hang servers: no PD warm-up (it sends one seedless arrival per DP rank, so the trigger's first request would
# not be the first arrival) and SGLang's soft watchdog, which logs a stuck scheduler (py-spy dump when on PATH)
HANG_FLAGS = ["--skip-server-warmup"] + ([] if CPU else ["--soft-watchdog-timeout", "30"])
HANG_WAIT_S = float(os.environ.get("HANG_WAIT_S", "60"))
_ports = iter(range(20000, 32000, 700))  # below the kernel's ephemeral range
_port_lock = threading.Lock()


def say(*parts: object) -> None:
    print(f"[+{time.monotonic() - T0:5.0f}s]", *parts, flush=True)


def left() -> float:
    return BUDGET - (time.monotonic() - T0)


def refuse_without_multicast_off() -> None:
    """NVLink multicast can take a shared host's GPUs out of service: never start without it switched off."""
    wrong = {k: os.environ.get(k) for k, v in MULTICAST_OFF.items() if os.environ.get(k) != v}
    if wrong and not CPU:
        sys.exit(f"refusing to start: multicast variables not set as required {MULTICAST_OFF}: {wrong}")


class Node:
    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: str) -> None:
        self.name, self.args = name, args
        self.log_path = os.path.join(logdir, f"{name}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *args], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=logdir, start_new_session=True)  # fmt: skip
        with open(os.path.join(LOGS, "pgids"), "a") as f:  # run.sh kills any group left at the end
            f.write(f"{self.proc.pid}\n")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        for _ in range(40):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.25)
        self.proc.poll()


class Server:
    """One server: two nodes on this GPU (dp2: DP attention over 2 ranks) or one node (--tp 1)."""

    def __init__(self, name: str, flags: list[str], env: dict[str, str], dp2: bool = True, kv: str = DSA_KV) -> None:
        self.name, self.dp2, self.pd = name, dp2, "--disaggregation-mode" in flags
        self.flags = [*BASE, *attention_flags(TIER, kv), *flags]
        self.logdir = os.path.join(LOGS, name)
        os.makedirs(self.logdir, exist_ok=True)
        with _port_lock:
            self.port = next(_ports)
        self.nodes: dict[int, Node] = {}
        self.ready_s: float | None = None
        self.t_start = time.monotonic()
        if not dp2:
            self.nodes[0] = Node("node0", [*self.flags, "--tp", "1", "--port", str(self.port)],
                                 self._env(env, 0), self.logdir)  # fmt: skip
            self._pending0: tuple[list[str], dict[str, str]] | None = None
            return
        common = [*self.flags, "--tp", "2", "--dp", "2", "--enable-dp-attention", "--nnodes", "2",
                  "--dist-init-addr", f"127.0.0.1:{self.port + 500}"]  # fmt: skip
        self.nodes[1] = Node("node1", [*common, "--node-rank", "1", "--port", str(self.port + 200)],
                             self._env(env, 1), self.logdir)  # fmt: skip
        self._pending0 = ([*common, "--node-rank", "0", "--port", str(self.port)], self._env(env, 0))

    def _env(self, extra: dict[str, str], rank: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS"))}
        env.update(MULTICAST_OFF, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   SGLANG_PLUGINS="dp_mtp_fix")  # fmt: skip
        if CPU:  # the launch tier's CPU set-up (tools/launchlib.py)
            env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="0|1", LAUNCH_CPU_ATTN_OPS="1",
                       SGLANG_PLUGINS="dp_mtp_fix,launch_cpu_gaps")  # fmt: skip
            env["PYTHONPATH"] = os.environ["DRIVE_CPU_PATH"] + ":" + env.get("PYTHONPATH", "")
        else:  # SGLang's own switches: flashinfer paths off, DeepGEMM's JIT GEMMs off (bf16 model; the DSA indexer
            # calls deep_gemm's paged MQA logits directly)
            env.update(SGLANG_IS_FLASHINFER_AVAILABLE="false", SGLANG_ENABLE_JIT_DEEPGEMM="false")
            if TIER == "dsa":  # else the GLM router binds the stand-in's fused_topk_deepseek (stubs/flashinfer)
                env["FLASHINFER_STUB_REFUSE"] = "flashinfer.fused_moe"
            if self.dp2:
                env.update(NCCL_HOSTID=f"gpuserver-node{rank}", NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo",
                           NCCL_IB_DISABLE="1", NCCL_NET="Socket", NCCL_DEBUG="INFO",
                           NCCL_DEBUG_SUBSYS="INIT,ENV")  # fmt: skip
        for k, v in extra.items():
            env[k] = v + ":" + env.get(k, "") if k == "PYTHONPATH" else v
        if CPU and "seedless_trigger" in env["SGLANG_PLUGINS"]:
            env["SGLANG_PLUGINS"] = env["SGLANG_PLUGINS"].replace("dp_mtp_fix,", "dp_mtp_fix,launch_cpu_gaps,")
        return env

    def node1_up(self) -> bool:
        pgid = self.nodes[1].proc.pid
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) != pgid:
                    continue
                with open(stat[:-4] + "cmdline", "rb") as f:
                    if b"sglang::data_parallel_controller" in f.read():
                        return True
            except (OSError, ValueError, IndexError):
                continue
        return False

    def start_node0_when_due(self) -> None:
        if self._pending0 is not None and (self.node1_up() or not self.nodes[1].alive()):
            self.nodes[0] = Node("node0", *self._pending0, self.logdir)
            self._pending0 = None

    def all_nodes(self) -> list[Node]:
        return [self.nodes[k] for k in sorted(self.nodes)]

    def kill(self) -> None:
        for n in self.all_nodes():
            n.kill()

    def logs(self) -> dict[str, str]:
        return {n.name: n.log() for n in self.all_nodes()}


def start_all(servers: list[Server]) -> None:
    """Start node 0s as their node 1s come up, then wait until every server is ready, has died, or time is up."""
    deadline = time.monotonic() + min(READY_S, max(left() - 60, 10))
    pending = list(servers)
    while pending and time.monotonic() < deadline:
        for s in list(pending):
            s.start_node0_when_due()
            if 0 not in s.nodes:
                continue
            if READY in s.nodes[0].log():
                s.ready_s = round(time.monotonic() - s.t_start, 1)
                say(f"{s.name}: ready in {s.ready_s}s (port {s.port})")
                pending.remove(s)
            elif any(not n.alive() for n in s.all_nodes()):
                say(f"{s.name}: EXITED before ready\n{tails(s, 30)}")
                pending.remove(s)
        time.sleep(0.5)
    for s in pending:
        say(f"{s.name}: NOT READY after {time.monotonic() - s.t_start:.0f}s\n{tails(s, 30)}")


def tails(s: Server, n: int) -> str:
    return "\n".join(f"--- {k}:\n" + "\n".join(v.splitlines()[-n:]) for k, v in s.logs().items())


# --- requests ---------------------------------------------------------------------------------------------------------
_room = [1000]


def generate(
    s: Server,
    rid: str,
    rank: int,
    n: int,
    timeout: float = 120,
    input_ids: list[int] | None = None,
    logprobs: bool = False,
) -> dict[str, Any]:
    with _port_lock:
        _room[0] += 1 + (_room[0] + 1 - rank) % 2  # bootstrap_room % 2 == routed rank (fake transfer)
        room = _room[0]
    body: dict[str, Any] = {"rid": rid, "input_ids": input_ids or [1, 5 + room % 50, 6, 7],
                            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    if logprobs:
        body["return_logprob"] = True
    if s.dp2:
        body["routed_dp_rank"] = rank
    if s.pd:  # SGLang's fake-transfer marker; nothing is contacted
        body.update(bootstrap_host="2.2.2.2", bootstrap_room=room)
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    out["_s"] = time.monotonic() - t
    return out


def served(out: dict[str, Any], want: int, rank: int | None) -> str | None:
    got = len(out.get("output_ids") or [])
    dp = out.get("meta_info", {}).get("dp_rank")
    if got != want:
        return f"{got} tokens, asked {want}"
    if rank is not None and dp not in (None, rank):
        return f"served by DP rank {dp}, routed to {rank}"
    return None


# --- log evidence -----------------------------------------------------------------------------------------------------
REPORT = re.compile(r"sglang-dp-mtp-fix \S+ on SGLang [^\n]*")
DECODE = re.compile(r"Decode batch[^\n]*?cuda graph: (True|False)")
EVIDENCE = {
    "plugin": r"sglang-dp-mtp-fix (?!stats)",
    "captures": r"Capture [\w -]*CUDA graph end",
    "errors": r"Traceback|Error|StubCalled|NCCL WARN|Watchdog caught|watchdog timeout",
    "nccl_comms": r"Init COMPLETE",
}


def log_evidence(s: Server) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    for name, log in s.logs().items():
        lines = log.splitlines()
        dec = DECODE.findall(log)
        ev[name] = {k: [ln[:400] for ln in lines if re.search(p, ln)][:12] for k, p in EVIDENCE.items()}
        ev[name]["decode_cuda_graph"] = {"True": dec.count("True"), "False": dec.count("False")}
        stats = [ln[:300] for ln in lines if "stats (last" in ln and "forced-eager=0" not in ln]
        ev[name]["stats_forced_eager"] = stats[:6]
    return ev


# --- the hang ---------------------------------------------------------------------------------------------------------
def trigger_env(name: str, stock: bool, init_comms: bool) -> tuple[dict[str, str], str]:
    records = os.path.join(LOGS, f"{name}-records")
    os.makedirs(records, exist_ok=True)
    env = {"SGLANG_PLUGINS": "dp_mtp_fix,seedless_trigger", "SEEDLESS_TRIGGER_DIR": records,
           "SGLANG_DP_MTP_FIX_STATS": "5", "PYTHONPATH": os.path.join(HERE, "trigger")}  # fmt: skip
    if CPU:
        env["SEEDLESS_TRIGGER_CPU_VOTE"] = "1"
    if TIER == "dsa":  # the model's own config seeds: no trigger in SGLang's path, the plugin only records
        env.update(SEEDLESS_TRIGGER_OBSERVE_ONLY="1", SEEDLESS_TRIGGER_DSA="1")
    if init_comms:
        env["SEEDLESS_TRIGGER_INIT_COMMS"] = "1"
    if stock:
        env["SGLANG_DP_MTP_FIX"] = "off"
    return env, records


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


def analyze(records: str) -> dict[str, Any]:
    recs = read_records(records)
    drafts = [r for r in recs if r["kind"] == "draft"]
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for r in drafts:
        steps.setdefault(r["step"], {})[r["rank"]] = r
    keys = ("mode", "bs", "rids", "seed", "can_run", "stock_guard_eager", "path")
    brief = {s: {rk: {k: r.get(k) for k in keys} for rk, r in p.items()} for s, p in steps.items()}
    seedless = [s for s, p in sorted(steps.items()) if any(x["mode"] != "IDLE" and x["seed"] is None
                                                           for x in p.values())]  # fmt: skip
    split = [s for s, p in sorted(steps.items()) if len({x["path"] for x in p.values()}) > 1]
    paths = {rk: {p: sum(1 for r in drafts if r["rank"] == rk and r["path"] == p) for p in ("graph", "eager")}
             for rk in (0, 1)}  # fmt: skip
    eager_steps = sorted({r["step"] for r in drafts if r["path"] == "eager"})
    return {
        "meta": [r for r in recs if r["kind"] in ("meta", "init-comms")],
        "observer_errors": [r for r in recs if r["kind"] == "observer-error"][:3],
        "draft_steps": {rk: sum(1 for r in drafts if r["rank"] == rk) for rk in (0, 1)}, "paths": paths,
        "seedless_steps": seedless, "eager_steps": eager_steps, "split_steps": split,
        "seedless_step_records": {s: brief[s] for s in seedless[:6]},
        "split_step_records": {s: brief[s] for s in split[:4]},
        "last_step": max(steps, default=None), "t_last_step": max((r["t"] for r in drafts), default=None),
    }  # fmt: skip


def hang_requests(s: Server, records: str, wait_s: float) -> dict[str, Any]:
    """The same requests on every arm, each phase once the previous one's condition holds, all within wait_s:
    1 "run-1" (150 tokens) on DP rank 1, rank 0 idle: a seedless arrival beside an idle peer (the first draft step
      of the server); done once run-1 decoded 3 draft steps with a seed
    2 "one-0" (12) on rank 0 while rank 1 decodes run-1: a seedless arrival beside a busy peer
    3 after run-1 ended: "tri-0-0..2" (16 each) at once on rank 0, rank 1 idle (3 seedless rows on one rank)."""
    pool = ThreadPoolExecutor(5)
    futs: dict[str, tuple[Future[dict[str, Any]], int, int]] = {}
    t0 = time.monotonic()

    def send(rid: str, rank: int, n: int) -> None:
        futs[rid] = (pool.submit(generate, s, rid, rank, n, wait_s + 30), rank, n)

    def run1_seeded() -> bool:
        mine = [r for r in read_records(records) if r["kind"] == "draft" and "run-1" in r.get("rids", [])]
        return sum(1 for r in mine if r["seed"] is not None) >= 3

    tri = [f"tri-0-{k}" for k in range(3)]
    phases: list[tuple[str, list[tuple[str, int, int]], Callable[[], bool]]] = [
        ("1", [("run-1", 1, 150)], run1_seeded),
        ("2", [("one-0", 0, 12)], lambda: futs["one-0"][0].done()),
        ("2-end", [], lambda: futs["run-1"][0].done()),
        ("3", [(rid, 0, 16) for rid in tri], lambda: all(futs[r][0].done() for r in tri)),
    ]
    res: dict[str, Any] = {"phases": {}}
    for name, reqs, cond in phases:
        for rid, rank, n in reqs:
            send(rid, rank, n)
        done = False
        while time.monotonic() - t0 < wait_s and not (done := cond()):
            if any(not n.alive() for n in s.all_nodes()):
                break
            time.sleep(0.1)
        res["phases"][name] = round(time.monotonic() - t0, 2) if done else "stuck"
        if not done:
            break
    res["waited_s"] = round(time.monotonic() - t0, 1)
    outcome: dict[str, Any] = {}
    for rid, (f, rank, n) in futs.items():
        if not f.done():
            outcome[rid] = "pending"
        elif f.exception() is not None:
            outcome[rid] = f"error: {f.exception()!r}"[:300]
        else:
            o = f.result()
            outcome[rid] = {"tokens": len(o.get("output_ids") or []), "asked": n, "problem": served(o, n, rank),
                            "dp_rank": o.get("meta_info", {}).get("dp_rank")}  # fmt: skip
    res["requests"] = outcome
    res["served_all"] = len(outcome) == 5 and all(isinstance(v, dict) and not v["problem"] for v in outcome.values())
    pool.shutdown(wait=False, cancel_futures=True)
    return res


def stuck_evidence(s: Server, records: str) -> dict[str, Any]:
    """Where each rank is while requests are pending (the processes still run)."""
    pids = {r["rank"]: r["pid"] for r in read_records(records) if r["kind"] == "meta"}
    ev: dict[str, Any] = {"alive": {n.name: n.alive() for n in s.all_nodes()}, "scheduler_pids": pids}
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)  # the trigger's faulthandler: every thread's Python stack
        except ProcessLookupError:
            pass
    time.sleep(2)
    ev["faulthandler_main"], ev["pyspy"] = {}, {}
    for rank, pid in pids.items():
        path = os.path.join(records, f"stack-{pid}.txt")
        text = open(path).read() if os.path.exists(path) else ""
        blocks = [b for b in text.split("\n\n") if "run_scheduler_process" in b] or [text]
        ev["faulthandler_main"][rank] = blocks[-1].splitlines()[:40]
        try:
            r = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
            ev["pyspy"][rank] = (r.stdout or r.stderr).splitlines()[:60]
        except Exception as exc:  # noqa: BLE001 - evidence is best effort
            ev["pyspy"][rank] = [repr(exc)]
    if not CPU:
        ev["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"],
                                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    ev["log_tails"] = {k: [ln[:300] for ln in v.splitlines()[-25:]] for k, v in s.logs().items()}
    ev["watchdog"] = {k: [ln[:300] for ln in v.splitlines() if re.search(r"watchdog|Watchdog", ln)][:10]
                      for k, v in s.logs().items()}  # fmt: skip
    return ev


def stage_hang() -> None:
    sets = os.environ.get("HANG_SETS", "first steady").split()
    # HANG_ARMS="stock patched" drives stock first; one arm alone where the other is already on record
    order = os.environ.get("HANG_ARMS", "patched stock").split()
    if not order or set(order) - {"patched", "stock"}:
        sys.exit(f"HANG_ARMS must name patched and/or stock, got {order!r}")
    arms = [(st, arm) for st in sets for arm in order]
    envs = {(st, arm): trigger_env(f"{st}-{arm}", arm == "stock", st == "steady") for st, arm in arms}
    servers = {a: Server(f"{a[0]}-{a[1]}", MTP + PD + HANG_FLAGS, envs[a][0]) for a in arms}
    say("hang servers:", *(a.name for a in servers.values()), "\nflags:", *next(iter(servers.values())).flags)
    start_all(list(servers.values()))
    result: dict[str, Any] = {}
    for st, arm in arms:
        s, records = servers[(st, arm)], envs[(st, arm)][1]
        rec: dict[str, Any] = {"ready_s": s.ready_s, "port": s.port}
        result[f"{st}-{arm}"] = rec
        if s.ready_s is None:
            rec["not_ready"] = True
        elif left() < HANG_WAIT_S + 30:
            rec["not_run"] = f"{left():.0f}s of budget left"
        else:
            say(f"{s.name}: trigger (bound {HANG_WAIT_S:.0f}s)")
            rec.update(hang_requests(s, records, HANG_WAIT_S))
            if not rec["served_all"]:
                rec["stuck"] = stuck_evidence(s, records)
        rec["records"] = analyze(records)
        t_last = rec["records"]["t_last_step"]
        rec["s_since_last_draft_step"] = round(time.time() - t_last, 1) if t_last else None
        rec["logs"] = log_evidence(s)
        s.kill()  # a hung arm's kernels would share the GPU with the next arm
        SUMMARY["hang"] = result
        write_summary()
        say(f"{s.name}: " + json.dumps({k: rec.get(k) for k in ("served_all", "phases", "requests", "waited_s",
                                                                 "s_since_last_draft_step")}))  # fmt: skip
        a = rec["records"]
        say(f"{s.name}: steps {a['draft_steps']} paths {a['paths']} seedless {a['seedless_steps'][:8]} "
            f"eager {a['eager_steps'][:8]} split {a['split_steps'][:8]}")  # fmt: skip
        for step, p in list(a["seedless_step_records"].items())[:4]:
            say(f"  seedless step {step}: {json.dumps(p)}")
        for node, ev in rec["logs"].items():
            say(
                f"  {node}: plugin {ev['plugin'][:2]}\n    captures {len(ev['captures'])} "
                f"decode {ev['decode_cuda_graph']} nccl comms {len(ev['nccl_comms'])} errors {ev['errors'][:4]}"
            )
        if "stuck" in rec:
            for rank, stack in rec["stuck"]["faulthandler_main"].items():
                say(f"  rank {rank} main thread:\n    " + "\n    ".join(stack[:16]))
            say(f"  watchdog {json.dumps(rec['stuck']['watchdog'])[:1500]}")
    SUMMARY["hang"] = result


# --- the DSA trims at work (DSA tier) ---------------------------------------------------------------------------------
TRIM_PROMPT = [1, 9, 17, 33, 41, 57, 6, 7]


def dsa_evidence(records: str, since: float) -> dict[str, Any]:
    """The observer's DSA records after ``since``: padded eager decode calls (dsa_decode_trim's case) and eager
    indexer calls on idle ranks (dsa_idle_index's case), per rank."""
    recs = [r for r in read_records(records) if r.get("t", 0) >= since]
    padded = [r for r in recs if r["kind"] == "dsa-decode-padded"]
    idle = [r for r in recs if r["kind"] == "dsa-idle-index"]
    return {
        "padded_decode_calls": {rk: sum(1 for r in padded if r["rank"] == rk) for rk in (0, 1)},
        "padded_rows_zero": all(r["pad_zero"] and r["out_rows"] == r["physical"] for r in padded),
        "padded_shapes": sorted({f"{r['planned']}->{r['physical']}" for r in padded}),
        "padded_impl": sorted({r["impl"] for r in padded}),
        "forward_decode": sorted({r["forward_decode"] for r in padded}),
        "idle_index_calls": {rk: sum(1 for r in idle if r["rank"] == rk) for rk in (0, 1)},
        "idle_all_invalid": all(r["all_invalid"] is not False for r in idle),
        "idle_rows": sorted({r["rows"] for r in idle}), "idle_steps": sorted({r["step"] for r in idle})[:12],
        "observer_errors": [r for r in recs if r["kind"] == "observer-error"][:3],
    }  # fmt: skip


def trim_case(s: Server, records: str, n: int) -> dict[str, Any]:
    """One request S (TRIM_PROMPT, greedy, DP rank 1) served alone, then beside three arrivals on rank 0 and two more
    while S decodes, then alone again. Every PD arrival is seedless for its first draft step, so each arrival makes
    the group run an eager draft round; beside rank 0's rows, S's rank is DP-padded (MAX_LEN) in those rounds and its
    DSA decode is trimmed. Greedy tokens and their logprobs must not depend on it."""
    res: dict[str, Any] = {}

    def greedy(out: dict[str, Any]) -> list[Any]:
        """The tokens with their logprobs: a degenerate greedy cycle of a dummy-weight model still shows a change in
        the numbers."""
        logprobs = out.get("meta_info", {}).get("output_token_logprobs") or []
        return [list(out.get("output_ids") or []), [lp[0] for lp in logprobs]]

    def solo(tag: str) -> list[Any]:
        t = time.time()
        out = generate(s, f"trim-{tag}", 1, n, 120, TRIM_PROMPT, logprobs=True)
        res[f"{tag}_dsa"] = dsa_evidence(records, t)
        res[f"{tag}_problem"] = served(out, n, 1)
        return greedy(out)

    alone = solo("alone")
    t = time.time()
    with ThreadPoolExecutor(6) as pool:
        mine = pool.submit(generate, s, "trim-beside", 1, n, 120, TRIM_PROMPT, True)
        peers = [pool.submit(generate, s, f"trim-peer-{k}", 0, n) for k in range(3)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not mine.done():  # S decoding with a seed: then two late arrivals
            steps = [r for r in read_records(records) if r["kind"] == "draft" and "trim-beside" in r.get("rids", [])]
            if sum(1 for r in steps if r["seed"] is not None) >= 3:
                break
            time.sleep(0.05)
        peers += [pool.submit(generate, s, f"trim-late-{k}", 0, 8) for k in range(2)]
        beside = greedy(mine.result())
        peer_problems = [served(f.result(), w, 0) for f, w in zip(peers, [n, n, n, 8, 8], strict=True)]
    res["beside_dsa"] = dsa_evidence(records, t)
    res["peer_problems"] = [p for p in peer_problems if p]
    again = solo("again")
    res.update(tokens=n, alone=alone, beside=beside, again=again, identical=alone == beside == again)
    return res


def stage_trim() -> None:
    """DSA tier: the plugin's DSA patches doing their work in a real server, bf16 KV (flashmla_sparse) and FP8 KV
    (flashmla_kv), patched arm only (stock would hang at the first split, stage hang)."""
    kvs = os.environ.get("TRIM_KV", "bf16 fp8").split()
    n = int(os.environ.get("TRIM_TOKENS", "24"))
    arms = {kv: trigger_env(f"trim-{kv}", stock=False, init_comms=False) for kv in kvs}
    servers = {kv: Server(f"trim-{kv}", MTP + PD + HANG_FLAGS, arms[kv][0], kv=kv) for kv in kvs}
    start_all(list(servers.values()))
    result: dict[str, Any] = {}
    for kv, s in servers.items():
        records = arms[kv][1]
        rec: dict[str, Any] = {"ready_s": s.ready_s, "flags": attention_flags(TIER, kv)}
        result[kv] = rec
        try:
            if s.ready_s is not None and left() > 60:
                rec.update(trim_case(s, records, n))
        except Exception as exc:  # noqa: BLE001 - keep the evidence
            rec["error"] = repr(exc)[:500]
            rec["stuck"] = stuck_evidence(s, records)
        rec["records"] = analyze(records)
        rec["logs"] = log_evidence(s)
        s.kill()
        SUMMARY["trim"] = result
        write_summary()
        brief = {k: rec.get(k) for k in ("ready_s", "identical", "peer_problems", "error")}
        say(f"trim {kv}: {json.dumps(brief)}")
        for tag in ("alone", "beside", "again"):
            if f"{tag}_dsa" in rec:
                say(f"  {tag}: {json.dumps(rec[f'{tag}_dsa'])}")
        say(f"  tokens alone {rec.get('alone')}\n  tokens beside {rec.get('beside')}")
        a = rec["records"]
        say(f"  draft steps {a['draft_steps']} paths {a['paths']} seedless {a['seedless_steps'][:10]}")
        say(f"  split {a['split_steps'][:8]}")
    SUMMARY["trim"] = result


# --- A/B --------------------------------------------------------------------------------------------------------------
def workload(s: Server, tokens: int, per_rank: int, waves: int, solo: int) -> dict[str, Any]:
    """Waves of concurrent requests spread over the DP ranks, then single requests (the other rank idle)."""
    ranks = (0, 1) if s.dp2 else (0,)
    conc, walls, bad = [], [], []
    for w in range(waves):
        reqs = [(f"w{w}-{rk}-{j}", rk) for rk in ranks for j in range(per_rank * (2 // len(ranks)))]
        t = time.monotonic()
        with ThreadPoolExecutor(len(reqs)) as pool:
            outs = list(pool.map(lambda q: generate(s, q[0], q[1], tokens), reqs))
        walls.append(time.monotonic() - t)
        conc += [o["_s"] for o in outs]
        bad += [p for o, q in zip(outs, reqs, strict=True) if (p := served(o, tokens, q[1] if s.dp2 else None))]
    singles = []
    for k in range(solo):
        o = generate(s, f"solo-{k}", ranks[k % len(ranks)], tokens)
        singles.append(o["_s"])
        bad += [p for p in [served(o, tokens, ranks[k % len(ranks)] if s.dp2 else None)] if p]
    return {"conc_ms_tok": 1000 * statistics.median(conc) / tokens, "wave_s": statistics.median(walls),
            "solo_ms_tok": 1000 * statistics.median(singles) / tokens, "conc": conc, "solo": singles,
            "bad": bad[:4]}  # fmt: skip


def ab_model_flags() -> list[str]:
    """DSA tier: the A/B model has MTP IndexShare off (``AB_INDEX_SHARE=1`` keeps it). With it on, stock hangs at the
    first seedless PD arrival beside a replaying peer (stage hang; seen in the A/B warm-up of 2026-12-03), so the B arm
    could not be timed; with it off SGLang never seeds, stock has no seedless eager fallback to take, and the plugin's
    vote and wrappers still run every round. A later --model-path wins over BASE's."""
    if TIER != "dsa" or os.environ.get("AB_INDEX_SHARE", "0") == "1":
        return []
    path = os.path.join(LOGS, "model-ab")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(MODEL):
        with open(os.path.join(MODEL, name)) as src, open(os.path.join(path, name), "w") as dst:
            dst.write(src.read())
    with open(os.path.join(MODEL, "config.json")) as f:
        config = json.load(f)
    config["index_share_for_mtp_iteration"] = False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    SUMMARY["ab_model"] = {"path": path, "index_share_for_mtp_iteration": False}
    return ["--model-path", path]


def stage_ab() -> None:
    tokens, per_rank = int(os.environ.get("AB_TOKENS", "32")), int(os.environ.get("AB_PER_RANK", "4"))
    waves, solo = int(os.environ.get("AB_WAVES", "3")), int(os.environ.get("AB_SOLO", "4"))
    rounds = int(os.environ.get("AB_ROUNDS", "6"))
    flags = MTP + PD + ab_model_flags()
    servers = {"A": Server("ab-A", flags, {}), "B": Server("ab-B", flags, {"SGLANG_DP_MTP_FIX": "off"})}
    if os.environ.get("AB_TP1", "1") == "1":
        servers["T"] = Server("ab-T", flags, {}, dp2=False)
    say("ab servers: " + " ".join(s.name for s in servers.values()))
    start_all(list(servers.values()))
    up = [k for k, s in servers.items() if s.ready_s is not None]
    res: dict[str, Any] = {"ready_s": {k: s.ready_s for k, s in servers.items()}, "workload": {
        "tokens": tokens, "per_rank": per_rank, "waves": waves, "solo": solo}, "rounds": []}  # fmt: skip
    if {"A", "B"} <= set(up):
        for k in up:  # warm-up: every server answers once (first requests pay one-time costs)
            workload(servers[k], 8, 1, 1, 1)
        pattern = ["A", "B", "T", "B", "A", "T"] if "T" in up else ["A", "B", "B", "A"]
        per = 0.0
        for arm in pattern * rounds:  # each arm `rounds` times, interleaved
            if sum(1 for r in res["rounds"] if r["arm"] == arm) >= rounds:
                continue
            if left() < per + 40:
                say(f"ab: {left():.0f}s left, stop after {len(res['rounds'])} rounds")
                break
            t = time.monotonic()
            r = workload(servers[arm], tokens, per_rank, waves, solo)
            per = max(per, time.monotonic() - t)
            res["rounds"].append({"arm": arm, **r})
            say(f"ab round {len(res['rounds'])} {arm}: conc {r['conc_ms_tok']:.3f} solo {r['solo_ms_tok']:.3f} "
                f"ms/token, wave {r['wave_s']:.3f}s {r['bad'] or ''}")  # fmt: skip
        agg: dict[str, Any] = {}
        for arm in up:
            rs = [r for r in res["rounds"] if r["arm"] == arm]
            if not rs:
                continue
            agg[arm] = {"rounds": len(rs), "bad": sum(len(r["bad"]) for r in rs)}
            for kind in ("conc", "solo"):
                per_round = [r[f"{kind}_ms_tok"] for r in rs]
                pooled = 1000 * statistics.median([x for r in rs for x in r[kind]]) / tokens
                agg[arm][kind] = {"pooled_ms_tok": round(pooled, 3), "round_medians": [round(x, 3) for x in per_round],
                                  "spread_pct": round(100 * (max(per_round) - min(per_round)) / pooled, 3)}  # fmt: skip
        if "A" in agg and "B" in agg:
            agg["A_over_B"] = {k: round(agg["A"][k]["pooled_ms_tok"] / agg["B"][k]["pooled_ms_tok"], 4)
                               for k in ("conc", "solo")}  # fmt: skip
            a_rounds = [r["conc_ms_tok"] for r in res["rounds"] if r["arm"] == "A"]
            b_rounds = [r["conc_ms_tok"] for r in res["rounds"] if r["arm"] == "B"]
            agg["A_over_B_per_round_conc"] = [round(a / b, 4) for a, b in zip(a_rounds, b_rounds, strict=False)]
        if "T" in agg and "B" in agg:
            agg["B_over_T"] = {k: round(agg["B"][k]["pooled_ms_tok"] / agg["T"][k]["pooled_ms_tok"], 3)
                               for k in ("conc", "solo")}  # fmt: skip
        res["summary"] = agg
        say("ab summary: " + json.dumps(agg))
    res["logs"] = {k: log_evidence(s) for k, s in servers.items()}
    for s in servers.values():
        s.kill()
    SUMMARY["ab"] = res


def main() -> None:
    refuse_without_multicast_off()
    os.makedirs(LOGS, exist_ok=True)
    for stage in sys.argv[1:] or ["hang"]:
        if left() < 90:
            say(f"budget: {left():.0f}s left, not running {stage}")
            SUMMARY.setdefault("not_run", []).append(stage)
            continue
        try:
            {"hang": stage_hang, "ab": stage_ab, "trim": stage_trim}[stage]()
        except Exception:  # noqa: BLE001 - keep what the other stages and arms found
            SUMMARY.setdefault("driver_errors", []).append(traceback.format_exc())
            say(f"{stage}: driver error\n{traceback.format_exc()}")
        write_summary()
    SUMMARY["elapsed_s"] = round(time.monotonic() - T0, 1)
    write_summary()
    say("done")


def write_summary() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"summary-{RELEASE}.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
