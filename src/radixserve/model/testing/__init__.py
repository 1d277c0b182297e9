"""Seeded random tiny models (Llama, LLaVA) and their tokenizer: real architectures with meaningless weights, for tests, benchmarks and ``--model tiny``."""
