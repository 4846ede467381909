"""The child side of ``support.run_python``: run a code string as ``python -c`` would, in a process forked from
the pristine forkserver (``sglang_dp_mtp_fix.harness.pool.pristine_context``: SGLang's scheduler modules imported,
the plugin not loaded). Kept free of imports from this project and of pytest, so the child starts as pristine as
the forkserver left it."""

from __future__ import annotations

import builtins
import os
import sys


def run_code(code: str, env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    """Target of the forked child: environment, working directory, ``sys.argv`` and ``__main__`` namespace as for
    ``python -c``; stdout/stderr go to files at the descriptor level (so C-level writes land there too). Exit codes
    follow ``python -c``: multiprocessing maps SystemExit(code) and an uncaught exception (1) the same way."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["-c"]
    sys.path[0:0] = [""]  # python -c puts the working directory first
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(code, "<string>", "exec"), namespace)  # noqa: S102 - the test's own probe code
