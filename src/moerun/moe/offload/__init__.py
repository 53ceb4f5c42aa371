"""Expert offloading: experts in (pinned) host memory, a device cache of expert slots per MoE layer, copies on a
dedicated stream overlapped with compute, router-lookahead prefetch and optional CPU compute of misses.

Modules, one role each: config (options), planner (budget placement), store (host experts), pool (device slots),
cache (slot table), policies + activation (eviction), transfer (streams and copies), prefetch (router lookahead),
cpu_compute (CPU experts and cost model), stats, manager (the per-layer algorithm), offloaded_experts (the module
that replaces ``Experts``), placement (model surgery and loading), random_build (benchmark models).
"""

from moerun.moe.offload.config import OffloadConfig
from moerun.moe.offload.manager import ExpertOffload
from moerun.moe.offload.offloaded_experts import OffloadedExperts
from moerun.moe.offload.planner import Footprint, Placement, plan_placement
from moerun.moe.offload.stats import OffloadStats, format_stats

__all__ = ["ExpertOffload", "Footprint", "OffloadConfig", "OffloadStats", "OffloadedExperts", "Placement",
           "format_stats", "plan_placement"]
