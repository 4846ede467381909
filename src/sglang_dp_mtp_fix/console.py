"""The console script ``sglang-dp-mtp-fix``: loads the CLI inside its own Ctrl-C handling.

Ctrl-C while the CLI's modules load (about 0.1 s: ``doctor`` reads package metadata) raised a KeyboardInterrupt
traceback from the script wrapper's import, where ``cli.main`` cannot catch it. Importing this module costs only the
package's ``__init__``; the CLI then ends with exit 130 and no traceback, as a Ctrl-C later does.
"""

from __future__ import annotations

INTERRUPTED = 130  # the shell's code for a process that SIGINT ended


def main() -> int:
    try:
        from sglang_dp_mtp_fix.cli import main as cli_main
    except KeyboardInterrupt:
        return INTERRUPTED
    return cli_main()
