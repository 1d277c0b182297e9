"""Model architectures: the decoders (Llama, Gemma 3, Bamba, LLaVA), their layers, attention backends and the forward-batch seam the engine fills."""
