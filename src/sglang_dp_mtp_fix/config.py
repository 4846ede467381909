"""Configuration, read once per process at plugin load (never on a hot path).

``SGLANG_DP_MTP_FIX``       auto (default) | off (kill switch; SGLang's false spellings accepted) | strict
``SGLANG_DP_MTP_FIX_SKIP``  comma-separated patch ids to leave out (unknown ids are an error)
``SGLANG_DP_MTP_FIX_STATS`` log vote counters every N decode batches (unset/empty/0: off)
``SGLANG_DP_MTP_FIX_PEER_TIMEOUT`` seconds the start-up cross-rank check waits for every rank (1-3600, default 120)
``SGLANG_DP_MTP_FIX_REPORT_DIR`` an existing directory (absolute path) to write one report file per process into
``SGLANG_DP_MTP_FIX_RECORDER_DIR`` an existing directory (absolute path) for one decision flight-recorder file per
                            patched scheduler (``recorder``; unset: nothing recorded, the vote path carries no code)
``SGLANG_DP_MTP_FIX_METRICS`` auto (default: vote counters on SGLang's /metrics when it runs with --enable-metrics)
                            | off (SGLang's false spellings accepted)
``SGLANG_DP_MTP_FIX_ARRIVAL_SEED`` off (default; SGLang's false spellings accepted) | exact | recent: a seedless PD
                            arrival gets a DSA top-k seed (``arrival_seed``): ``exact`` where the prompt fits
                            ``index_topk`` (the true seed), ``recent`` that and the most recent positions beyond

A bad value is never guessed at: it raises :class:`ConfigError` naming the variable and the accepted values, and the
plugin leaves SGLang stock (``auto``) or stops the process (``strict``). A variable named like these that the plugin
does not know (``SGLANG_DP_MTP_FIX_MODE=off``: the kill switch is ``SGLANG_DP_MTP_FIX=off``) is one WARNING line at
load naming the closest known name (``auto``; the rest applies as read), a configuration error in ``strict``.
"""

from __future__ import annotations

import difflib
import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sglang_dp_mtp_fix.errors import ConfigError

MODE_ENV = "SGLANG_DP_MTP_FIX"
SKIP_ENV = "SGLANG_DP_MTP_FIX_SKIP"
STATS_ENV = "SGLANG_DP_MTP_FIX_STATS"
PEER_TIMEOUT_ENV = "SGLANG_DP_MTP_FIX_PEER_TIMEOUT"
REPORT_DIR_ENV = "SGLANG_DP_MTP_FIX_REPORT_DIR"
METRICS_ENV = "SGLANG_DP_MTP_FIX_METRICS"
RECORDER_DIR_ENV = "SGLANG_DP_MTP_FIX_RECORDER_DIR"
STALL_ENV = "SGLANG_DP_MTP_FIX_STALL_S"
ARRIVAL_SEED_ENV = "SGLANG_DP_MTP_FIX_ARRIVAL_SEED"
# Below SGLang's own watchdog (--watchdog-timeout, 300 s by default), above any sane forward of one batch
DEFAULT_STALL_S = 60.0
MAX_STALL_S = 86400.0
# SGLang's launcher sets this before it starts the schedulers exactly when it runs with --enable-metrics
# (``set_prometheus_multiproc_dir``); a scheduler therefore knows at plugin load whether metrics are on.
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
DEFAULT_PEER_TIMEOUT_S = 120.0
MIN_PEER_TIMEOUT_S = 1.0  # every rank publishes over a TCP store: below a second the check only times out
MAX_PEER_TIMEOUT_S = 3600.0

# Every variable of the plugin's configuration (``doctor`` shows each with its value) ...
CONFIG_NAMES = (
    MODE_ENV,
    SKIP_ENV,
    STATS_ENV,
    PEER_TIMEOUT_ENV,
    REPORT_DIR_ENV,
    RECORDER_DIR_ENV,
    STALL_ENV,
    METRICS_ENV,
    ARRIVAL_SEED_ENV,
)
# ... and the other names of the prefix: the CPU harness (simulate, tests) and the development scripts (tools/). Any
# other name that starts with the prefix is a misspelling: named, with the closest known name, never silently ignored.
OTHER_NAMES = (
    "SGLANG_DP_MTP_FIX_HARNESS_START", "SGLANG_DP_MTP_FIX_HARNESS_EXTENSION", "SGLANG_DP_MTP_FIX_HARNESS_DEVICE_GROUP",
    "SGLANG_DP_MTP_FIX_PORTS", "SGLANG_DP_MTP_FIX_VENVS", "SGLANG_DP_MTP_FIX_TEST_OUT", "SGLANG_DP_MTP_FIX_CI_PHASE",
    "SGLANG_DP_MTP_FIX_CI_LIMIT_S",
)  # fmt: skip

