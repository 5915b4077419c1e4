"""Everything needed to RUN speculative decoding, and nothing about training (no Lightning, no MLflow)."""
