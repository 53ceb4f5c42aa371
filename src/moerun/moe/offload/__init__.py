"""Expert offloading: experts in (pinned) host memory, a device cache of expert slots per MoE layer, copies on a
dedicated stream overlapped with compute, router-lookahead prefetch and optional CPU compute of misses.

Two modes (OffloadConfig.mode): 'copy' (manager.py) copies each layer's missed experts into slots once the host
has read the layer's routing, so decoding runs eagerly; 'zero_copy' (zero_copy.py) lets the kernels read missed
experts from pinned host memory through per-layer address tables, so a step is pure device work that CUDA graphs
capture, and updates the cache between steps.

Modules, one role each: config (options), planner (budget placement), store (host experts), pool (device slots),
cache (slot table), policies + activation (eviction), transfer (streams and copies), prefetch (router lookahead),
cpu_compute (CPU experts and cost model), stats, manager (the per-layer algorithm of the copy mode), zero_copy (the
zero-copy mode), pointers (expert address tables), residency (zero-copy slot bookkeeping and admissions),
offloaded_experts (the module that replaces ``Experts``), placement (model surgery and loading), random_build
(benchmark models).
"""

from moerun.moe.offload.config import OffloadConfig
from moerun.moe.offload.manager import ExpertOffload
from moerun.moe.offload.offloaded_experts import OffloadedExperts
from moerun.moe.offload.planner import Footprint, Placement, plan_placement
from moerun.moe.offload.stats import OffloadStats, format_stats
from moerun.moe.offload.zero_copy import ZeroCopyOffload

__all__ = ["ExpertOffload", "Footprint", "OffloadConfig", "OffloadStats", "OffloadedExperts", "Placement",
           "ZeroCopyOffload", "format_stats", "plan_placement"]
