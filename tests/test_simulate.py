"""``sglang-dp-mtp-fix simulate`` end to end (short traces): the stock split and the patched fix, JSON that adds up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from releases import SGLANG_VERSION
from support import expected_status, release_free, requires_sglang, run_cli

from sglang_dp_mtp_fix.harness.pool import START_ENV

pytestmark = requires_sglang


def simulate(*args: str) -> dict:
    """``simulate --json`` through the CLI's ``main`` in a pristine forked child whose ranks are forked from it
    (``SGLANG_DP_MTP_FIX_HARNESS_START=fork``: no SGLang import per run; ``test_bad_trace_is_a_clear_error`` runs the
    installed console script)."""
    proc = run_cli(["simulate", "--json", *args], {START_ENV: "fork"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_arm(arm: dict, rounds: int) -> None:
    assert arm["rounds"] == rounds
    assert 0 <= arm["generic_graph_rate"] <= 1 and 0 <= arm["draft_graph_rate"] <= 1
    assert arm["divergent_rounds"] <= arm["rounds_with_batches"] <= rounds
    graph_rounds = round(arm["draft_graph_rate"] * arm["rounds_with_batches"])
    assert graph_rounds + arm["draft_eager_rounds"] == arm["rounds_with_batches"]
    assert arm["hangs"] <= arm["divergent_rounds"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_simulate_stock_splits_and_patched_does_not(ranks):
    rounds = 150
    data = simulate("--ranks", str(ranks), "--rounds", str(rounds), "--seed", "7")
    assert data["ranks"] == ranks and data["rounds"] == rounds
    check_arm(data["stock"], rounds)
    if expected_status() == "applied":
        check_arm(data["patched"], rounds)
        assert data["stock"]["divergent_rounds"] > 0 and data["stock"]["hangs"] > 0
        assert data["patched"]["divergent_rounds"] == 0 and data["patched"]["hangs"] == 0
        assert data["patched"]["generic_graph_rate"] == 1.0  # the draft vote never costs the generic graph
        assert data["patched"]["collectives_per_round"] == data["stock"]["collectives_per_round"]
        counters = data["patched_vote_counters_per_rank"]
        assert len(counters) == ranks and all(c["decode_batches"] > 0 for c in counters)
    else:
        assert data["patched"] is None
        assert data["stock"]["divergent_rounds"] == 0  # superseded upstream, or the bug cannot happen


@release_free  # the report write that stops the ranks is the plugin's own, before any SGLang code is read
def test_a_strict_stop_in_the_ranks_is_one_line_and_exit_2(tmp_path):
    """Issue 54 (lower-harm): strict with a report directory that does not exist stops the patched arm's ranks, as it
    stops a launch; simulate printed the ranks' traceback and exited 1 ("not patched" or "a divergence")."""
    env = {START_ENV: "fork", "SGLANG_DP_MTP_FIX": "strict", "SGLANG_DP_MTP_FIX_REPORT_DIR": str(tmp_path / "none")}
    proc = run_cli(["simulate", "--rounds", "3"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("simulate:")]
    assert "stopped, as a launch would" in line and "SGLANG_DP_MTP_FIX_REPORT_DIR" in line, line


def test_trace_file_round_trip(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"ranks": [{"kind": "decode", "seed": False}, {"kind": "none"}]},
        {"ranks": [{"kind": "decode", "seed": True}, {"kind": "idle"}]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = simulate("--trace", str(trace))
    assert data["ranks"] == 2 and data["rounds"] == 2
    if expected_status() == "applied":
        assert data["stock"]["divergent_rounds"] == 1 and data["patched"]["divergent_rounds"] == 0


def test_bad_trace_is_a_clear_error(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"ranks": [{"kind": "decode", "sed": true}]}\n')
    exe = shutil.which("sglang-dp-mtp-fix", path=os.path.dirname(sys.executable))
    proc = subprocess.run([exe, "simulate", "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "bad rank state" in proc.stderr + proc.stdout


@pytest.mark.skipif(
    expected_status() != "applied" or SGLANG_VERSION != "0.5.20", reason=f"runs on 0.5.20 only, not on {SGLANG_VERSION}"
)
def test_unguarded_split_is_the_real_failure(tmp_path):
    """The stock split, issued for real: gloo aborts the eager-shaped rank; the patched arm never splits."""
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"ranks": [{"kind": "decode", "seed": True}, {"kind": "decode", "seed": True}]},
        {"ranks": [{"kind": "decode", "seed": False}, {"kind": "none"}]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = simulate("--trace", str(trace), "--unguarded")
    assert data["stock"]["real_failure"].startswith("round 1: ") and "exited" in data["stock"]["real_failure"]
    assert data["patched"]["real_failure"] == "no split round"


@pytest.mark.skipif(expected_status() != "applied", reason="the releases draft_token_counts patches")
def test_backend_pair_stock_splits_the_draft_and_patched_does_not(tmp_path):
    """``--moe-a2a-backend deepep --speculative-moe-a2a-backend none`` (target does not gather token counts, the
    draft does): stock ranks split the draft bucket (3 vs 12 requests: 8 vs 16) and the draft path (65 is above the
    draft graph's max_bs, 64), also next to a seedless PD batch; the patched arm (draft_token_counts with the vote)
    never does. Same table, same trace."""
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"ranks": [{"kind": "decode", "num_reqs": 3}, {"kind": "decode", "num_reqs": 12}]},
        {"ranks": [{"kind": "decode", "num_reqs": 2}, {"kind": "decode", "num_reqs": 65}]},
        {"ranks": [{"kind": "decode", "num_reqs": 3, "seed": False}, {"kind": "decode", "num_reqs": 12}]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = simulate("--trace", str(trace), "--moe-a2a-backend", "deepep", "--speculative-moe-a2a-backend", "none")
    assert (data["moe_a2a_backend"], data["speculative_moe_a2a_backend"]) == ("deepep", "none")
    assert data["require_mlp_tp_gather"] == {"target": False, "draft": True}
    check_arm(data["stock"], 3)
    check_arm(data["patched"], 3)
    assert data["stock"]["divergent_rounds"] == 3 and data["stock"]["hangs"] == 3, data["stock"]
    assert data["stock"]["bucket_splits"] == 1, data["stock"]
    assert data["patched"]["divergent_rounds"] == 0 and data["patched"]["hangs"] == 0, data["patched"]


def _tagged(tag: str) -> list[int]:
    """The live processes whose environment carries ``tag`` (a forked rank shows its parent's)."""
    from sglang_dp_mtp_fix.diagnosis.recfile import proc_state

    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag.encode() in f.read() and proc_state(int(entry)) not in (None, "Z", "X", "x"):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.skipif(SGLANG_VERSION != "0.5.20", reason=f"runs on 0.5.20 only, not on {SGLANG_VERSION}")
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_simulate_killed_by_its_pid_leaves_no_process(tmp_path):
    """Before: a supervisor's kill of the main PID left the forkserver, the resource tracker and the 4 ranks alive for
    good (issue 54, finding 4)."""
    import signal
    import time
    import uuid

    tag = f"SDMF_KILL_TAG={uuid.uuid4().hex}"
    exe = shutil.which("sglang-dp-mtp-fix", path=os.path.dirname(sys.executable))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}, tag.split("=")[0]: tag.split("=")[1]}
    log = tmp_path / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([exe, "simulate", "--rounds", "100000"], stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        deadline = time.monotonic() + 240
        while " rounds" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and " rounds" in log.read_text(), log.read_text()[-2000:]
        assert len(_tagged(tag)) >= 5  # the main process, the forkserver and 4 ranks (the tracker too)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _tagged(tag) == [], "left behind after the main PID was killed"
    finally:
        for pid in _tagged(tag):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
