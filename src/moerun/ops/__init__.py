"""Kernel entry points of moerun: each picks a Triton kernel or its torch reference (see ops/dispatch.py)."""

from moerun.ops.attention import decode_attention, decode_attention_int8, decode_attention_qk, qk_norm_rope_write
from moerun.ops.linear import linear, rms_norm_linear
from moerun.ops.moe import fused_moe, route
from moerun.ops.norm import rms_norm, rms_norm_int8
from moerun.ops.pick import greedy_pick

__all__ = [
    "decode_attention", "decode_attention_int8", "decode_attention_qk", "fused_moe", "greedy_pick", "linear",
    "qk_norm_rope_write", "rms_norm", "rms_norm_int8", "rms_norm_linear", "route",
]
