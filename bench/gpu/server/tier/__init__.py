"""The GPU server tier's driver, by job: ``conf`` (settings from the environment, flags, the summary), ``servers``
(N-node DP servers on one GPU), ``traffic`` (requests, waves, open-loop soak traffic), ``evidence`` (node logs,
observer records, stacks, rollcall) and one module per stage. ``drive.py`` is the entry point."""
