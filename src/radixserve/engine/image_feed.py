"""Image features into a forward pass: the vision encoder's rows at a prompt's image positions.

The scheduler runs an image request like any other (its image positions carry content keys in
the tree, ``radixserve.images``), so a step may compute any part of an image: all of it, the
rest after a chunk boundary, or nothing when the tree held it. The feeder gives each step the
feature rows of exactly the image positions it computes, in place of the placeholder's
embedding, and leaves batches without such positions untouched (decode steps, text).

Features come from an LRU keyed by tenant salt and image key (the digest): an image seen
before skips the encoder as well as the prefill even where the tree cannot help (another
prefix before it, or its KV evicted). A request keeps its images' features only while its
prompt is being computed.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from radixserve.request import ReqImages
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.vision.image_embed_cache import ImageEmbeddingCache
from radixserve.model.arch.llava import LlavaForConditionalGeneration
from radixserve.sched.batch import ScheduledBatch


class ImageFeeder:
    """Encodes images (through the LRU) and builds ``ForwardBatch.input_embeds``."""

    def __init__(self, vlm: LlavaForConditionalGeneration, cache_bytes: int):
        self.vlm = vlm
        self.cache = ImageEmbeddingCache(cache_bytes)
        self.encoder_seconds = 0.0
        self.images_encoded = 0
        self.image_tokens_fed = 0

    def feed(self, fb: ForwardBatch, batch: ScheduledBatch) -> ForwardBatch:
        """``fb`` with input embeddings when the batch computes image positions."""
        pieces: list[tuple[int, torch.Tensor]] = []  # (row in the flat batch, features)
        row = 0
        for req, s, e in zip(batch.reqs, batch.starts, batch.extend_lens):
            ims = req.images
            spans = [sp for sp in ims.spans if sp.offset < s + e and s < sp.end] if ims is not None else ()
            if spans:
                feats = self._features(ims, req.salt)
                for sp in spans:
                    lo, hi = max(s, sp.offset), min(s + e, sp.end)
                    pieces.append((row + lo - s, feats[sp.index][lo - sp.offset: hi - sp.offset]))
                if s + e >= max(sp.end for sp in ims.spans):
                    ims.features = None  # the prompt's images are all computed
            row += e
        if not pieces:
            return fb
        lm = self.vlm.language_model
        emb = lm.embed_tokens(fb.input_ids)
        for r, f in pieces:
            # Rounded to the embedding dtype, as transformers merges them.
            emb[r: r + f.shape[0]] = f.to(device=emb.device, dtype=emb.dtype)
            self.image_tokens_fed += f.shape[0]
        return dataclasses.replace(fb, input_embeds=emb.to(torch.float32))

    def _features(self, ims: ReqImages, salt: str | None) -> list[torch.Tensor]:
        """[tokens_per_image, hidden] float32 per image of a request (kept on it until its
        prompt is done)."""
        if ims.features is None:
            keys = [(salt, sp.key) for sp in ims.spans]
            images = ims.inputs

            def encode(idx: list[int]) -> torch.Tensor:
                t0 = time.perf_counter()
                pixels = torch.stack([images[i].pixel_values for i in idx])
                out = self.vlm.encode_images(pixels.to(self.vlm.device))
                self.encoder_seconds += time.perf_counter() - t0
                self.images_encoded += len(idx)
                return out

            ims.features = self.cache.get_or_compute(keys, encode)
        return ims.features

    def stats(self) -> dict[str, float]:
        c = self.cache.stats()
        return {"images_encoded": float(self.images_encoded), "image_encoder_seconds": self.encoder_seconds,
                "image_tokens_fed": float(self.image_tokens_fed), "image_cache_entries": float(c.entries),
                "image_cache_bytes": float(c.bytes), "image_cache_hits": float(c.hits),
                "image_cache_misses": float(c.misses)}
