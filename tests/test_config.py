"""Configuration parsing: every accepted spelling, every refused value (table-driven)."""

from __future__ import annotations

import pytest

from sglang_dp_mtp_fix.config import (
    ARRIVAL_SEED_ENV,
    MODE_ENV,
    PEER_TIMEOUT_ENV,
    REPORT_DIR_ENV,
    SKIP_ENV,
    ArrivalSeed,
    Mode,
    load_config,
    parse_arrival_seed,
    parse_mode,
    parse_peer_timeout,
    parse_report_dir,
    parse_skip,
    unknown_variables,
)
from sglang_dp_mtp_fix.errors import ConfigError

IDS = ("future_seed_authority", "eager_draft_gate", "draft_graph_vote")


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        (None, Mode.AUTO), ("", Mode.AUTO), ("  ", Mode.AUTO), ("auto", Mode.AUTO), ("AUTO", Mode.AUTO),
        (" strict ", Mode.STRICT), ("Strict", Mode.STRICT), ("off", Mode.OFF), ("0", Mode.OFF),
        ("false", Mode.OFF), ("False", Mode.OFF), ("no", Mode.OFF), ("n", Mode.OFF), ("disabled", Mode.OFF),
    ],
)  # fmt: skip
def test_accepted_modes(raw, mode):
    assert parse_mode(raw) is mode


@pytest.mark.parametrize("raw", ["on", "1", "true", "yes", "auto,strict", "strict!", "ａｕｔｏ", "auto\n", "x" * 5000])
def test_refused_modes_name_the_variable_and_accepted_values(raw):
    with pytest.raises(ConfigError) as exc:
        parse_mode(raw)
    message = str(exc.value)
    assert MODE_ENV in message
    if len(raw) < 100 and raw.isascii() and raw.isprintable():
        assert "auto" in message and "strict" in message and "off" in message


@pytest.mark.parametrize(
    ("raw", "skip"),
    [
        (None, set()), ("", set()), (" , ", set()), ("draft_graph_vote", {"draft_graph_vote"}),
        (" eager_draft_gate , draft_graph_vote ", {"eager_draft_gate", "draft_graph_vote"}),
        ("draft_graph_vote,draft_graph_vote", {"draft_graph_vote"}),
    ],
)  # fmt: skip
def test_skip_lists(raw, skip):
    assert parse_skip(raw, IDS) == skip


@pytest.mark.parametrize("raw", ["nope", "draft_graph_vote,nope", "DRAFT_GRAPH_VOTE", "dräft", "a" * 5000])
def test_unknown_skip_ids_are_errors(raw):
    with pytest.raises(ConfigError) as exc:
        parse_skip(raw, IDS)
    assert SKIP_ENV in str(exc.value)


def test_load_config_never_raises_and_reports_the_error():
    cfg = load_config(IDS, {MODE_ENV: "maybe"})
    assert cfg.error and MODE_ENV in cfg.error and cfg.mode is Mode.AUTO
    cfg = load_config(IDS, {MODE_ENV: "strict", SKIP_ENV: "bogus"})
    assert cfg.strict and cfg.error and "bogus" in cfg.error
    cfg = load_config(IDS, {MODE_ENV: "off", SKIP_ENV: "draft_graph_vote"})
    assert cfg.mode is Mode.OFF and cfg.error is None and cfg.skip == {"draft_graph_vote"}


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [(None, 120.0), ("", 120.0), (" 30 ", 30.0), ("2.5", 2.5), ("1", 1.0), ("3600", 3600.0)],
)
def test_peer_timeouts(raw, seconds):
    assert parse_peer_timeout(raw) == seconds


@pytest.mark.parametrize(
    "raw", ["0", "0.0", "-5", "3601", "1e3", "inf", "nan", "5s", "1.2.3", ".", "٣", "0.0000001", ".5", "0.999"]
)  # 1e-7 s and anything under a second: before, accepted (the check could only time out)
def test_refused_peer_timeouts_name_the_variable(raw):
    with pytest.raises(ConfigError) as exc:
        parse_peer_timeout(raw)
    assert PEER_TIMEOUT_ENV in str(exc.value)
    assert load_config(IDS, {PEER_TIMEOUT_ENV: raw}).error


@pytest.mark.parametrize(("raw", "path"), [(None, None), ("", None), ("  ", None), ("/var/log/x", "/var/log/x")])
def test_report_dirs(raw, path):
    assert parse_report_dir(raw) == path


