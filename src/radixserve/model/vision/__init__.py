"""The vision side of a vision-language model: CLIP tower, image preprocessing, its configs and the embedding cache."""
