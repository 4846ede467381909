"""Launch helpers: real ``python -m sglang.launch_server`` processes on CPU, in the seed's shape (DP attention, PD
decode with the fake transfer backend, NEXTN MTP speculative decoding), dummy weights, a local tokenizer, HTTP on
127.0.0.1 only. In tools/ because the launch tier (``tests/launch``), ``tools/launch_demo.py`` and ``bench/`` all
start these servers; the tests read it from here (pyproject's pytest ``pythonpath``), never the other way round.

Every server runs in its own process group (``process_group=0``); waits are bounded; a finalizer stops the group
(SIGTERM, then SIGKILL) so no server outlives its fixture. Launches are module-scoped and shared between scenarios.

Stand-ins (only where nothing real can run here; each file says why): ``stubs/sgl_kernel`` (SGLang's CPU kernels need
an AVX-512/AMX source build) and ``cpu_gaps/launch_cpu_gaps`` (the CPU-only gaps of the torch_native path), both
under ``tests/launch``, the latter registered as an SGLang plugin through a dist-info written into a temp dir on
PYTHONPATH, never into the venv. The plugin under test is the installed ``sglang-dp-mtp-fix``, loaded by SGLang's own
``load_plugins()``. Which releases the tier runs on: ``tests/releases.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

try:
    SGLANG_VERSION: str | None = version("sglang")
except PackageNotFoundError:
    SGLANG_VERSION = None

# The stand-ins, probes and model the servers load.
LAUNCH_DIR = Path(__file__).resolve().parent.parent / "tests" / "launch"
MODEL = LAUNCH_DIR / "models" / "tiny-qwen3-moe"
READY = "The server is fired up and ready to roll"
READY_TIMEOUT_S = float(os.environ.get("LAUNCH_READY_TIMEOUT", "480"))  # start-up takes minutes on 2 busy shared cores

SHAPE = [
    "--model-path", str(MODEL), "--load-format", "dummy", "--device", "cpu", "--host", "127.0.0.1",
    "--tp", "2", "--dp", "2", "--enable-dp-attention", "--attention-backend", "torch_native",
    "--disable-cuda-graph", "--max-total-tokens", "2048", "--random-seed", "1",
    "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "3",
    # SGLang's own flag: a scheduler whose whole DP group is idle waits on its sockets (up to 1 s) instead of looping.
    # Without it each idle launch spins both cores of this 2-core host (measured: 38 CPU-s per 20 s idle, 20 with it).
    "--sleep-on-idle",
]  # fmt: skip


def release_reads(module: str, name: str) -> bool:
    """Whether this release's ``module`` reads the server setting ``name`` (its source: importing costs seconds)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
        return spec is not None and name in Path(spec.origin).read_text()
    except Exception:  # noqa: BLE001
        return False


# Flags for CPU gaps of PD decode that only exist in later releases (0.5.17 has neither): a pinned host pool needs
# CUDA, and the decode node's LM-head all-to-all has no CPU kernel.
PD_DECODE = [
    "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
    *(["--disaggregation-decode-retraction-backup", "cpu_tensor"]
      if release_reads("sglang.srt.disaggregation.decode", "disaggregation_decode_retraction_backup") else []),
    *(["--no-enable-tp-lm-head-all-to-all"]
      if release_reads("sglang.srt.layers.logits_processor", "enable_tp_lm_head_all_to_all") else []),
]  # fmt: skip
# b (no harm) compares tokens across launches, so it runs without PD decode: the fake transfer backend moves nothing
# (FakeKVReceiver.poll reports success at once), so the prompt's KV cache and the first token on a decode node are
# whatever those buffers held, and differ from launch to launch whatever the plugin does. Without PD the server
# computes the prompt itself; the rest of the shape stays.
NO_PD = "no-pd"

# Greedy requests sent to every launch that serves (b compares them token by token across launches).
PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33, 34]]
NEW_TOKENS = 8

