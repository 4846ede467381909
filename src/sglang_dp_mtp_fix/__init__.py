"""Rank-consistent EAGLE MTP draft CUDA-graph vote for stock SGLang under DP attention (sgl-project/sglang#32209)."""

from sglang_dp_mtp_fix._version import __version__

__all__ = ["__version__"]
