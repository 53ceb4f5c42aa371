"""moerun: fast inference for Mixture-of-Experts language models (Qwen3-MoE)."""

from moerun.api import LLM
from moerun.outputs import GenerationOutput
from moerun.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationOutput"]
__version__ = "0.1.0"
