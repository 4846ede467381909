"""Drive SGLang's real PD-decode scheduling round and DP MLP sync across N CPU ranks (gloo).

Used by the test suite and by ``sglang-dp-mtp-fix simulate``. ``pool.py`` starts the ranks once and feeds them
scenarios. Inside each rank process, from the bottom layer up: ``context.py`` (what the rank is), ``standins.py``,
``draft_counts.py``, ``decode_round.py`` (one round: ``run_round`` -> ``RoundResult``), ``collectives.py``, and
``rank.py`` (setup and the command tables).
"""
