"""The diagnosis: what a patched scheduler records and says about its rounds, and what reads it back.

``recfile`` (the flight-recorder file's layout), ``recorder`` (its one writer), ``monitor`` (the heartbeat and the
stall line), ``reader`` and ``verdicts`` (``rollcall``'s reading and deciding), ``stats`` and ``metrics`` (the vote
counters), ``wiring`` (the settings, from ``Config``, set once by the plugin).
"""
