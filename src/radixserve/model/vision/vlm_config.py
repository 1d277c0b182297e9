"""What a LLaVA-style vision-language model is made of, whatever folder it came from.

Three frozen configs, validated on construction (ValueError naming the field):

* :class:`ClipVisionConfig`: the CLIP-ViT vision tower (patch embedding, pre-norm encoder).
* :class:`VisionLanguageConfig`: the text decoder's :class:`ModelConfig`, the vision tower,
  which encoder outputs feed the projector (``feature_layers``, ``feature_select``), the
  projector's activation and the id of the image placeholder token.
* :class:`ImageProcessorConfig`: the preprocessing of an image into the tower's input
  (resize, center crop, rescale, normalise), as a ``preprocessor_config.json`` states it.

:class:`VisionParts` bundles them with the tower's and projector's weights: it is what a
loaded model carries beside its text decoder, so everything that only needs the decoder
(the KV pool, the scheduler, a text-only prompt) keeps seeing a plain :class:`ModelConfig`.
This module is plain data: reading a config never imports the model code or Pillow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.model.model_config import ModelConfig

VISION_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
PROJECTOR_ACTS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu")
FEATURE_SELECT = ("default", "full")
# PIL resampling filters by their integer code (PIL.Image.Resampling), as HF configs store them.
RESAMPLE_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _positive_int(owner: str, name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class ClipVisionConfig:
    """A CLIP-ViT vision encoder (transformers' ``CLIPVisionConfig`` defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_channels", "image_size", "patch_size"):
            _positive_int("ClipVisionConfig", name, getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"ClipVisionConfig.hidden_size ({self.hidden_size}) must be a multiple "
                             f"of num_heads ({self.num_heads})")
        if self.patch_size > self.image_size:
            raise ValueError(f"ClipVisionConfig.patch_size ({self.patch_size}) must be <= "
                             f"image_size ({self.image_size})")
        if self.hidden_act not in VISION_ACTS:
            raise ValueError(f"ClipVisionConfig.hidden_act must be one of {VISION_ACTS}, "
                             f"got {self.hidden_act!r}")
        if not isinstance(self.layer_norm_eps, (int, float)) or not self.layer_norm_eps > 0:
            raise ValueError(f"ClipVisionConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid(self) -> int:
        """Patches per side (the convolution's stride drops a remainder, as in CLIP)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid


@dataclass(frozen=True)
class VisionLanguageConfig:
    """A LLaVA model: vision tower -> projector -> the text decoder's embedding space.

    ``feature_layers`` index the encoder's hidden states as transformers counts them (0 is
    the embedding output after the pre-norm, ``i`` the output of layer ``i``), already made
    non-negative; several are concatenated along the hidden dimension. ``feature_select``
    "default" drops the CLS position, "full" keeps it. Each image becomes
    :attr:`tokens_per_image` placeholder tokens ``image_token_id`` in the prompt, whose
    embeddings are replaced by the projected image features in order.
    """

    text: ModelConfig
    vision: ClipVisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...] = (11,)
    feature_select: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.text, ModelConfig):
            raise ValueError(f"VisionLanguageConfig.text must be a ModelConfig, got {type(self.text).__name__}")
        if not isinstance(self.vision, ClipVisionConfig):
            raise ValueError("VisionLanguageConfig.vision must be a ClipVisionConfig, "
                             f"got {type(self.vision).__name__}")
        tid = self.image_token_id
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < self.text.vocab_size:
            raise ValueError(f"VisionLanguageConfig.image_token_id must be a token id in "
                             f"[0, {self.text.vocab_size}), got {tid!r}")
        layers = tuple(self.feature_layers)
        object.__setattr__(self, "feature_layers", layers)
        n = self.vision.num_layers
        if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= n
                             for i in layers):
            raise ValueError(f"VisionLanguageConfig.feature_layers must be hidden-state indices in "
                             f"[0, {n}], got {layers!r}")
        if self.feature_select not in FEATURE_SELECT:
            raise ValueError(f"VisionLanguageConfig.feature_select must be one of {FEATURE_SELECT}, "
                             f"got {self.feature_select!r}")
        if self.projector_act not in PROJECTOR_ACTS:
            raise ValueError(f"VisionLanguageConfig.projector_act must be one of {PROJECTOR_ACTS}, "
                             f"got {self.projector_act!r}")

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and projected features) per image."""
        return self.vision.num_patches + (1 if self.feature_select == "full" else 0)

    @property
    def encoder_layers_used(self) -> int:
        """Encoder layers whose output is read: the ones after the deepest feature layer never
        run (LLaVA-1.5 reads the penultimate layer, so its last layer is dead weight)."""
        return max(self.feature_layers)

    @property
    def projector_in(self) -> int:
        return self.vision.hidden_size * len(self.feature_layers)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """How an image becomes the tower's input, in transformers' ``CLIPImageProcessor`` order:
    RGB conversion (alpha composited on white) -> optional pad to square with the mean colour
    (``LlavaImageProcessor``'s ``do_pad``) -> resize -> center crop -> rescale -> normalise.

    ``shortest_edge`` resizes the short side to it keeping the aspect ratio (``size`` of
    ``{"shortest_edge": n}``); otherwise ``size`` is an exact (height, width).
    """

    crop_size: tuple[int, int] = (224, 224)
    shortest_edge: int | None = 224
    size: tuple[int, int] | None = None
    resample: int = 3  # PIL bicubic
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    do_convert_rgb: bool = True
    do_pad: bool = False

    def __post_init__(self) -> None:
        for name in ("crop_size", "size"):
            v = getattr(self, name)
            if v is None:
                continue
            v = tuple(v)
            object.__setattr__(self, name, v)
            if len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                raise ValueError(f"ImageProcessorConfig.{name} must be (height, width) positive ints, got {v!r}")
        if self.shortest_edge is not None:
            _positive_int("ImageProcessorConfig", "shortest_edge", self.shortest_edge)
        if self.do_resize and (self.shortest_edge is None) == (self.size is None):
            raise ValueError("ImageProcessorConfig needs exactly one of shortest_edge and size when do_resize")
        if self.resample not in RESAMPLE_FILTERS:
            raise ValueError(f"ImageProcessorConfig.resample must be a PIL filter code "
                             f"{sorted(RESAMPLE_FILTERS)}, got {self.resample!r}")
        if not isinstance(self.rescale_factor, (int, float)) or not self.rescale_factor > 0:
            raise ValueError(f"ImageProcessorConfig.rescale_factor must be > 0, got {self.rescale_factor!r}")
        for name in ("image_mean", "image_std"):
            v = tuple(float(x) for x in getattr(self, name))
            object.__setattr__(self, name, v)
            if len(v) != 3:
                raise ValueError(f"ImageProcessorConfig.{name} must have 3 entries (RGB), got {v!r}")
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"ImageProcessorConfig.image_std must be > 0, got {self.image_std!r}")
        if not self.do_convert_rgb:
            raise ValueError("ImageProcessorConfig.do_convert_rgb=False is not supported "
                             "(the vision tower takes RGB)")

    @classmethod
    def from_hf(cls, d: dict) -> "ImageProcessorConfig":
        """From a ``preprocessor_config.json`` dict (its int and dict forms of ``size`` and
        ``crop_size``; missing keys at ``CLIPImageProcessor``'s defaults)."""
        kwargs: dict = {}
        size = d.get("size", {"shortest_edge": 224})
        if isinstance(size, int):  # old configs: an int is the shortest edge
            size = {"shortest_edge": size}
        if not isinstance(size, dict):
            raise ValueError(f"preprocessor_config.size must be an int or a dict, got {size!r}")
        if "shortest_edge" in size:
            if size.get("longest_edge") is not None:
                raise ValueError("preprocessor_config.size.longest_edge is not supported")
            kwargs["shortest_edge"], kwargs["size"] = size["shortest_edge"], None
        elif "height" in size and "width" in size:
            kwargs["shortest_edge"], kwargs["size"] = None, (size["height"], size["width"])
        else:
            raise ValueError(f"preprocessor_config.size must give shortest_edge or height and width, got {size!r}")
        crop = d.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not isinstance(crop, dict) or "height" not in crop or "width" not in crop:
            raise ValueError(f"preprocessor_config.crop_size must be an int or have height and width, got {crop!r}")
        kwargs["crop_size"] = (crop["height"], crop["width"])
        for key in ("resample", "do_resize", "do_center_crop", "do_rescale", "rescale_factor",
                    "do_normalize", "image_mean", "image_std", "do_convert_rgb", "do_pad"):
            if d.get(key) is not None:
                kwargs[key] = d[key]
        return cls(**kwargs)

    def canonical(self) -> str:
        """A stable text form of every field (part of an image's content hash: the same
        pixels preprocessed differently are different model inputs)."""
        return ";".join(f"{k}={getattr(self, k)!r}" for k in sorted(self.__dataclass_fields__))


@dataclass
class VisionParts:
    """The vision side of a loaded VLM: its config, the tower's and projector's weights
    (names ``vision_tower.vision_model.*`` and ``multi_modal_projector.*``) and the
    preprocessing of its images."""

    config: VisionLanguageConfig
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    processor: ImageProcessorConfig
