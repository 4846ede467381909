"""The one seam the launch tier's test-only probes use: run ``install(scheduler)`` at the end of each
``Scheduler.maybe_init_draft_worker``, a method the plugin does not target. By then SGLang's ``load_plugins()`` has run
every plugin, so the plugin has resolved and fingerprinted its targets before a probe wraps anything (a wrapper seen
first would read to it as a foreign hook). Never touches the plugin."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any


def after_draft_worker_init(install: Callable[[Any], None], mark: str) -> None:
    """Wrap ``maybe_init_draft_worker`` once per ``mark``; nothing outside a scheduler process (the launcher)."""
    scheduler = sys.modules.get("sglang.srt.managers.scheduler")
    if scheduler is None:
        return
    original = scheduler.Scheduler.__dict__["maybe_init_draft_worker"]
    if getattr(original, mark, False):
        return

    @functools.wraps(original)
    def maybe_init_draft_worker(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        install(self)
        return result

    setattr(maybe_init_draft_worker, mark, True)
    scheduler.Scheduler.maybe_init_draft_worker = maybe_init_draft_worker
