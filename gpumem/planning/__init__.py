"""Planning before running: memory estimates for inference and training, a model of PyTorch's
caching allocator (torch_model, torch_replay) and `gpumem tune` (which settings fit which card)."""
