"""The CLIP-ViT vision tower of a LLaVA model, loading transformers' ``CLIPVisionModel`` weights.

An image is cut into ``patch_size`` squares (a strided convolution without bias), a CLS
embedding is prepended, learned position embeddings added, and the sequence goes through a
pre-norm before the encoder layers (LayerNorm -> bidirectional self-attention -> residual,
LayerNorm -> MLP -> residual). :meth:`ClipVisionTower.forward` returns the hidden states a
:class:`VisionLanguageConfig` reads (``feature_layers``): only the layers up to the deepest
of them run, and only those are loaded (the rest, and ``post_layernorm``, which LLaVA never
reads, are accepted in the state dict and dropped).

Numerics follow llama.py: the residual stream, LayerNorms, attention and softmax run in
float32; the linears and the patch convolution in the weights' dtype. The tower works on
whole images (a few hundred tokens each) at once, so it uses ``F.linear`` and PyTorch's SDPA:
those are prefill-shaped GEMMs, not the decode-shaped ones the packed kernels are for.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.arch.layers import EmptyParams
from radixserve.model.loaders.hf_weights import HFWeights
from radixserve.model.vision.vlm_config import ClipVisionConfig

PREFIX = "vision_tower.vision_model."


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations of CLIP towers and LLaVA projectors, by their transformers names."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {name!r}")


class ClipEncoderLayer(nn.Module):
    """One encoder layer's weights, q/k/v fused into one projection."""

    def __init__(self, c: ClipVisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = c.hidden_size, c.intermediate_size

        p = EmptyParams(dtype, device)
        self.ln1_w, self.ln1_b = p(h, dt=torch.float32), p(h, dt=torch.float32)
        self.ln2_w, self.ln2_b = p(h, dt=torch.float32), p(h, dt=torch.float32)
        self.qkv_w, self.qkv_b = p(3 * h, h), p(3 * h)
        self.out_w, self.out_b = p(h, h), p(h)
        self.fc1_w, self.fc1_b = p(i, h), p(i)
        self.fc2_w, self.fc2_b = p(h, i), p(h)


class ClipVisionTower(nn.Module):
    """CLIP-ViT encoder running ``num_run`` of its layers (see the module docstring)."""

    def __init__(self, config: ClipVisionConfig, num_run: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__()
        if isinstance(num_run, bool) or not isinstance(num_run, int) or not 0 <= num_run <= config.num_layers:
            raise ValueError(f"num_run must be in [0, {config.num_layers}], got {num_run!r}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c, dev, h = config, self.device, config.hidden_size
        p = EmptyParams(dtype, dev)
        self.patch_w = p(h, c.num_channels, c.patch_size, c.patch_size)
        self.class_emb = p(h, dt=torch.float32)
        self.pos_emb = p(c.num_patches + 1, h, dt=torch.float32)
        self.pre_w, self.pre_b = p(h, dt=torch.float32), p(h, dt=torch.float32)
        self.layers = nn.ModuleList(ClipEncoderLayer(c, dtype, dev) for _ in range(num_run))

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], used: set[str]) -> None:
        """Read the ``vision_tower.vision_model.*`` tensors (HF names); records each name it
        consumed (or deliberately dropped) in ``used``; ValueError on a missing tensor or a
        wrong shape, naming it."""
        c = self.config
        h, i = c.hidden_size, c.intermediate_size
        weights = HFWeights(state_dict, self.device, used)
        put = weights.put

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return weights.get(PREFIX + name, shape)

        put(self.patch_w, get("embeddings.patch_embedding.weight", (h, c.num_channels, c.patch_size, c.patch_size)))
        put(self.class_emb, get("embeddings.class_embedding", (h,)))
        put(self.pos_emb, get("embeddings.position_embedding.weight", (c.num_patches + 1, h)))
        put(self.pre_w, get("pre_layrnorm.weight", (h,)))
        put(self.pre_b, get("pre_layrnorm.bias", (h,)))
        for n, layer in enumerate(self.layers):
            pre = f"encoder.layers.{n}."
            put(layer.ln1_w, get(pre + "layer_norm1.weight", (h,)))
            put(layer.ln1_b, get(pre + "layer_norm1.bias", (h,)))
            put(layer.ln2_w, get(pre + "layer_norm2.weight", (h,)))
            put(layer.ln2_b, get(pre + "layer_norm2.bias", (h,)))
            a = pre + "self_attn."
            put(layer.qkv_w, torch.cat([get(a + f"{x}_proj.weight", (h, h)) for x in "qkv"]))
            put(layer.qkv_b, torch.cat([get(a + f"{x}_proj.bias", (h,)) for x in "qkv"]))
            put(layer.out_w, get(a + "out_proj.weight", (h, h)))
            put(layer.out_b, get(a + "out_proj.bias", (h,)))
            put(layer.fc1_w, get(pre + "mlp.fc1.weight", (i, h)))
            put(layer.fc1_b, get(pre + "mlp.fc1.bias", (i,)))
            put(layer.fc2_w, get(pre + "mlp.fc2.weight", (h, i)))
            put(layer.fc2_b, get(pre + "mlp.fc2.bias", (h,)))
        # Never read by LLaVA: the layers after the deepest feature layer and the final norm.
        dead = [f"encoder.layers.{n}." for n in range(len(self.layers), c.num_layers)] + ["post_layernorm."]
        used.update(k for k in state_dict if k.startswith(PREFIX)
                    and k[len(PREFIX):].startswith(tuple(dead)))

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self, pixel_values: torch.Tensor, layers: tuple[int, ...]
    ) -> list[torch.Tensor]:
        """float32 hidden states ``[N, 1 + patches, hidden]`` for each index in ``layers``
        (0: the embeddings after the pre-norm; i: after encoder layer i)."""
        c = self.config
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(f"pixel_values must be [N, {c.num_channels}, {c.image_size}, {c.image_size}], "
                             f"got {list(pixel_values.shape)}")
        if not layers or any(not 0 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"layers {layers} outside the {len(self.layers)} layers this tower runs")
        n = pixel_values.shape[0]
        h, nh, hd, eps = c.hidden_size, c.num_heads, c.head_dim, c.layer_norm_eps
        dtype = self.dtype
        x = pixel_values.to(device=self.device, dtype=dtype)
        patches = F.conv2d(x, self.patch_w, stride=c.patch_size).flatten(2).transpose(1, 2)
        hidden = torch.cat([self.class_emb.expand(n, 1, h), patches.float()], dim=1) + self.pos_emb
        hidden = F.layer_norm(hidden, (h,), self.pre_w, self.pre_b, eps)
        wanted = set(layers)
        states: dict[int, torch.Tensor] = {0: hidden} if 0 in wanted else {}
        s = hidden.shape[1]
        for idx, layer in enumerate(self.layers, start=1):
            if idx > max(layers):
                break
            y = F.layer_norm(hidden, (h,), layer.ln1_w, layer.ln1_b, eps).to(dtype)
            qkv = F.linear(y, layer.qkv_w, layer.qkv_b).float().view(n, s, 3, nh, hd)
            q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # [N, H, S, D]
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, s, h)
            hidden = hidden + F.linear(o.to(dtype), layer.out_w, layer.out_b).float()
            y = F.layer_norm(hidden, (h,), layer.ln2_w, layer.ln2_b, eps).to(dtype)
            y = activation(c.hidden_act, F.linear(y, layer.fc1_w, layer.fc1_b))
            hidden = hidden + F.linear(y, layer.fc2_w, layer.fc2_b).float()
            if idx in wanted:
                states[idx] = hidden
        return [states[i] for i in layers]
