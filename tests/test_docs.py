"""What README.md promises on its first screen, and the figures it states, against their one source.

The install commands shown are each run by CI (tools/check-wheel.sh marks each with ``# README: <command>``; the two
set-up commands are .ci/run's); the patch count and the sample launch line match the plugin and the generated
compatibility table; the stated figures are tools/doc_figures.py's (``--check`` in .ci/run)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:40])
sys.path.insert(0, str(ROOT / "tools"))

import doc_figures  # noqa: E402


def _blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [[line.split("  #")[0].strip() for line in b.splitlines() if line.strip() and not line.startswith("#")]
            for b in blocks]  # fmt: skip


def test_the_first_screen_holds_the_set_up_commands_and_the_operators_steps():
    setup, install = _blocks(FIRST_SCREEN)[:2]
    assert setup == ["bash tools/quickstart.sh", "bash tools/test-matrix.sh"]
    ci = (ROOT / ".ci/run").read_text()
    assert all(re.search(rf"^{re.escape(cmd)}\b", ci, re.M) for cmd in setup), "a set-up command CI does not run"
    wheel_check = (ROOT / "tools/check-wheel.sh").read_text()
    assert install and all(f"# README: {cmd}\n" in wheel_check for cmd in install), install
    for step in ("**Install**", "not on PyPI yet", "**Enable:**", "**Check:**", "**Off:**", "one build across the"):
        assert step in FIRST_SCREEN, step


def test_the_install_page_shows_only_commands_ci_runs():
    page = (ROOT / "docs/configuration.md").read_text()
    install = _blocks(page[page.index("## Install") :])[0]
    wheel_check = (ROOT / "tools/check-wheel.sh").read_text()
    assert install and all(f"# README: {cmd}\n" in wheel_check for cmd in install), install


def test_the_changelog_dates_this_release_under_unreleased():
    from sglang_dp_mtp_fix import _version

    heads = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert heads[0] == "Unreleased", heads
    assert re.fullmatch(rf"{re.escape(_version.RELEASE)} - \d{{4}}-\d{{2}}-\d{{2}}", heads[1]), heads
    assert all(re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", h) for h in heads[1:]), heads


def test_the_stated_patch_count_and_sample_launch_line_are_the_plugins():
    from sglang_dp_mtp_fix import _version
    from sglang_dp_mtp_fix.patches import all_patches

    assert doc_figures.patch_count() == len(all_patches())
    table = (ROOT / "docs/compatibility.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| 0.5.20 |"))
    samples = re.findall(r"\(plugin (\S+), (\d+) of (\d+) patches applied", README)
    assert samples == [(_version.RELEASE, str(row.count("`applied`")), str(len(all_patches())))], samples
    assert re.findall(r"sglang-dp-mtp-fix (\S+) on SGLang 0\.5\.20", README) == [_version.RELEASE]


def test_every_stated_figure_is_its_sources():
    problems: list[str] = []
    for page in doc_figures.PAGES:
        doc_figures.render(page.read_text(), page.name, problems)
    assert not problems, problems
