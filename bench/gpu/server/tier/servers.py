"""N-node DP servers on one GPU, and one-node ``--tp 1`` servers.

SGLang turns DP attention off for ``--dp 1`` and ``--gpu-id-step`` must be >= 1, so a DP server is ``--tp N --dp N
--enable-dp-attention --nnodes N``: N "nodes" on the one GPU, each with its own ``NCCL_HOSTID``, which NCCL then links
through its socket transport over loopback. Nodes 1..N-1 start first; node 0 once every one of their DP controllers
runs (all derive the same ``port_base`` from ``--dist-init-addr``; node 0 binds it, the others only check it).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from tier.conf import (
    BASE_ENV_DROP,
    CPU,
    DSA_KV,
    HERE,
    LOGS,
    MPS,
    MULTICAST_OFF,
    NODES,
    READY_S,
    TIER,
    attention_flags,
    base_flags,
    left,
    say,
)

READY = "The server is fired up and ready to roll"
# each server gets a block of ports below the kernel's ephemeral range: HTTP on +0, node r's own on +180+20r,
# --dist-init-addr on +500 (SGLang's port_base follows it), a prefill's bootstrap server on +650
PORT_BLOCK = 700
_ports = iter(range(20000, 32000, PORT_BLOCK))
_port_lock = threading.Lock()


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

    def signal_kill(self) -> None:
        """SIGKILL the node's process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self, wait_s: float = 10) -> None:
        """Wait for the leader: an unreaped leader is a zombie that keeps its group id, so signalling the group alone
        never tells when it is gone (it took 10 s a node when the kill loop signalled a zombie 40 times)."""
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            say(f"{self.name}: leader {self.proc.pid} not reaped {wait_s:.0f}s after SIGKILL")


class Server:
    """One server: NODES nodes on this GPU (DP attention over NODES ranks), or one node (``dp=False``: --tp 1)."""

    def __init__(self, name: str, flags: list[str], env: dict[str, str], dp: bool = True, kv: str = DSA_KV) -> None:
        self.name, self.dp, self.pd = name, dp, "--disaggregation-mode" in flags
        self.ranks = tuple(range(NODES)) if dp else (0,)
        with _port_lock:
            self.port = next(_ports)
        # a PD prefill (stage pd) serves its bootstrap server for the decodes that pull its KV
        self.bootstrap_port = self.port + 650 if "prefill" in flags else None
        boot = ["--disaggregation-bootstrap-port", str(self.bootstrap_port)] if self.bootstrap_port else []
        self.flags = [*base_flags(), *attention_flags(TIER, kv), *flags, *boot]
        self.logdir = os.path.join(LOGS, name)
        os.makedirs(self.logdir, exist_ok=True)
        self.nodes: dict[int, Node] = {}
        self.ready_s: float | None = None
        self.t_start = time.monotonic()
        if not dp:
            self.nodes[0] = Node("node0", [*self.flags, "--tp", "1", "--port", str(self.port)],
                                 self._env(env, 0), self.logdir)  # fmt: skip
            self._pending0: tuple[list[str], dict[str, str]] | None = None
            return
        n = str(NODES)
        common = [*self.flags, "--tp", n, "--dp", n, "--enable-dp-attention", "--nnodes", n,
                  "--dist-init-addr", f"127.0.0.1:{self.port + 500}"]  # fmt: skip
        for r in range(1, NODES):
            self.nodes[r] = Node(f"node{r}", [*common, "--node-rank", str(r), "--port", str(self.port + 180 + 20 * r)],
                                 self._env(env, r), self.logdir)  # fmt: skip
        self._pending0 = ([*common, "--node-rank", "0", "--port", str(self.port)], self._env(env, 0))

    def _env(self, extra: dict[str, str], rank: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(BASE_ENV_DROP)}
        env.update(MULTICAST_OFF, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   SGLANG_PLUGINS="dp_mtp_fix")  # fmt: skip
        if CPU:  # the launch tier's CPU set-up (tools/launchlib.py)
            env.update(
                SGLANG_USE_CPU_ENGINE="1",
                LAUNCH_CPU_ATTN_OPS="1",
                SGLANG_PLUGINS="dp_mtp_fix,launch_cpu_gaps",
                SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % 2) for r in range(NODES)),
            )  # one per TP rank
            env["PYTHONPATH"] = os.environ["DRIVE_CPU_PATH"] + ":" + env.get("PYTHONPATH", "")
        else:  # SGLang's own switches: flashinfer paths off, DeepGEMM's JIT GEMMs off (bf16 model; the DSA indexer
            # calls deep_gemm's paged MQA logits directly)
            env.update(SGLANG_IS_FLASHINFER_AVAILABLE="false", SGLANG_ENABLE_JIT_DEEPGEMM="false")
            if TIER == "dsa":  # else the GLM router binds the stand-in's fused_topk_deepseek (stubs/flashinfer)
                env["FLASHINFER_STUB_REFUSE"] = "flashinfer.fused_moe"
            if self.dp:
                env.update(NCCL_HOSTID=f"gpuserver-node{rank}", NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo",
                           NCCL_IB_DISABLE="1", NCCL_NET="Socket", NCCL_DEBUG="INFO",
                           NCCL_DEBUG_SUBSYS="INIT,ENV")  # fmt: skip
        for k, v in extra.items():
            env[k] = v + ":" + env.get(k, "") if k == "PYTHONPATH" else v
        if CPU and "seedless_trigger" in env["SGLANG_PLUGINS"]:
            env["SGLANG_PLUGINS"] = env["SGLANG_PLUGINS"].replace("dp_mtp_fix,", "dp_mtp_fix,launch_cpu_gaps,")
        return env

    def others_up(self) -> bool:
        """Every node 1..N-1 runs its DP controller (a process in that node's own process group)."""
        want = {self.nodes[r].proc.pid for r in self.nodes if r}
        up: set[int] = set()
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    pgid = int(f.read().rsplit(")", 1)[1].split()[2])
                if pgid not in want or pgid in up:
                    continue
                with open(stat[:-4] + "cmdline", "rb") as f:
                    if b"sglang::data_parallel_controller" in f.read():
                        up.add(pgid)
            except (OSError, ValueError, IndexError):
                continue
        return up == want

    def start_node0_when_due(self) -> None:
        if self._pending0 is not None and (self.others_up() or any(not n.alive() for n in self.nodes.values())):
            self.nodes[0] = Node("node0", *self._pending0, self.logdir)
            self._pending0 = None

    def all_nodes(self) -> list[Node]:
        return [self.nodes[k] for k in sorted(self.nodes)]

    def node_of(self, rank: int) -> Node:
        """DP rank r runs on node r (one rank per node)."""
        return self.nodes[rank]

    def kill(self) -> None:
        t = time.monotonic()
        for n in self.all_nodes():  # every group first, then the reaping: the nodes die together
            n.signal_kill()
        for n in self.all_nodes():
            n.reap()
        say(f"{self.name}: killed {len(self.nodes)} nodes in {time.monotonic() - t:.1f}s")

    def logs(self) -> dict[str, str]:
        return {n.name: n.log() for n in self.all_nodes()}


