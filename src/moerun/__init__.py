"""moerun: fast inference for Mixture-of-Experts language models."""
