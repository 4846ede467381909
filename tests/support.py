"""What test modules import: the skip markers, the expected outcome per patch on the release under test, and the
pristine-process runners. Every test runs against the REAL, unmodified SGLang release installed in its venv
(``tools/mkvenv.sh`` builds one venv per release; ``tools/test-matrix.sh`` runs the suite in each). Fixtures and
hooks live in the conftests; the release lists in ``releases``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from releases import AFFECTED, LOCAL_ROWS_AFFECTED, RELEASE_FREE, SGLANG_VERSION, SUPERSEDED, runs_on

requires_sglang = pytest.mark.skipif(SGLANG_VERSION is None, reason="SGLang is not installed in this venv")
release_free = pytest.mark.skipif(
    SGLANG_VERSION is not None and SGLANG_VERSION not in RELEASE_FREE, reason=runs_on(RELEASE_FREE)
)  # slow tests of code that reads no SGLang: one release (and any venv without SGLang)
affected_only = pytest.mark.skipif(SGLANG_VERSION not in AFFECTED, reason=f"SGLang {SGLANG_VERSION} is not patched")


def load_scaled_timeout(base_s: float, per_load_s: float = 3.0, most_s: float = 60) -> int:
    """A timeout for a wait whose length the test does not assert on (a peer that is up publishes within it): ``base_s``
    plus ``per_load_s`` per unit of run-queue length per core (``os.getloadavg``), read when the test starts, at most
    ``most_s`` (the harness waits 120 s for an answer). On two idle cores 2 s was enough and flaked under load; at the
    load this host sees with other runs beside it (10-60) it grows to tens of seconds."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return int(min(base_s + per_load_s * load, most_s) + 0.5)


def written(directory: str, ranks: int, rounds: int, timeout: float = 30) -> None:
    """Until ``ranks`` recorder files in ``directory`` hold round ``rounds`` as their last: the monitor thread writes
    each ring out once a heartbeat (issue 45), so a file lags its process by up to a second."""
    import time

    from sglang_dp_mtp_fix.diagnosis import reader

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [reader.read_file(p) for p in reader.files_in(directory)]
        if len(got) == ranks and all(f.entered >= rounds and f.last_round == rounds for f in got):
            return
        time.sleep(0.1)
    raise AssertionError(f"{ranks} files holding round {rounds} not written within {timeout} s")


def expected_status() -> str:
    if SGLANG_VERSION in AFFECTED:
        return "applied"
    if SGLANG_VERSION in SUPERSEDED:
        return "superseded"
    return "not-affected"


VOTE_GROUP = ("future_seed_authority", "eager_draft_gate", "draft_graph_vote", "draft_token_counts")

# Applied when their module is imported (post-import hook).
DEFERRED = ("dsa_idle_index", "dsa_trtllm_trim", "dsa_decode_trim")
DSA_MODULES = ("sglang.srt.layers.attention.dsa_backend", "sglang.srt.layers.attention.dsa.dsa_indexer")
# draft_local_rows is deferred too, until the scheduler imports model_runner to build its ModelRunner.
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"


def expected_statuses(dsa_imported: bool = True, model_runner_imported: bool | None = None) -> dict[str, str]:
    """Per patch id, the outcome on this release (docs/compatibility.md).

    ``dsa_imported``: the DSA modules were imported in that process (as in every scheduler that loads a model:
    SGLang's model registry imports them; the test session imports them at start, see the root conftest). In a fresh
    process that has not imported them, an affected release reports the DSA patches ``not-loaded``.
    ``model_runner_imported`` (default: same as ``dsa_imported``): likewise for ``draft_local_rows`` where it applies
    (0.5.16-0.5.18)."""
    from sglang_dp_mtp_fix.patches import PATCH_IDS

    group = expected_status()
    per_patch = {pid: group for pid in PATCH_IDS}
    per_patch["draft_local_rows"] = "applied" if SGLANG_VERSION in LOCAL_ROWS_AFFECTED else "not-affected"
    # The watch on SGLang's own draft vote: where the vote group is superseded; the plugin's vote carries it elsewhere.
    per_patch["upstream_vote_watch"] = "applied" if SGLANG_VERSION in SUPERSEDED else "not-affected"
    # An opt-in setting whose default is off (SGLANG_DP_MTP_FIX_ARRIVAL_SEED): disabled wherever it is not set.
    per_patch["arrival_seed"] = "disabled"
    if not dsa_imported and group == "applied":
        per_patch.update({pid: "not-loaded" for pid in DEFERRED})
    runner_imported = dsa_imported if model_runner_imported is None else model_runner_imported
    if not runner_imported and per_patch["draft_local_rows"] == "applied":
        per_patch["draft_local_rows"] = "not-loaded"
    return {pid: per_patch[pid] for pid in PATCH_IDS}


def run_python(
    code: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    fresh: bool = False,
    drop_prefixes: tuple[str, ...] = ("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS"),
) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c`` in a pristine process of this venv: this test process's environment without the
    plugin's variables (or whatever ``drop_prefixes`` names), plus ``env``.

    Default: a child forked from the pristine forkserver (SGLang's scheduler modules imported, as in a scheduler
    process when SGLang calls ``load_plugins()``; the plugin not loaded), so each case does not pay SGLang's import.
    ``fresh=True``: a new interpreter, for the cases whose subject is import order itself (the plugin loaded before
    any scheduler module, as in the launcher process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    full_env.update(env or {})
    cwd = os.path.dirname(__file__)
    if fresh:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
    return _run_forked(textwrap.dedent(code), full_env, cwd, timeout)


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The console script's ``main(args)`` in a pristine forked process, with every ``SGLANG_*`` variable of this
    process dropped (as an operator's clean shell would have them): the same code path as the installed script."""
    code = f"import sys\nfrom sglang_dp_mtp_fix.cli import main\nsys.exit(main({list(args)!r}))\n"
    return run_python(code, env, timeout=timeout, drop_prefixes=("SGLANG_",))


def _run_forked(code: str, env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    import tempfile

    import pristine

    from sglang_dp_mtp_fix.harness.pool import pristine_context

    with tempfile.TemporaryDirectory(prefix="pristine-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = pristine_context().Process(target=pristine.run_code, args=(code, env, cwd, out, err))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join(30)
            raise subprocess.TimeoutExpired(["<pristine child>", "-c", code], timeout)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    return subprocess.CompletedProcess(["<pristine child>", "-c", code], child.exitcode, stdout, stderr)


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout}")
