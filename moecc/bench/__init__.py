"""Paradigm comparison: real-shaped random models, timed training steps, reports (used by ``moecc bench``)."""