# SGLang's own boolean parsing (sglang.srt.utils.get_bool_env_var / envs) treats these as false.
_FALSE_SPELLINGS = frozenset({"off", "0", "false", "no", "n", "f", "disable", "disabled"})
_MAX_VALUE_LEN = 4096


class ArrivalSeed(str, enum.Enum):
    """What a seedless PD arrival gets (``arrival_seed``)."""

    OFF = "off"  # nothing: the request stays seedless, its draft step eager (the draft vote keeps the group together)
    EXACT = "exact"  # the true seed where the prompt fits index_topk; longer prompts stay seedless
    RECENT = "recent"  # EXACT, and the most recent index_topk positions as a stand-in for longer prompts


class Mode(str, enum.Enum):
    AUTO = "auto"
    OFF = "off"
    STRICT = "strict"


def kill_switch_reason() -> str:
    """Why every patch is ``disabled`` under the kill switch."""
    return f"kill switch {MODE_ENV}=off"


def skip_reason(named: Sequence[str], group: Sequence[str]) -> str:
    """Why the patches of ``group`` are ``disabled`` when the skip list names ``named`` of them."""
    if len(group) > 1:
        return f"skipped by {SKIP_ENV} ({', '.join(named)}); its group {'+'.join(group)} applies together or not at all"
    return f"skipped by {SKIP_ENV}"


def bad_configuration_reason(error: str) -> str:
    """Why every patch stays stock when the configuration could not be parsed."""
    return f"not applied: bad configuration: {error}"


@dataclass(frozen=True)
class Config:
    mode: Mode = Mode.AUTO
    skip: frozenset[str] = frozenset()
    stats_every: int | None = None
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    report_dir: str | None = None  # None: the plugin writes no file at all
    # Count votes for SGLang's Prometheus endpoint (decided at load, like stats_every): SGLang runs with
    # --enable-metrics and SGLANG_DP_MTP_FIX_METRICS is not off.
    export_metrics: bool = False
    recorder_dir: str | None = None  # None: no flight recorder (decided at load, like the counters)
    stall_s: float | None = DEFAULT_STALL_S  # None: no stall line (SGLANG_DP_MTP_FIX_STALL_S=off)
    arrival_seed: ArrivalSeed = ArrivalSeed.OFF  # what a seedless PD arrival gets (arrival_seed); ranks must agree
    # (name, closest known name or None) of each SGLANG_DP_MTP_FIX* variable the plugin does not know: one WARNING at
    # load (auto: the rest applies as read), a configuration error in strict
    unknown: tuple[tuple[str, str | None], ...] = ()
    # Set when the config could not be parsed: the plugin then stays stock (auto) or stops (strict).
    error: str | None = None

    @property
    def strict(self) -> bool:
        return self.mode is Mode.STRICT


def _clean(name: str, raw: str) -> str:
    if len(raw) > _MAX_VALUE_LEN:
        raise ConfigError(f"{name} is {len(raw)} characters long (limit {_MAX_VALUE_LEN}); refusing to parse it")
    if not raw.isascii() or not raw.isprintable():
        raise ConfigError(f"{name}={raw!r} contains non-ASCII or control characters")
    return raw.strip()


def parse_mode(raw: str | None) -> Mode:
    if raw is None:
        return Mode.AUTO
    value = _clean(MODE_ENV, raw).lower()
    if value == "":
        return Mode.AUTO  # set-but-empty (common in templated manifests) means "not set"
    if value in _FALSE_SPELLINGS:
        return Mode.OFF
    if value in (Mode.AUTO.value, Mode.STRICT.value):
        return Mode(value)
    raise ConfigError(
        f"{MODE_ENV}={raw!r} is not understood; accepted values: auto (default), strict, "
        f"off (or {', '.join(sorted(_FALSE_SPELLINGS - {'off'}))})"
    )