STATS_EVERY = 2  # SGLANG_DP_MTP_FIX_STATS of the launches whose stats lines the tier reads
REPORT_LINE = re.compile(r"^\[(?P<prefix>[^\]]*)\] (?P<line>sglang-dp-mtp-fix \d\S* on SGLang .*)$", re.M)
RANK_PREFIX = re.compile(r" DP(\d+) TP(\d+)$")
# Anything the plugin itself writes to a log: each of its lines starts "sglang-dp-mtp-fix " or "sglang-dp-mtp-fix:"
# and a traceback through it names its package. A bare substring would also match a path such as the test venvs'
# ~/.cache/sglang-dp-mtp-fix/venvs/... in SGLang's own warnings.
PLUGIN_OUTPUT = re.compile(r"sglang-dp-mtp-fix[ :]|sglang_dp_mtp_fix")


def read_report_lines(log: str) -> dict[str, list[str]]:
    """Plugin report lines by process: 'main' or 'DPd TPt' (SGLang's scheduler log prefix)."""
    by: dict[str, list[str]] = {}
    for m in REPORT_LINE.finditer(log):
        rank = RANK_PREFIX.search(m["prefix"])
        by.setdefault(f"DP{rank[1]} TP{rank[2]}" if rank else "main", []).append(m["line"])
    return by


def read_report_files(report_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(report_dir.glob("sglang-dp-mtp-fix-*.json"))]


SETTLE_QUIET_S = 1.5  # unchanged this long: settled
SETTLE_TIMEOUT_S = float(os.environ.get("LAUNCH_SETTLE_TIMEOUT", "60"))


def settle(read: Callable[[], Any], timeout: float = SETTLE_TIMEOUT_S) -> Any:
    """Poll ``read()`` every 0.25 s until its value has not changed for SETTLE_QUIET_S (the last batch's log lines,
    records or counters written), at most ``timeout`` s; returns the last value. Instead of a fixed sleep: on a loaded
    host the last writes can come later than any fixed pause, and on an idle one they are there at once."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_QUIET_S:
            break
    return last


# The counters of a /metrics page (SGLang's ``*_total`` and the plugin's): what ``Server.settled_metrics`` waits on.
# Not those that move with no batch at all: clock and CPU time (``process_cpu_seconds_total``, 0.5.20's
# ``scheduler_idle_seconds_total``, any ``*_seconds_total``), and the HTTP counters of /metrics itself (each scrape
# counts one). With them the page never settled, and every wait ran its full timeout (60 s, measured).
COUNTER_LINE = re.compile(r'^sglang:(?!process_)(?!\S*_seconds_total\b)\S*_total\b(?!.*endpoint="/metrics").*$', re.M)


def post_generate(port: int, body: dict, timeout: float = 120) -> dict:
    """POST one request to a launch's ``/generate`` on 127.0.0.1; the JSON answer."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


# The ports SGLang derives, as offsets from the port it is given. From --port: the HTTP port and those above it, and,
# with DP attention and no --dist-init-addr, its ZMQ ports from port + 233 (ZMQ_TCP_PORT_DELTA) up. From
# --dist-init-addr: dist_init_port itself, port_base and the five above it (+1 .. +6), and the DP-attention
# handshake of node 0 at +13 (DP_ATTENTION_HANDSHAKE_PORT_DELTA). Each is checked free: a taken one makes a non-zero
# node die at start-up, and node 0 then waits for its handshake forever.
SERVER_PORT_SPAN = (*range(40), *range(233, 248))
DIST_INIT_PORT_SPAN = tuple(range(14))


def free_port_block(span: Sequence[int] = SERVER_PORT_SPAN, avoid: set[int] | None = None) -> int:
    """A base port whose ``base + offset`` is free for every offset of ``span`` and not in ``avoid`` (the allocator the
    harness and the tests share: ``sglang_dp_mtp_fix.harness.ports``, outside the kernel's ephemeral range)."""
    from sglang_dp_mtp_fix.harness.ports import port_block

    return port_block(span, avoid)


def gaps_pythonpath(tmp: Path) -> str:
    """PYTHONPATH entries for the two stand-ins; the helper plugin's entry point lives in a dist-info under ``tmp``
    (never in the venv)."""
    info = tmp / "launch_cpu_gaps-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: launch-cpu-gaps\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nlaunch_cpu_gaps = launch_cpu_gaps:register\n")
    return os.pathsep.join([str(LAUNCH_DIR / "stubs"), str(LAUNCH_DIR / "cpu_gaps"), str(tmp)])


