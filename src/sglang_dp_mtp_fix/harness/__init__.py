"""Drive SGLang's real PD-decode scheduling round and DP MLP sync across N CPU ranks (gloo).

Used by the test suite and by ``sglang-dp-mtp-fix simulate``. ``rank.py`` runs inside each rank process;
``pool.py`` starts the ranks once and feeds them scenarios.
"""
