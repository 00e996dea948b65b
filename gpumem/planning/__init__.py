"""Planning before running: memory estimates for inference and training."""
