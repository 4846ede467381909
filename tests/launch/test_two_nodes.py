"""d. Half-patched deployment: two "nodes" on this host (``--nnodes 2 --node-rank 0/1``, loopback rendezvous), each its
own launcher with its own environment (inside one launch every scheduler inherits the launcher's environment, so a
per-rank setting needs two nodes). One scheduler rank per node; a short SGLANG_DP_MTP_FIX_PEER_TIMEOUT."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from launchlib import DIST_INIT_PORT_SPAN, READY, base_env, free_port_block, release_reads, start_server
from releases import LAUNCHES_HERE, NOT_YET, SGLANG_VERSION, TWO_NODES, runs_on
from support import load_scaled_timeout

pytestmark = [
    pytest.mark.skipif(
        SGLANG_VERSION not in LAUNCHES_HERE,
        reason=f"SGLang {SGLANG_VERSION} does not launch on CPU here yet: {NOT_YET.get(SGLANG_VERSION, 'not tried')}",
    ),
    # test_peers.py runs d's comparisons (a rank off, another skip list, ranks alike) in-process on every affected
    # release; the two-node launch adds SGLang's own multi-node start-up and tear-down around them: a pair that stops
    # (a rank off) and one that serves. Another skip list stops through the same path as the first (test_peers).
    pytest.mark.skipif(SGLANG_VERSION not in TWO_NODES, reason=f"d {runs_on(TWO_NODES)}"),
]

PEER_TIMEOUT_S = load_scaled_timeout(5, per_load_s=2)  # the stopping scenarios wait it out: short, load-scaled
NODE1_UP = "sglang::data_parallel_controller"  # node 1's launcher spawns it only after its port checks
NODE1_UP_WITHIN_S = 180
STOP_WITHIN_S = 240  # start-up (model load on 2 busy cores) + the peer timeout + SGLang's own tear-down
NODE1_GONE_GRACE_S = 30  # node 0 stops first in every scenario here; node 1 gone long before it means trouble
# Each node binds its one scheduler to its own core. 0.5.16-0.5.18 pick the binding by TP rank from a list that must
# have tp_size entries ("SGLANG_CPU_OMP_THREADS_BIND setting must be aligned with TP size parameter (2)"): both nodes
# get the whole list. Other releases index it by the node's local device (one entry per node).
BIND_BY_TP_RANK = release_reads("sglang.srt.utils.numa_utils", "tp_size == len(threads_bind_list)")
MISMATCH = "PeerStateMismatch: sglang-dp-mtp-fix: patch state differs across the 2 ranks of this launch; stopping"


def _spawned(pgid: int, title: str) -> bool:
    """Does a process titled ``title`` run in process group ``pgid`` (a launch's own group)?"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and title in (stat.parent / "cmdline").read_bytes().decode(errors="replace"):
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


class TwoNodes:
    def __init__(self, name, tmp, gaps, node1_extra: dict[str, str]):
        taken: set[int] = set()  # every port either node derives, kept apart
        dist = f"127.0.0.1:{free_port_block(DIST_INIT_PORT_SPAN, taken)}"
        common = ["--nnodes", "2", "--dist-init-addr", dist]
        binds = ("0|1", "0|1") if BIND_BY_TP_RANK else ("0", "1")
        env0 = base_env(gaps, SGLANG_CPU_OMP_THREADS_BIND=binds[0], SGLANG_DP_MTP_FIX_PEER_TIMEOUT=str(PEER_TIMEOUT_S))
        env1 = {**env0, "SGLANG_CPU_OMP_THREADS_BIND": binds[1], **node1_extra}
        self.started = time.monotonic()
        # Node 1 first, node 0 once node 1's scheduler is up. Two SGLang "nodes" on one host derive the same port_base
        # from the shared --dist-init-addr (dist_init_port + 1); a non-zero node only checks it is free, node 0 also
        # binds it. Started together, node 1's check could meet node 0's bind (seen: "port_base at ... is used by a
        # process already") and node 1 died, so node 0 waited for it forever or the mismatch read as a missing rank.
        node1_port = free_port_block(avoid=taken)
        self.node1 = start_server(f"{name}-node1", tmp, env1, [*common, "--node-rank", "1"], port=node1_port)
        deadline = time.monotonic() + NODE1_UP_WITHIN_S
        while not _spawned(self.node1.proc.pid, NODE1_UP) and self.node1.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        # Node 0 waits for node 1's handshake without a timeout (SGLang's design): without node 1 it would only hang.
        assert self.node1.alive(), f"node 1 exited before its DP controller started:\n{self.node1.log[-3000:]}"
        node0_port = free_port_block(avoid=taken)
        self.node0 = start_server(f"{name}-node0", tmp, env0, [*common, "--node-rank", "0"], port=node0_port)

    def tails(self) -> str:
        """Both nodes' log tails, and whether node 1 still runs, for a failure message."""
        node1 = "running" if self.node1.alive() else f"exited rc={self.node1.proc.returncode}"
        return f"node 0:\n{self.node0.log[-3000:]}\nnode 1 ({node1}):\n{self.node1.log[-2000:]}"

    def stop(self) -> None:
        for node in (self.node0, self.node1):
            node.stop()
        assert not (self.node0.group_alive() or self.node1.group_alive()), "processes left behind"

    def stops_by_itself(self):
        """Wait (bounded) for node 0's launcher to exit on its own, then for every process of node 0 to be gone.

        Node 1 is only observed (``node1_left``): SGLang's non-zero node does not always exit by itself once node 0 is
        gone (seen on 0.5.20 under load: its launcher died in ``set_server_stop_hook`` on a None tokenizer manager
        and the group was still alive 30 s later); that is SGLang's multi-node tear-down, and the finalizer stops it.
        """
        deadline = time.monotonic() + STOP_WITHIN_S
        node1_gone_at: float | None = None
        while self.node0.alive() and time.monotonic() < deadline:
            if node1_gone_at is None and not self.node1.group_alive():
                node1_gone_at = time.monotonic()
            if node1_gone_at is not None and time.monotonic() - node1_gone_at > NODE1_GONE_GRACE_S:
                break  # node 0 would wait for node 1's handshake forever: fail now, with both logs
            time.sleep(0.5)
        rc = self.node0.proc.poll()
        took = time.monotonic() - self.started
        deadline = time.monotonic() + 30
        while (self.node0.group_alive() or self.node1.group_alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        self.node1_left = self.node1.group_alive()
        return rc, took, [n.name for n in (self.node0,) if n.group_alive()]


@pytest.fixture()
def two_nodes(gaps_path, launch_tmp, launch_timings, request):
    started: list[TwoNodes] = []

    def start(node1_extra: dict[str, str]) -> TwoNodes:
        nodes = TwoNodes(request.node.name, launch_tmp, gaps_path, node1_extra)
        started.append(nodes)
        return nodes

    yield start
    for nodes in started:
        launch_timings[f"d:{request.node.name}"] = round(time.monotonic() - nodes.started, 1)
        if getattr(nodes, "node1_left", False):
            launch_timings[f"d:{request.node.name}:node1-still-running-30s-after"] = 1
        nodes.stop()


def test_d_node_with_plugin_off_stops_the_launch_naming_the_rank(two_nodes):
    nodes = two_nodes({"SGLANG_DP_MTP_FIX": "off"})
    rc, took, left = nodes.stops_by_itself()
    log0, log1 = nodes.node0.log, nodes.node1.log
    assert rc not in (None, 0), f"launch did not stop by itself within {STOP_WITHIN_S}s:\n{nodes.tails()}"
    assert MISMATCH in log0 and f"no patch-state from ranks [1] within {PEER_TIMEOUT_S}s" in log0, log0[-4000:]
    assert READY not in log0 and READY not in log1
    assert not left, f"still running after the launch stopped: {left}"
    # the off node says so, visibly, in its own log (the hint in the mismatch message points at this line)
    off_lines = [line for line in log1.splitlines() if "sglang-dp-mtp-fix " in line and "(mode=off)" in line]
    assert any(" DP1 TP1] " in line for line in off_lines), log1[-3000:]
    assert all("SGLANG_DP_MTP_FIX=off here, SGLang left fully stock" in line for line in off_lines), off_lines


def test_d_both_nodes_alike_serve(two_nodes):
    nodes = two_nodes({})
    assert nodes.node0.wait_ready(), nodes.node0.log[-4000:]
    out = nodes.node0.generate([1, 5, 6, 7], room=1)
    assert out["meta_info"]["completion_tokens"] == 8
    both = nodes.node0.log + nodes.node1.log
    assert "cross-rank patch-state check passed on rank 0: 2 ranks agree" in nodes.node0.log
    assert "cross-rank patch-state check passed on rank 1: 2 ranks agree" in nodes.node1.log
    assert "PeerStateMismatch" not in both