def base_env(gaps: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS"))}
    # LAUNCH_PLUGIN_SRC=<dir>: run the tier against another build of the plugin (its src dir first on the path), e.g.
    # to see a check fail on a build without the fix. Unset: the installed plugin.
    plugin_src = os.environ.get("LAUNCH_PLUGIN_SRC")
    env.update(
        PYTHONPATH=os.pathsep.join([plugin_src, gaps]) if plugin_src else gaps,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        SGLANG_USE_CPU_ENGINE="1",  # else rotary imports vllm
        SGLANG_CPU_OMP_THREADS_BIND="0|1",  # two ranks on one NUMA node: SGLang asks for an explicit binding
        LAUNCH_CPU_ATTN_OPS="1",  # speculative decoding needs IntelAMXAttnBackend (see launch_cpu_gaps, gap 3)
        SGLANG_PLUGINS="dp_mtp_fix,launch_cpu_gaps",
        # SGLang's @torch.compile helpers (top-k, sampler) run eagerly: on CPU, inductor compiled them with the C++
        # compiler at every cold start (one 0.5.20 launch: 88 s cold against 60 s with this), and both arms of each
        # comparison run alike; no function the plugin patches is compiled on these CPU launches.
        TORCHDYNAMO_DISABLE="1",
    )
    env.update(extra)
    return env


@dataclass
class Server:
    name: str
    log_path: Path
    port: int
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    ready_s: float | None = None
    pd: bool = True

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY in self.log:
                self.ready_s = time.monotonic() - self.started
                return True
            if not self.alive():
                return False
            time.sleep(0.5)
        return False

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def group_alive(self) -> bool:
        self.proc.poll()  # reap the launcher if it exited: as a zombie of ours it would keep the group "alive"
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self) -> None:
        """SIGTERM to the launcher, then SIGKILL to its whole process group (schedulers, detokenizer, ...)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            self.wait_exit(15)
        for _ in range(120):  # killed children stay in the group until init reaps them (slow on a loaded host)
            if not self.group_alive():
                break
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.25)
        if self.alive():
            self.proc.wait(10)

    def generate(self, input_ids: list[int], room: int, max_new_tokens: int = NEW_TOKENS) -> dict:
        body = (
            {}
            if not self.pd
            else {
                # PD decode needs a bootstrap peer; "2.2.2.2" is SGLang's fake-transfer marker (compared as a string,
                # never contacted; SGLang's warm-up sends the same).
                "bootstrap_host": "2.2.2.2",
                "bootstrap_room": room,
            }
        )
        body |= {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        return post_generate(self.port, body)

    def scrape_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as resp:
            return resp.read().decode()

    def settled_metrics(self) -> str:
        """/metrics once its counters have stopped changing (``settle``): exact comparisons with the log lines and the
        records read a page where every finished batch is counted."""
        pages: list[str] = []

        def counters() -> list[str]:
            pages.append(self.scrape_metrics())
            return COUNTER_LINE.findall(pages[-1])

        settle(counters)
        return pages[-1]

    def generate_all(self, prompts: list[list[int]] = PROMPTS) -> list[dict]:
        """Send every prompt at once (so both DP ranks get work); results in prompt order."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda ik: self.generate(ik[1], 1000 + ik[0]), enumerate(prompts)))


def server_argv(port: int, extra_args: Sequence[str] = (), pd: bool = True) -> list[str]:
    """The command line of one launch on ``port``. Its ``--nccl-port`` comes from the allocator too: left unset,
    0.5.15-0.5.20 pick the rank-0 TCP store's port by binding port 0 (the kernel's ephemeral range) and bind it again
    seconds later, and an outgoing connection can take it in between (``EADDRINUSE``, the scheduler dead at start-up).
    0.5.23 picks it below the ephemeral range itself."""
    nccl = [] if "--nccl-port" in extra_args else ["--nccl-port", str(free_port_block((0,)))]
    return [sys.executable, "-m", "sglang.launch_server", *SHAPE, *(PD_DECODE if pd else []), "--port", str(port),
            *nccl, *extra_args]  # fmt: skip


