"""Real single-host launches: a (patched launch), b (no harm), e (kill switch), f (stand down), g (counters), and the
vote counters on SGLang's /metrics (#13).

Launches shared by the scenarios: patched (a, g, metrics, recorder) in the seed's shape with SGLang's --enable-metrics;
the plugin-off half of e and metrics reads the plugin-off launch of c (``conftest.probe_off``: the same shape, plus the
vote probe, which adds no metric and no report line); b's three arms (patched, off, not selected) without PD decode
(why: ``launchlib.NO_PD``). On releases where the plugin stands down (f) one launch. Each launch serves its requests
and is stopped before the assertions run. Where each runs: ``tests/releases.py``."""

from __future__ import annotations

import os
import re
import time

import pytest
from launchlib import NEW_TOKENS, PLUGIN_OUTPUT, PROMPTS, STATS_EVERY, base_env, serve
from probe_launch import PHASES
from releases import AFFECTED, LAUNCHES_HERE, NO_HARM, NOT_YET, PROBE, SGLANG_VERSION, STAND_DOWN, runs_on

from sglang_dp_mtp_fix.patches import PATCH_IDS

pytestmark = [
    pytest.mark.skipif(
        SGLANG_VERSION not in LAUNCHES_HERE,
        reason=f"SGLang {SGLANG_VERSION} does not launch on CPU here yet: {NOT_YET.get(SGLANG_VERSION, 'not tried')}",
    ),
    pytest.mark.skipif(
        SGLANG_VERSION not in AFFECTED + STAND_DOWN, reason=f"no launch scenario on SGLang {SGLANG_VERSION}"
    ),
]
no_harm_only = pytest.mark.skipif(SGLANG_VERSION not in NO_HARM, reason=f"b {runs_on(NO_HARM)}")
off_launch_only = pytest.mark.skipif(
    SGLANG_VERSION not in PROBE, reason=f"e and metrics' off half read c's plugin-off launch, which {runs_on(PROBE)}"
)
affected_only = pytest.mark.skipif(SGLANG_VERSION not in AFFECTED, reason="the plugin stands down here (f)")
stand_down_only = pytest.mark.skipif(SGLANG_VERSION not in STAND_DOWN, reason=f"f {runs_on(STAND_DOWN)}")

RANKS = {"DP0 TP0", "DP1 TP1"}  # SGLang's scheduler log prefixes
STATS_LINE = re.compile(
    r"^\[[^\]]* DP(?P<dp>\d) TP\d\] sglang-dp-mtp-fix stats \(last (?P<n>\d+) decode batches\): "
    r"generic decode vote graph-eligible=(?P<gy>\d+) eager=(?P<gn>\d+); "
    r"draft vote graph-eligible=(?P<dy>\d+) forced-eager=(?P<dn>\d+); "
    r"forced-eager by cause: own seedless batch=(?P<own>\d+), another rank's vote=(?P<other>\d+)$",
    re.M,
)
PEER_PASSED = re.compile(
    r"^\[[^\]]* DP(?P<dp>\d) TP\d\] sglang-dp-mtp-fix: cross-rank patch-state check passed on rank (?P<rank>\d): "
    rf"2 ranks agree \(plugin \S+, \d+ of {len(PATCH_IDS)} patches applied, \d+ fingerprints\)$",
    re.M,
)


def statuses(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=([\w-]+)(?:,|$)", line.split("): ", 1)[1]))


@pytest.fixture(scope="module")
def patched(gaps_path, launch_tmp, launch_timings):
    if SGLANG_VERSION not in AFFECTED:
        pytest.skip("the plugin stands down here")
    recorder_dir = launch_tmp / "patched-recorder"
    recorder_dir.mkdir()
    env = base_env(
        gaps_path, SGLANG_DP_MTP_FIX_STATS=str(STATS_EVERY), SGLANG_DP_MTP_FIX_RECORDER_DIR=str(recorder_dir)
    )
    return serve("patched", launch_tmp, env, launch_timings, metrics=True, while_running=recorder_rollcall)


