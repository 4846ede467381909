"""The launch helpers' waits (``tools/launchlib.py``), without a server: what ``settled_metrics`` waits on."""

from __future__ import annotations

import time

import launchlib

PAGE = """\
sglang:process_cpu_seconds_total{component="detokenizer"} %(cpu)s
sglang:scheduler_idle_seconds_total{dp_rank="0"} %(cpu)s
sglang:http_requests_total{endpoint="/metrics",method="GET"} %(scrapes)s
sglang:http_responses_total{endpoint="/metrics",method="GET",status_code="200"} %(scrapes)s
sglang:http_requests_total{endpoint="/generate",method="POST"} 8.0
sglang:dp_mtp_fix_decode_batches_total{dp_rank="0"} %(batches)s
sglang:num_running_reqs{dp_rank="0"} 0.0
"""


def test_counters_are_those_a_batch_moves():
    lines = launchlib.COUNTER_LINE.findall(PAGE % {"cpu": 1.0, "scrapes": 3.0, "batches": 40.0})
    assert lines == [
        'sglang:http_requests_total{endpoint="/generate",method="POST"} 8.0',
        'sglang:dp_mtp_fix_decode_batches_total{dp_rank="0"} 40.0',
    ]


def test_a_page_whose_batches_stopped_settles_although_each_scrape_counts_itself(monkeypatch):
    scrapes = []

    def scrape(self) -> str:  # every scrape moves the CPU and /metrics counters, as SGLang's page does
        scrapes.append(1)
        n = len(scrapes)
        return PAGE % {"cpu": 0.01 * n, "scrapes": float(n), "batches": float(min(n, 3))}

    monkeypatch.setattr(launchlib.Server, "scrape_metrics", scrape)
    t0 = time.monotonic()
    page = launchlib.Server.settled_metrics(object.__new__(launchlib.Server))
    # a page that never settles waits out SETTLE_TIMEOUT_S (60 s); half of it cannot be tripped by a busy machine
    assert time.monotonic() - t0 < launchlib.SETTLE_TIMEOUT_S / 2, "waited for counters that move on their own"
    assert 'dp_mtp_fix_decode_batches_total{dp_rank="0"} 3.0' in page


def test_every_launch_gives_sglang_its_store_port_from_outside_the_ephemeral_range():
    """Read back by SGLang's own parser: the rank-0 TCP store's port is ours, never one SGLang takes from the
    kernel's ephemeral range (where an outgoing connection can take it first); a test's own ``--nccl-port`` wins."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_dp_mtp_fix.harness import ports

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    port = launchlib.free_port_block()
    args = parser.parse_args(launchlib.server_argv(port)[3:])
    low, high = ports._ephemeral_range()
    assert args.port == port
    assert args.nccl_port is not None and not low <= args.nccl_port <= high, args.nccl_port
    own = launchlib.server_argv(port, ["--nccl-port", "12345"])
    assert parser.parse_args(own[3:]).nccl_port == 12345 and own.count("--nccl-port") == 1