def start_server(
    name: str,
    log_dir: Path,
    env: dict[str, str],
    extra_args: Sequence[str] = (),
    port: int | None = None,
    pd: bool = True,
) -> Server:
    port = port or free_port_block()
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            server_argv(port, extra_args, pd),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(log_dir),
            # its own process group (stop() kills every process it started), in our session: a session of its own
            # would be a scheduling group of its own (Linux autogroup), where no nice value reaches
            # (_yield_spinning_loops)
            process_group=0,
        )
    threading.Thread(target=_yield_spinning_loops, args=(proc,), daemon=True).start()
    return Server(name, log_path, port, proc, pd=pd)


# SGLang's DP controller polls its socket without blocking in a loop of its own (no idle wait in any release), so it
# takes a whole core for the launch's lifetime. At the lowest priority it only uses a core nothing else wants: the
# other tests running beside the tier, and the launch's own schedulers, come first. What it does is unchanged.
SPINNING_LOOPS = ("sglang::data_parallel_controller",)


def _yield_spinning_loops(proc: subprocess.Popen, poll_s: float = 0.5, limit_s: float = READY_TIMEOUT_S) -> None:
    """Lower the spinning loop of ``proc``'s process group (one DP controller per launch) to nice 19 once it appears."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != proc.pid:  # field 5: the process group
                    continue
                title = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if title.startswith(SPINNING_LOOPS):
                    os.setpriority(os.PRIO_PROCESS, int(stat.parent.name), 19)
                    return
            except (OSError, ValueError, IndexError):
                continue  # gone in between, or not ours
        time.sleep(poll_s)


@dataclass
class Launch:
    """One served launch: its log, its report files and the completions of PROMPTS."""

    server: Server
    report_dir: Path
    outputs: list[dict]  # PROMPTS sent at once (both DP ranks busy together)
    sequential: list[dict]  # PROMPTS one at a time: each alone in its batch, so numerics do not depend on batching
    # /metrics of a launch with --enable-metrics, once ready (before any request) and after the last request
    metrics_ready: str | None = None
    metrics_end: str | None = None
    live: Any = None  # what serve's ``while_running`` returned (taken while the server still ran)

    @property
    def log(self) -> str:
        return self.server.log

    def report_lines(self) -> dict[str, list[str]]:
        return read_report_lines(self.log)

    def report_files(self) -> list[dict]:
        return read_report_files(self.report_dir)


# SGLang publishes its scheduler gauges (sglang:num_running_reqs, ...) only every --decode-log-interval decode batches
# (default 40) or after 30 s idle, so whether they are on /metrics when scraped would depend on the launch's timing.
# Every decode batch publishes them with 1.
METRICS = ["--enable-metrics", "--decode-log-interval", "1"]


def serve(
    name: str,
    tmp: Path,
    env: dict[str, str],
    timings: dict,
    pd: bool = True,
    metrics: bool = False,
    while_running: Callable[[Server], Any] | None = None,
) -> Launch:
    """``metrics``: launch with SGLang's --enable-metrics and scrape /metrics once ready and after the requests.
    ``while_running``: called with the server after the requests, before it is stopped (its result: ``Launch.live``)."""
    report_dir = tmp / f"{name}-reports"
    report_dir.mkdir()
    env = {**env, "SGLANG_DP_MTP_FIX_REPORT_DIR": str(report_dir)}
    server = start_server(name, tmp, env, METRICS if metrics else [], pd=pd)
    try:
        t0 = time.monotonic()
        if not server.wait_ready():
            pytest.fail(f"{name}: server never became ready; log tail:\n{server.log[-4000:]}")
        metrics_ready = server.scrape_metrics() if metrics else None
        outputs = server.generate_all()
        # Dummy weights are tiny (+-1e-3), so logits are near ties and a different batch mix can flip a greedy token;
        # requests one at a time give every launch the same batches.
        sequential = [server.generate(ids, 2000 + k) for k, ids in enumerate(PROMPTS)]
        settle(server.log_size)  # the last batch's log lines
        metrics_end = server.settled_metrics() if metrics else None
        live = while_running(server) if while_running is not None else None
        timings[name] = round(time.monotonic() - t0, 1)
        return Launch(server, report_dir, outputs, sequential, metrics_ready, metrics_end, live)
    finally:
        server.stop()
        assert not server.group_alive(), f"{name}: processes left behind"
