"""The diagnosis's settings, from ``Config``, in one place: the plugin calls ``configure`` before it applies the patches
(the vote's wrappers are built from them) and ``stop`` when it restores SGLang. No patch reads the settings itself.

The monitor's thread starts once the recorder's file opens (the heartbeat writes it out), so the recorder is handed
``monitor.start`` here: neither of the two imports the other's way back.
"""

from __future__ import annotations

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.diagnosis import monitor, recorder, stats


def configure(config: Config) -> None:
    """The stall threshold, the counters' settings and the recorder's directory (all decided at load)."""
    monitor.configure(config.stall_s)
    stats.configure(config.stats_every, for_metrics=config.export_metrics)
    recorder.configure(config.recorder_dir, on_open=monitor.start)


def stop() -> None:
    """Drop the counters, end the monitor's thread, close the recorder's file (its content stays)."""
    stats.deactivate()
    monitor.stop()
    rec = recorder.active()
    if rec is not None:
        rec.close()