def recorder_rollcall(server) -> dict:
    """The flight recorder, read while the server runs: rollcall over its directory, and its schedulers alive."""
    from sglang_dp_mtp_fix import rollcall

    directory = str(server.log_path.parent / "patched-recorder")
    written_out(directory)
    data, code = rollcall.rollcall([directory])
    alive = []
    for rank in data["ranks"]:
        try:
            os.kill(rank["pid"], 0)
            alive.append(rank["rank"])
        except ProcessLookupError:
            pass
    return {"data": data, "code": code, "alive": alive, "server_alive": server.alive(), "dir": directory}


def written_out(directory: str, timeout: float = 30) -> None:
    """Until every file was written out after this call (the ring goes out with each heartbeat, issue 45; two ticks:
    the first may have been taken before this call), so it holds every round the counters read before it."""
    from sglang_dp_mtp_fix.diagnosis import reader

    def ticks() -> list[int]:
        return [reader.read_file(p).heartbeat_ticks for p in reader.files_in(directory)]

    before, deadline = ticks(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = ticks()
        if len(now) == len(before) and all(a >= b + 2 for a, b in zip(now, before, strict=True)):
            return
        time.sleep(0.1)
    raise AssertionError(f"the recorder files in {directory} were not written out again within {timeout} s")


@pytest.fixture(scope="module")
def no_harm(gaps_path, launch_tmp, launch_timings):
    """b's two arms, same requests, one at a time (tokens must not depend on how requests share batches). No "off"
    arm: SGLANG_DP_MTP_FIX=off leaves SGLang stock by identity (e, on c's plugin-off launch), so its tokens are the
    not-selected arm's."""
    if SGLANG_VERSION not in NO_HARM:
        pytest.skip(f"b {runs_on(NO_HARM)}")
    arms = {
        "patched": base_env(gaps_path),
        "not selected": base_env(gaps_path, SGLANG_PLUGINS="launch_cpu_gaps"),
    }
    return {arm: serve(f"b-{arm.replace(' ', '-')}", launch_tmp, env, launch_timings, pd=False)
            for arm, env in arms.items()}  # fmt: skip


@pytest.fixture(scope="module")
def standing_down(gaps_path, launch_tmp, launch_timings):
    return serve("stand-down", launch_tmp, base_env(gaps_path), launch_timings)


def assert_served(launch) -> None:
    for out in launch.outputs:
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS and len(out["output_ids"]) == NEW_TOKENS, out
    assert "Traceback" not in launch.log, launch.log[-4000:]


def assert_one_line_per_process(launch, must_contain: str) -> dict[str, str]:
    """Every process that loads the plugin logs its report line exactly once (defects 1 and 2): the launcher plain,
    each scheduler with SGLang's rank prefix; and as many processes wrote a report file as logged a line."""
    # Which processes load plugins is SGLang's choice (the launcher and the schedulers; 0.5.23 also its DP controller
    # and detokenizer, which log without a prefix): each of them writes one report file and logs one line.
    lines = launch.report_lines()
    assert set(lines) == RANKS | {"main"} and all(len(lines[r]) == 1 for r in RANKS), lines
    every = [line for v in lines.values() for line in v]
    for line in every:
        assert f"on SGLang {SGLANG_VERSION} " in line and must_contain in line, line
    files = launch.report_files()
    assert len({f["pid"] for f in files}) == len(files) == len(every) >= 3, ([f["pid"] for f in files], lines)
    assert sorted(f["summary"] for f in files) == sorted(every)
    return {k: v[0] for k, v in lines.items()}


# --- a. patched launch -------------------------------------------------------------------------------------------


@affected_only
def test_a_every_process_logs_its_report_line_once(patched):
    lines = assert_one_line_per_process(patched, "(mode=auto): ")
    for line in lines.values():
        assert statuses(line)["draft_graph_vote"] == "applied" and "SGLANG_DP_MTP_FIX=off" not in line, line


@affected_only
def test_a_cross_rank_check_passes_and_says_so_once_per_rank(patched):
    passed = [(m["dp"], m["rank"]) for m in PEER_PASSED.finditer(patched.log)]
    assert sorted(passed) == [("0", "0"), ("1", "1")], patched.log[-4000:]
    assert "PeerStateMismatch" not in patched.log and "check could not run" not in patched.log


@affected_only
def test_a_requests_complete_on_every_dp_rank(patched):
    assert_served(patched)
    assert {out["meta_info"]["dp_rank"] for out in patched.outputs} == {0, 1}


# --- g. counters -------------------------------------------------------------------------------------------------


@affected_only
def test_g_counters_on_every_rank_during_real_decode_with_words_true_without_graphs(patched):
    lines = list(STATS_LINE.finditer(patched.log))
    assert {m["dp"] for m in lines} == {"0", "1"}, patched.log[-4000:]
    for m in lines:
        n = int(m["n"])
        assert n == STATS_EVERY and int(m["gy"]) + int(m["gn"]) == n and int(m["dy"]) + int(m["dn"]) == n
        # --disable-cuda-graph: SGLang's own generic vote is "eager" for every batch; the draft vote only says no
        # rank forced eager (no seedless batch in plain decode), which is what its words say.
        assert int(m["gy"]) == 0 and int(m["dn"]) == 0 and int(m["own"]) == int(m["other"]) == 0, m[0]
    assert "graph true=" not in patched.log  # the old wording, which read as graph use


# --- the vote counters on SGLang's /metrics (--enable-metrics) -------------------------------------------------


PLUGIN_METRIC = "sglang:dp_mtp_fix_"


def samples(text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def per_rank(text: str, name: str, **match: str) -> dict[str, float]:
    """dp_rank -> the sum of ``name``'s samples whose labels include ``match``."""
    out: dict[str, float] = {}
    for s in samples(text):
        if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
            out[s.labels["dp_rank"]] = out.get(s.labels["dp_rank"], 0) + s.value
    return out


@affected_only
def test_metrics_count_every_decode_batch_of_each_rank_with_sglangs_labels(patched):
    decode = PLUGIN_METRIC + "decode_batches_total"
    ready, end = per_rank(patched.metrics_ready, decode), per_rank(patched.metrics_end, decode)
    assert set(end) == {"0", "1"}, patched.metrics_end[-3000:]
    # What the requests did: 4 prompts at once, then 4 one at a time, 8 new tokens each, <= 3 tokens per MTP round:
    # >= 3 decode rounds per prompt (the first token comes with the PD arrival), and with DP attention every rank
    # takes part in every round (an idle batch where it has no request): >= 15 rounds counted on each rank.
    assert all(end[r] - ready.get(r, 0) >= 3 + 4 * 3 for r in end), (ready, end)
    # The same counters as the stats lines (every STATS_EVERY batches): /metrics has all batches, the lines whole
    # windows.
    windows = {r: STATS_EVERY * sum(m["dp"] == r for m in STATS_LINE.finditer(patched.log)) for r in end}
    assert all(windows[r] <= end[r] < windows[r] + STATS_EVERY for r in end), (windows, end)
    # --disable-cuda-graph: SGLang's generic vote is eager for every batch, and no round was forced eager (no seedless
    # arrival with the fake transfer backend): the series exist and read 0.
    assert per_rank(patched.metrics_end, decode, generic_vote="graph_eligible") == {"0": 0, "1": 0}
    assert per_rank(patched.metrics_end, decode, draft_vote="forced_eager") == {"0": 0, "1": 0}
    forced = PLUGIN_METRIC + "forced_eager_draft_batches_total"
    for cause in ("own_seedless_batch", "other_rank_vote"):
        assert per_rank(patched.metrics_end, forced, cause=cause) == {"0": 0, "1": 0}
    # SGLang's own scheduler labels, per rank (model_name, engine_type, tp_rank, dp_rank, ...), plus the plugin's own
    ours = {tuple(sorted(set(s.labels) - {"generic_vote", "draft_vote"})) for s in samples(patched.metrics_end)
            if s.name == decode}  # fmt: skip
    theirs = {tuple(sorted(s.labels)) for s in samples(patched.metrics_end) if s.name == "sglang:num_running_reqs"}
    assert ours == theirs and len(ours) == 1, (ours, theirs)
    assert f"on SGLang's /metrics as {PLUGIN_METRIC}*" in patched.log


DEFERRED_LINE = re.compile(
    r"^\[[^\]]* (?P<rank>DP\d TP\d)\] sglang-dp-mtp-fix: (?P<patch>\w+) (?P<status>[\w-]+) when (?P<module>\S+) was "
    r"imported: ",
    re.M,
)


@affected_only
def test_metrics_patch_info_is_each_ranks_state_after_model_load(patched):
    """Each rank's report line (at plugin load), updated by the lines of patches applied when their module was
    imported (SGLang's scheduler imports the DSA modules while it builds the model runner, whatever the model)."""
    want = {rank: statuses(line[0]) for rank, line in patched.report_lines().items() if rank != "main"}
    for m in DEFERRED_LINE.finditer(patched.log):
        assert want[m["rank"]][m["patch"]] == "not-loaded", m[0]  # only a patch waiting for its module
        want[m["rank"]][m["patch"]] = m["status"]
    version = {m[1] for m in re.finditer(r"sglang-dp-mtp-fix (\S+) on SGLang ", patched.log)}
    got: dict[str, dict[str, str]] = {}
    for s in samples(patched.metrics_end):
        if s.name == PLUGIN_METRIC + "patch_info":
            assert s.value == 1 and {s.labels["version"]} == version, (s, version)
            rank = f"DP{s.labels['dp_rank']} TP{s.labels['tp_rank']}"
            got.setdefault(rank, {})[s.labels["patch"]] = s.labels["status"]
    assert got == want and len(want) == 2, (got, want)


@off_launch_only
def test_metrics_absent_with_the_plugin_off_and_sglangs_unchanged(patched, probe_off):
    off = probe_off
    assert off.metrics_end is not None and PLUGIN_METRIC not in off.metrics_end
    names = {arm: {s.name for s in samples(launch.metrics_end)} for arm, launch in (("patched", patched), ("off", off))}
    assert names["off"] == {n for n in names["patched"] if not n.startswith(PLUGIN_METRIC)}, names
    assert "sglang:num_running_reqs" in names["off"]


# --- the flight recorder and the MLP-sync transport line (#23) --------------------------------------------------

TRANSPORT_LINE = re.compile(
    r"^\[[^\]]* DP(?P<dp>\d) TP\d\] sglang-dp-mtp-fix: MLP-sync transport: (?P<backend>gloo|nccl) on "
    r"(?P<group>the TP CPU group|the TP device group) "
    r"\(size 2, group rank (?P<grank>\d), global rank (?P<rank>\d)\); overlap (?P<overlap>on|off); MLP gather "
    r"target=(?P<target>True|False) draft=(?P<draft>True|False); draft-graph vote active$",
    re.M,
)


@affected_only
def test_recorder_files_of_both_ranks_while_running_and_rollcall_agrees_with_the_counters(patched):
    live = patched.live
    data = live["data"]
    assert live["server_alive"] and sorted(live["alive"]) == [0, 1], live  # read while the schedulers ran
    assert live["code"] == 0 and data["verdict"] == "agree" and not data["refused"], data
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and not data["missing_ranks"], data["ranks"]
    # What the counters saw, rank by rank: every decode/idle batch the vote counted has its record (the ring holds
    # them all here: far fewer than 256 rounds).
    decode = per_rank(patched.metrics_end, PLUGIN_METRIC + "decode_batches_total")
    for rank in data["ranks"]:
        assert rank["records"] < 256 and rank["skipped"] == 0, rank
        assert rank["decode_or_idle_records"] == decode[str(rank["rank"])], (rank, decode)
        assert rank["entered_round"] >= rank["last_round"] >= rank["records"] > 15, rank
    assert data["answer"].startswith("all 2 ranks agreed up to round "), data["answer"]
    # The files stay readable after the launch was stopped (SIGTERM, then SIGKILL to the group): the same records and
    # agreement, and the heartbeats read first name both ranks as stopped (dead), so the answer is exit 1, not "agree".
    from sglang_dp_mtp_fix import rollcall

    after, code = rollcall.rollcall([live["dir"]])
    assert [r["records"] for r in after["ranks"]] == [r["records"] for r in data["ranks"]], after
    assert code == 1 and after["verdict"] == "stopped" and after["stopped_ranks"] == [0, 1], after
    assert [r["process"] for r in after["ranks"]] == ["dead", "dead"] and "divergence" not in after, after


@affected_only
def test_transport_line_once_in_every_schedulers_log(patched):
    lines = list(TRANSPORT_LINE.finditer(patched.log))
    assert sorted((m["dp"], m["grank"]) for m in lines) == [("0", "0"), ("1", "1")], patched.log[-4000:]
    for m in lines:
        # On CPU both of the TP group's groups are gloo; SGLang gathers over its CPU group when overlap is on.
        assert m["backend"] == "gloo" and (m["group"] == "the TP CPU group") == (m["overlap"] == "on"), m[0]


# --- b. no harm --------------------------------------------------------------------------------------------------


@no_harm_only
def test_b_token_identical_with_the_plugin_not_selected(no_harm):
    ids = {arm: [o["output_ids"] for o in launch.sequential] for arm, launch in no_harm.items()}
    assert len({str(v) for v in ids.values()}) == 1, ids
    assert len({str(o) for o in ids["patched"]}) > 1  # distinct prompts give distinct completions: a real comparison
    assert len(ids["patched"]) == len(PROMPTS)
    assert {o["meta_info"]["dp_rank"] for o in no_harm["patched"].sequential} == {0, 1}  # both ranks compared
    for launch in no_harm.values():
        assert_served(launch)
    assert "draft_graph_vote=applied" in no_harm["patched"].log  # the arms are what they say


@no_harm_only
def test_b_not_selected_means_not_loaded(no_harm):
    # The matcher is live: it finds the plugin in the arm that loads it, so its silence below means something.
    assert PLUGIN_OUTPUT.search(no_harm["patched"].log)
    not_selected = no_harm["not selected"]
    found = PLUGIN_OUTPUT.findall(not_selected.log)
    assert not found and not not_selected.report_files(), found


# --- e. kill switch for the whole launch -------------------------------------------------------------------------


@off_launch_only
def test_e_off_leaves_sglang_stock_and_every_process_says_so(probe_off):
    off = probe_off
    lines = assert_one_line_per_process(off, "(mode=off): SGLANG_DP_MTP_FIX=off here, SGLang left fully stock: ")
    for line in lines.values():
        assert set(statuses(line).values()) == {"disabled"}, line
    # nothing hooked: no check, and no stats line although the launch asks for them (SGLANG_DP_MTP_FIX_STATS)
    assert "cross-rank patch-state check" not in off.log and not STATS_LINE.search(off.log)
    # serves: every request of c's phases got exactly its tokens, from the DP rank it was routed to
    for rid, rank, n in (req for phase in PHASES for req in phase):
        meta = off.outputs[rid]["meta_info"]
        assert meta["completion_tokens"] == len(off.outputs[rid]["output_ids"]) == n and meta["dp_rank"] == rank, meta
    assert "Traceback" not in off.log, off.log[-4000:]


# --- f. superseded / not affected --------------------------------------------------------------------------------


@stand_down_only
def test_f_stands_down_with_one_visible_line_and_serves(standing_down):
    want = "not-affected" if SGLANG_VERSION == "0.5.15" else "superseded"
    # Where SGLang votes the draft graph itself, the watch on its vote applies (upstream_vote_watch); nothing fixes
    watch = "not-affected" if want == "not-affected" else "applied"
    lines = assert_one_line_per_process(standing_down, "(mode=auto): ")
    for line in lines.values():
        got = statuses(line)
        assert got.pop("upstream_vote_watch") == watch, line
        assert got.pop("arrival_seed") == "disabled", line  # an opt-in setting, off by default, on every release
        assert got["draft_graph_vote"] == want and set(got.values()) <= {want, "not-affected"}, line
    passed = {m["dp"] for m in PEER_PASSED.finditer(standing_down.log)}
    # the ranks compare what they applied (the watch) or, with nothing applied, nothing at all
    assert passed == ({"0", "1"} if watch == "applied" else set()), standing_down.log[-4000:]
    transport = re.findall(r"draft-graph vote (.*)$", standing_down.log, re.M)
    assert transport == (["SGLang's own (upstream)"] * 2 if watch == "applied" else []), transport
    assert_served(standing_down)
