"""``moerun bench``: speed of moerun (and of transformers beside it) on a preset shape or a checkpoint."""
