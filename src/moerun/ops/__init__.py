"""Kernel entry points of moerun: each picks a Triton kernel or its torch reference."""

from moerun.ops.moe import fused_moe, route

__all__ = ["fused_moe", "route"]