def parse_skip(raw: str | None, known_ids: Iterable[str]) -> frozenset[str]:
    if raw is None:
        return frozenset()
    value = _clean(SKIP_ENV, raw)
    known = sorted(known_ids)
    ids = [part.strip() for part in value.split(",")]
    ids = [i for i in ids if i]
    unknown = sorted({i for i in ids if i not in known})
    if unknown:
        raise ConfigError(f"{SKIP_ENV} names unknown patch id(s) {listed(unknown)}; known ids: {', '.join(known)}")
    return frozenset(ids)


def parse_stats(raw: str | None) -> int | None:
    if raw is None:
        return None
    value = _clean(STATS_ENV, raw)
    if value in ("", "0"):
        return None
    if not value.isdigit() or int(value) > 10_000_000:
        raise ConfigError(
            f"{STATS_ENV}={raw!r} is not a batch count; accepted values: an integer 1..10000000, or 0/empty (off)"
        )
    return int(value)


def parse_peer_timeout(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_PEER_TIMEOUT_S
    value = _clean(PEER_TIMEOUT_ENV, raw)
    if value == "":
        return DEFAULT_PEER_TIMEOUT_S
    digits = value.replace(".", "", 1)
    # Plain decimal only ("1e3", "inf", "nan", "-5" are refused): 0 would disable the check, so it is refused too.
    seconds = float(value) if digits.isdigit() else 0.0
    if not MIN_PEER_TIMEOUT_S <= seconds <= MAX_PEER_TIMEOUT_S:
        raise ConfigError(
            f"{PEER_TIMEOUT_ENV}={raw!r} is not a timeout; accepted values: seconds as a plain decimal number from "
            f"{MIN_PEER_TIMEOUT_S:g} to {MAX_PEER_TIMEOUT_S:g} (default {DEFAULT_PEER_TIMEOUT_S:g}), or empty (default)"
        )
    return seconds


def parse_stall(raw: str | None) -> float | None:
    value = "" if raw is None else _clean(STALL_ENV, raw).lower()
    if value == "":
        return DEFAULT_STALL_S
    if value == "off":
        return None
    digits = value.replace(".", "", 1)
    seconds = float(value) if digits.isdigit() else 0.0  # plain decimal only ("1e3", "inf", "-5" refused)
    if not 1 <= seconds <= MAX_STALL_S:
        raise ConfigError(
            f"{STALL_ENV}={raw!r} is not understood; accepted values: seconds as a plain decimal number from 1 to "
            f"{MAX_STALL_S:g} (default {DEFAULT_STALL_S:g}, below SGLang's watchdog), off, or empty (default)"
        )
    return seconds


def parse_report_dir(raw: str | None, name: str = REPORT_DIR_ENV) -> str | None:
    if raw is None:
        return None
    value = _clean(name, raw)
    if value == "":
        return None
    # Relative paths would depend on each process's working directory: refused rather than guessed.
    if not os.path.isabs(value):
        raise ConfigError(f"{name}={raw!r} is not an absolute path; accepted values: an absolute path, or empty")
    return value


def parse_metrics(raw: str | None) -> bool:
    """True unless switched off; whether SGLang's metrics are on is the caller's other half."""
    if raw is None:
        return True
    value = _clean(METRICS_ENV, raw).lower()
    if value in ("", "auto"):
        return True
    if value in _FALSE_SPELLINGS:
        return False
    raise ConfigError(
        f"{METRICS_ENV}={raw!r} is not understood; accepted values: auto (default; on when SGLang runs with "
        f"--enable-metrics), off (or one of SGLang's false spellings: {', '.join(sorted(_FALSE_SPELLINGS))})"
    )


def parse_arrival_seed(raw: str | None) -> ArrivalSeed:
    value = "" if raw is None else _clean(ARRIVAL_SEED_ENV, raw).lower()
    if value == "" or value in _FALSE_SPELLINGS:
        return ArrivalSeed.OFF
    if value in (ArrivalSeed.EXACT.value, ArrivalSeed.RECENT.value):
        return ArrivalSeed(value)
    raise ConfigError(
        f"{ARRIVAL_SEED_ENV}={raw!r} is not understood; accepted values: off (default, or empty, or one of SGLang's "
        f"false spellings: {', '.join(sorted(_FALSE_SPELLINGS - {'off'}))}), exact (the true seed where the prompt "
        "fits index_topk), recent (exact, and the most recent index_topk positions beyond)"
    )


def settings(config: Config) -> dict[str, str]:
    """The settings every rank of a group must share, by variable (the report line and the cross-rank check)."""
    return {ARRIVAL_SEED_ENV: config.arrival_seed.value}


def _spelled_as_ours(name: str) -> str:
    """A name as the plugin's variables are spelled: upper case, underscores (``Sglang-Dp-Mtp-Fix`` reads as
    ``SGLANG_DP_MTP_FIX``), so that a kill switch misspelt by case or separators is named, not ignored."""
    return name.upper().replace("-", "_")


def unknown_variables(environ: Mapping[str, str]) -> tuple[tuple[str, str | None], ...]:
    """The variables named like the plugin's that it does not know, each with the closest configuration name."""
    known = set(CONFIG_NAMES) | set(OTHER_NAMES)
    found = sorted(n for n in environ if _spelled_as_ours(n).startswith(MODE_ENV) and n not in known)
    return tuple(
        (n, next(iter(difflib.get_close_matches(_spelled_as_ours(n), CONFIG_NAMES, n=1, cutoff=0.6)), None))
        for n in found
    )


LISTED = 5  # names shown in one line; the rest are counted (a 2 MB value made a 2 MB line)
NAME_WIDTH = 64  # characters of one name shown


def listed(names: Sequence[str]) -> str:
    """Names for one line: at most LISTED, each cut to NAME_WIDTH characters, the rest counted."""
    shown = [n if len(n) <= NAME_WIDTH else f"{n[:NAME_WIDTH]}...({len(n)} characters)" for n in names[:LISTED]]
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(shown) + more


def unknown_line(unknown: Sequence[tuple[str, str | None]]) -> str:
    """One line for every unknown variable (the load's WARNING, doctor, strict's error)."""
    parts = [f"{name} ({f'did you mean {close}?' if close else 'no such variable'})" for name, close in unknown]
    return (
        f"unknown variable(s) ignored: {listed(parts)}; the variables are {', '.join(CONFIG_NAMES)} "
        f"({MODE_ENV}=off is the kill switch)"
    )


def load_config(known_ids: Iterable[str], environ: Mapping[str, str] | None = None) -> Config:
    """Parse the environment. Never raises: a bad value yields ``Config(error=...)``.

    If the mode itself is unparseable the mode is reported as ``auto`` with ``error`` set; the caller stays stock.
    A strict mode with a bad skip list still stops the process (the caller checks ``strict`` and ``error``).
    """
    env = os.environ if environ is None else environ
    unknown = unknown_variables(env)
    try:
        mode = parse_mode(env.get(MODE_ENV))
    except ConfigError as exc:
        return Config(mode=Mode.AUTO, error=str(exc), unknown=unknown)
    try:
        if unknown and mode is Mode.STRICT:
            raise ConfigError(unknown_line(unknown))
        skip = parse_skip(env.get(SKIP_ENV), known_ids)
        stats_every = parse_stats(env.get(STATS_ENV))
        peer_timeout_s = parse_peer_timeout(env.get(PEER_TIMEOUT_ENV))
        report_dir = parse_report_dir(env.get(REPORT_DIR_ENV))
        export_metrics = parse_metrics(env.get(METRICS_ENV)) and bool(env.get(PROMETHEUS_DIR_ENV))
        recorder_dir = parse_report_dir(env.get(RECORDER_DIR_ENV), RECORDER_DIR_ENV)
        stall_s = parse_stall(env.get(STALL_ENV))
        arrival_seed = parse_arrival_seed(env.get(ARRIVAL_SEED_ENV))
    except ConfigError as exc:
        return Config(mode=mode, error=str(exc), unknown=unknown)
    return Config(
        unknown=unknown,
        mode=mode,
        skip=skip,
        stats_every=stats_every,
        peer_timeout_s=peer_timeout_s,
        report_dir=report_dir,
        export_metrics=export_metrics,
        recorder_dir=recorder_dir,
        stall_s=stall_s,
        arrival_seed=arrival_seed,
    )
