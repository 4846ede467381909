"""The plugin in a real SGLang server on CPU, as a user sees it (``tools/launch-demo.sh``): the launch tier's shape
(DP attention tp 2 / dp 2, PD decode with the fake transfer backend, NEXTN MTP, dummy weights, the tier's named CPU
stand-ins, 127.0.0.1 only), a few greedy requests at once, each process's sglang-dp-mtp-fix lines, the completions;
the server's whole process group is stopped at the end, whatever happens. Extra environment passes through (e.g.
SGLANG_DP_MTP_FIX=off, SGLANG_DP_MTP_FIX_STATS=4)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "launch"))

from launchlib import PROMPTS, SGLANG_VERSION, base_env, gaps_pythonpath, start_server  # noqa: E402


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="launch-demo-"))
    env = base_env(gaps_pythonpath(work / "entry-points"))
    env.update({k: v for k, v in os.environ.items() if k.startswith(("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS"))})
    env.setdefault("SGLANG_DP_MTP_FIX_STATS", "4")
    server = start_server("demo", work, env)
    print(f"SGLang {SGLANG_VERSION} on CPU, 127.0.0.1:{server.port}, log {server.log_path}", flush=True)
    try:
        t0 = time.monotonic()
        if not server.wait_ready():
            print(server.log[-3000:])
            print("the server did not become ready")
            return 1
        print(f"ready in {time.monotonic() - t0:.0f} s")
        print(
            "--- completions (greedy, 8 tokens; bootstrap_host 2.2.2.2 is SGLang's fake-transfer marker, "
            "never contacted)"
        )
        for k, out in enumerate(server.generate_all(PROMPTS), 1):
            print(f"request {k}: DP rank {out['meta_info'].get('dp_rank')}, output_ids {out['output_ids']}")
        time.sleep(1.0)
        log = server.log
    finally:
        server.stop()
    print("--- sglang-dp-mtp-fix lines (launcher unprefixed, schedulers with SGLang's DP/TP prefix)")
    for line in log.splitlines():
        if ("sglang-dp-mtp-fix" in line or "PeerStateMismatch" in line) and "stats (" not in line:
            print(line[:400])
    print("--- first counter line per rank")
    for rank in (0, 1):
        first = re.search(rf"^.*DP{rank} TP{rank}\] sglang-dp-mtp-fix stats.*$", log, re.M)
        if first:
            print(first[0])
    print(f"stopped; no process of the server is left: {not server.group_alive()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
