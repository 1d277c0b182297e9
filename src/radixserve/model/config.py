"""Architecture hyper-parameters of a Llama-family decoder, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

ARCHS = ("llama", "qwen2", "gemma3")
LAYER_TYPES = ("full", "sliding")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    arch: str = "llama"  # "llama", "qwen2" or "gemma3"
    # rope_scaling (Llama 3 style) as a plain dict, or None; Gemma 3: the full-attention
    # layers' scaling (the sliding ones run unscaled RoPE at rope_local_theta)
    rope_scaling: dict | None = None
    # ---- hybrid attention (Gemma 3); the defaults are plain Llama / Qwen2
    # Sliding-window size W of the "sliding" layers: a query at position p attends to the
    # keys at p - W + 1 .. p (the last W, its own included). 0 = no sliding window.
    sliding_window: int = 0
    # Per layer "full" or "sliding"; empty = every layer full attention.
    layer_types: tuple = ()
    # RoPE base of the sliding layers (the full ones use rope_theta).
    rope_local_theta: float = 10000.0
    # q.k is scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, tanh approx.).
    hidden_act: str = "silu"
    # logits = cap * tanh(logits / cap) when set (Gemma 2 style; None in Gemma 3).
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                or self.sliding_window < 0:
            raise ValueError(f"ModelConfig.sliding_window must be an int >= 0 (0 = none), "
                             f"got {self.sliding_window!r}")
        if not isinstance(self.layer_types, (tuple, list)):
            raise ValueError(f"ModelConfig.layer_types must be a tuple of {LAYER_TYPES}, "
                             f"got {self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries, "
                                 f"expected one per layer ({self.num_layers})")
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"ModelConfig.layer_types entries must be one of {LAYER_TYPES}, "
                                 f"got {bad[0]!r}")
            if "sliding" in self.layer_types and self.sliding_window < 1:
                raise ValueError("ModelConfig.sliding_window must be >= 1: layer_types has "
                                 "sliding layers")
        if not isinstance(self.rope_local_theta, (int, float)) or not self.rope_local_theta > 0:
            raise ValueError(f"ModelConfig.rope_local_theta must be > 0, got {self.rope_local_theta!r}")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"ModelConfig.{name} must be None or > 0, got {v!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, "
                             f"got {self.hidden_act!r}")

    def layer_window(self, layer: int) -> int:
        """The sliding window of layer ``layer``: ``sliding_window`` for a "sliding" layer,
        0 (full causal attention) otherwise."""
        if self.layer_types and self.layer_types[layer] == "sliding":
            return self.sliding_window
        return 0

    @property
    def attn_scale(self) -> float:
        """What q.k is multiplied by: ``query_pre_attn_scalar ** -0.5``, else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
