"""The one port allocator of the harness, the tests and the launch helpers (``tools/launchlib.py``).

Binding port 0 and releasing it hands out a port from the kernel's ephemeral range, which any outgoing connection
may take as its local port before the intended user binds it (seen: a launch's ``ZMQError: Address already in use``
half a minute later, and a gloo store's bind). Ports here come from outside that range, so the kernel never hands
them to anyone; each candidate is checked free by binding it; and one process never hands the same port out twice
(a store's port in TIME_WAIT, two blocks of one test). Processes that run side by side (the test matrix's two lanes)
take disjoint ranges: ``SGLANG_DP_MTP_FIX_PORTS=LOW-HIGH`` keeps every port handed out here inside it."""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

PORTS_ENV = "SGLANG_DP_MTP_FIX_PORTS"
_HANDED_OUT: set[int] = set()
_LOCK = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def _allowed() -> tuple[int, int]:
    """The ports this process may hand out: ``SGLANG_DP_MTP_FIX_PORTS`` (``LOW-HIGH``), else 10000-65535."""
    raw = os.environ.get(PORTS_ENV, "").strip()
    if not raw:
        return 10000, 65535
    low, sep, high = raw.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit() and 1024 <= int(low) < int(high) <= 65535):
        raise ValueError(f"{PORTS_ENV}={raw!r}: expected LOW-HIGH, two port numbers with 1024 <= LOW < HIGH <= 65535")
    return int(low), int(high)


def _candidate(room: int, rng: random.Random) -> int:
    """A random port ``p`` with ``p .. p + room`` inside the allowed ports and outside the kernel's ephemeral range."""
    low, high = _ephemeral_range()
    first, last = _allowed()
    ranges = [
        (max(lo, first), min(hi, last - room))
        for lo, hi in ((10000, low - room), (high + 1, 65535 - room))
        if min(hi, last - room) > max(lo, first)
    ]
    if not ranges:
        raise RuntimeError(
            f"no port range inside {first}-{last} and outside the ephemeral ports {low}-{high} with room for +{room}"
        )
    return rng.randrange(*rng.choice(ranges))


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_block(span: Sequence[int] = (0,), avoid: set[int] | None = None) -> int:
    """A base port whose ``base + offset`` is free for every offset of ``span``, outside the ephemeral range, never
    handed out before by this process and not in ``avoid``; the ports are then recorded as handed out (and added to
    ``avoid``)."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = _candidate(max(span), rng)
        ports = {base + offset for offset in span}
        with _LOCK:
            if ports & _HANDED_OUT or (avoid and ports & avoid) or not all(_free(p) for p in ports):
                continue
            _HANDED_OUT.update(ports)
        if avoid is not None:
            avoid.update(ports)
        return base
    raise RuntimeError("no free port block on 127.0.0.1 outside the ephemeral range")


def free_port() -> int:
    """One port (``port_block`` of one)."""
    return port_block()
