"""CPU stand-in for mooncake (DRIVE_CPU=1 only; bench/gpu/server/drive-cpu.sh puts it on the servers' path).

Why it exists: the real ``mooncake.engine`` links libcuda, so no CPU machine loads it; the GPU tier carries the real
engine (fetch.sh MOONCAKE=1). This stand-in lets stage pd run against CPU launches with SGLang's real mooncake
connector, bootstrap server and metadata path: only the byte mover is replaced (``engine.py``).
"""
