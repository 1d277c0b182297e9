"""Architecture hyper-parameters of a Llama-family decoder, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

ARCHS = ("llama", "qwen2", "gemma3", "bamba")
LAYER_TYPES = ("full", "sliding", "mamba")
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
    arch: str = "llama"  # "llama", "qwen2", "gemma3" or "bamba"
    # rope_scaling (Llama 3 style) as a plain dict, or None; Gemma 3: the full-attention
    # layers' scaling (the sliding ones run unscaled RoPE at rope_local_theta)
    rope_scaling: dict | None = None
    # ---- hybrid attention (Gemma 3); the defaults are plain Llama / Qwen2
    # Sliding-window size W of the "sliding" layers: a query at position p attends to the
    # keys at p - W + 1 .. p (the last W, its own included). 0 = no sliding window.
    sliding_window: int = 0
    # Per layer "full", "sliding" or "mamba"; empty = every layer full attention.
    layer_types: tuple = ()
    # RoPE base of the sliding layers (the full ones use rope_theta).
    rope_local_theta: float = 10000.0
    # q.k is scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, tanh approx.).
    hidden_act: str = "silu"
    # logits = cap * tanh(logits / cap) when set (Gemma 2 style; None in Gemma 3).
    final_logit_softcapping: float | None = None
    # ---- Mamba2 (SSD) layers of a hybrid model (Bamba: layer_types "mamba"); unused otherwise.
    # The mixer's heads, their width, the groups sharing B and C, the state size per head row,
    # the causal conv's kernel width (taps) and whether it has a bias; dt is clamped to
    # mamba_dt_limit after its softplus.
    mamba_n_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_dt_limit: tuple = (0.0, float("inf"))
    # The leading fraction of head_dim that RoPE rotates (Bamba: 0.5); the rest passes through.
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                or self.sliding_window < 0:
            raise ValueError(f"ModelConfig.sliding_window must be an int >= 0 (0 = none), got {self.sliding_window!r}")
        if not isinstance(self.layer_types, (tuple, list)):
            raise ValueError(f"ModelConfig.layer_types must be a tuple of {LAYER_TYPES}, got {self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries, "
                                 f"expected one per layer ({self.num_layers})")
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"ModelConfig.layer_types entries must be one of {LAYER_TYPES}, got {bad[0]!r}")
            if "sliding" in self.layer_types and self.sliding_window < 1:
                raise ValueError("ModelConfig.sliding_window must be >= 1: layer_types has sliding layers")
        if not isinstance(self.rope_local_theta, (int, float)) or not self.rope_local_theta > 0:
            raise ValueError(f"ModelConfig.rope_local_theta must be > 0, got {self.rope_local_theta!r}")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"ModelConfig.{name} must be None or > 0, got {v!r}")
        self._check_mamba()
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")

    def _check_mamba(self) -> None:
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"ModelConfig.partial_rotary_factor must be in (0, 1], got {f!r}")
        if int(self.head_dim * f) % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor {f} leaves an odd rotary width "
                             f"{int(self.head_dim * f)} of head_dim {self.head_dim}")
        object.__setattr__(self, "mamba_dt_limit", tuple(self.mamba_dt_limit))
        if "mamba" not in self.layer_types:
            return
        if self.arch != "bamba":
            raise ValueError(f"ModelConfig.layer_types has mamba layers, which arch {self.arch!r} does not have "
                             "(arch 'bamba' does)")
        for name, low in (("mamba_n_heads", 1), ("mamba_head_dim", 1), ("mamba_n_groups", 1),
                          ("mamba_d_state", 1), ("mamba_d_conv", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"ModelConfig.{name} must be an int >= {low} (layer_types has "
                                 f"mamba layers), got {v!r}")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(f"ModelConfig.mamba_n_heads ({self.mamba_n_heads}) must be a multiple of "
                             f"mamba_n_groups ({self.mamba_n_groups})")
        lo_hi = self.mamba_dt_limit
        if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
            raise ValueError(f"ModelConfig.mamba_dt_limit must be (low, high) with 0 <= low <= high, got {lo_hi!r}")

    @property
    def mamba_inner(self) -> int:
        """Width of a Mamba layer's scan input (heads x head width)."""
        return self.mamba_n_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of a Mamba layer's causal conv: the scan input, B and C."""
        return self.mamba_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Indices of the Mamba layers (empty for a pure-attention model)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mamba")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that keep per-token K/V (every layer but the Mamba ones)."""
        return tuple(i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] != "mamba")

    def layer_window(self, layer: int) -> int:
        """The sliding window of layer ``layer``: ``sliding_window`` for a "sliding" layer,
        0 (full causal attention) otherwise."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding" else 0

    @property
    def attn_scale(self) -> float:
        """What q.k is multiplied by: ``query_pre_attn_scalar ** -0.5``, else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
