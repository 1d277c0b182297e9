"""Text <-> token ids: the ``tokenizers`` wrapper and the tokenizer rebuilt from GGUF metadata."""