def start_all(servers: list[Server]) -> None:
    """Start node 0s as their other nodes come up, then wait until every server is ready, has died, or time is up."""
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
        say(f"{s.name}: NOT READY after {time.monotonic() - s.t_start:.0f}s: {not_ready_why(s)}\n{tails(s, 30)}")


CAPTURE = re.compile(r"Capture ([\w -]*?)CUDA graph (begin|end)")


def not_ready_why(s: Server) -> str:
    """Why a server gave no ready line within the bound, read from its nodes' logs: still capturing a CUDA graph (on
    a machine without the JIT cache, its kernels compile during the capture: 0.5.20's target-verify capture took
    122 s cold, 2026-12-07), or the last thing each node logged."""
    if 0 not in s.nodes:
        return "node 0 never started: its other nodes' DP controllers did not all come up"
    capturing = []
    for n in s.all_nodes():
        marks = CAPTURE.findall(n.log())
        if marks and marks[-1][1] == "begin":
            capturing.append(f"{n.name} in '{marks[-1][0].strip() or 'decode'}'")
    if capturing:
        return ("still capturing CUDA graphs (" + ", ".join(capturing) + "): a cold JIT cache compiles kernels "
                "there; carry the cache (fetch.sh CACHE=) or raise DRIVE_READY_S")  # fmt: skip
    last = {n.name: (n.log().strip().splitlines() or ["(empty log)"])[-1][:160] for n in s.all_nodes()}
    return "no capture in progress; last lines: " + json.dumps(last)


def retire(s: Server, later: list[Server]) -> None:
    """Kill a server whose arm is done, or under MPS keep it for ``later`` (killed after the last arm): under MPS,
    killing a server whose kernels were still running took the next server on the GPU down with it, "illegal memory
    access" at its first request (2026-12-07: a stuck stock server, then a patched one with requests in flight)."""
    if MPS:
        later.append(s)
    else:
        s.kill()


def tails(s: Server, n: int) -> str:
    return "\n".join(f"--- {k}:\n" + "\n".join(v.splitlines()[-n:]) for k, v in s.logs().items())


def gpu_memory() -> str | None:
    if CPU:
        return None
    q = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"]
    return subprocess.run(q, capture_output=True, text=True).stdout.strip()


TRIGGER_PATH = os.path.join(HERE, "trigger")