@pytest.mark.parametrize("raw", ["reports", "./reports", "~/reports", "/tmp/\x01", "/tmp/ä"])
def test_refused_report_dirs_name_the_variable(raw):
    with pytest.raises(ConfigError) as exc:
        parse_report_dir(raw)
    assert REPORT_DIR_ENV in str(exc.value)


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("SGLANG_DP_MTP_FIX_MODE", MODE_ENV), ("SGLANG_DP_MTP_FIX_SKIPS", SKIP_ENV),
        ("SGLANG_DP_MTP_FIX_RECORDER", "SGLANG_DP_MTP_FIX_RECORDER_DIR"),
        ("SGLANG_DP_MTP_FIX_STALL", "SGLANG_DP_MTP_FIX_STALL_S"),
        ("SGLANG_DP_MTP_FIXES", MODE_ENV), ("SGLANG_DP_MTP_FIX_ZZZZZZZZZZZZZZZZZZZZZZZ", None),
        # the kill switch misspelt by case or separators (an orchestrator's env, a .env file): named, not ignored
        ("Sglang_Dp_Mtp_Fix", MODE_ENV), ("SGLANG-DP-MTP-FIX", MODE_ENV), ("sglang_dp_mtp_fix_skip", SKIP_ENV),
    ],
)  # fmt: skip
def test_unknown_variables_are_named_with_the_closest_known_name(name, closest):
    env = {name: "off", MODE_ENV: "auto", SKIP_ENV: "", "SGLANG_DP_MTP_FIX_PORTS": "1-2", "SGLANG_OTHER": "x"}
    assert unknown_variables(env) == ((name, closest),)
    cfg = load_config(IDS, env)
    assert cfg.error is None and cfg.unknown == ((name, closest),) and cfg.mode is Mode.AUTO
    strict = load_config(IDS, {**env, MODE_ENV: "strict"})
    assert strict.error and name in strict.error and "unknown variable" in strict.error


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, ArrivalSeed.OFF), ("", ArrivalSeed.OFF), ("off", ArrivalSeed.OFF), ("0", ArrivalSeed.OFF),
        ("False", ArrivalSeed.OFF), (" exact ", ArrivalSeed.EXACT), ("EXACT", ArrivalSeed.EXACT),
        ("recent", ArrivalSeed.RECENT),
    ],
)  # fmt: skip
def test_arrival_seed_values(raw, want):
    assert parse_arrival_seed(raw) is want
    env = {} if raw is None else {ARRIVAL_SEED_ENV: raw}
    config = load_config(IDS, env)
    assert config.error is None and config.arrival_seed is want


@pytest.mark.parametrize("raw", ["on", "1", "true", "exact,recent", "recency", "ｅｘａｃｔ", "x" * 5000])
def test_a_bad_arrival_seed_is_a_configuration_error_never_a_silent_off(raw):
    with pytest.raises(ConfigError) as exc:
        parse_arrival_seed(raw)
    message = str(exc.value)
    assert ARRIVAL_SEED_ENV in message
    if len(raw) < 100 and raw.isascii():
        assert "off" in message and "exact" in message and "recent" in message
    config = load_config(IDS, {ARRIVAL_SEED_ENV: raw})
    assert config.error is not None and ARRIVAL_SEED_ENV in config.error  # the plugin then stays stock (or stops)


def test_a_huge_value_or_many_unknown_names_make_a_line_of_bounded_length():
    """Issue 54 (lower-harm): a 2 MB skip list, or thousands of misspelt variables, made one line of 2 MB."""
    from sglang_dp_mtp_fix.config import SKIP_ENV, load_config

    many = ",".join(f"p{i}" for i in range(600))  # under the value's own limit of 4096 characters
    error = load_config(["a_patch"], {SKIP_ENV: many}).error or ""
    assert "and 595 more" in error and len(error) < 1_000, len(error)
    names = {f"SGLANG_DP_MTP_FIX_X{i}": "1" for i in range(4_999)} | {"SGLANG_DP_MTP_FIX_" + "Y" * 2_000_000: "1"}
    config = load_config(["a_patch"], names)
    assert len(config.unknown) == 5_000
    from sglang_dp_mtp_fix.config import unknown_line

    line = unknown_line(config.unknown)
    assert "and 4995 more" in line and len(line) < 2_000, len(line)
