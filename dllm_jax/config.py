"""Model configuration: a frozen dataclass read from a Hugging Face ``config.json``.

Two families: LLaDA (``model_type`` "llada", LLaDA's own key names) and Dream
(``model_type`` "Dream", Qwen2's key names: q/k/v biases, grouped-query attention, logits
shifted by one). A folder's ``auto_map`` (its own modeling code) is never read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp

# Keys of a LLaDA config.json whose value must be exactly this for the model to be computed
# the way dllm_jax computes it. Anything else is an option we do not implement.
_REQUIRED_VALUES: dict[str, Any] = {
    "alibi": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "bias_for_layer_norm": False,
    "attention_layer_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "rope": True,
    "rope_full_precision": True,
    "input_emb_norm": False,
    "scale_logits": False,
    "block_type": "llama",
    "activation_type": "silu",
    "block_group_size": 1,
    "clip_qkv": None,
}

_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
FAMILIES = ("llada", "dream")


class ConfigError(ValueError):
    """A model config that dllm_jax cannot run; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a LLaDA-style masked diffusion LM (bidirectional Llama block).

    Attributes:
      d_model: hidden size D.
      n_layers: number of transformer blocks.
      n_heads: query heads H; head_dim = d_model // n_heads.
      n_kv_heads: key/value heads (== n_heads for LLaDA-8B; fewer for grouped-query attention).
      mlp_hidden_size: SwiGLU inner size F.
      vocab_size: rows of the embedding and of the LM head (HF ``embedding_size``).
      rope_theta: RoPE base; angles are computed and applied in float32.
      rms_norm_eps: RMSNorm epsilon.
      mask_token_id, eos_token_id, pad_token_id, bos_token_id: special ids.
      max_sequence_length: longest sequence (prompt + generation) the model accepts.
      weight_tying: LM head shares the embedding matrix.
      family: "llada" (Llama-shaped, the logit row of position i predicts token i) or "dream"
        (Qwen2-shaped, the logit row of position i - 1 predicts token i); see logit_shift.
      qkv_bias: the q/k/v projections add a bias (Dream).
      dtype: dtype of the weights and activations ("bfloat16" for serving, "float32" in tests);
        matmuls and attention accumulate in float32 either way.
    """

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden_size: int
    vocab_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    bos_token_id: int | None = None
    max_sequence_length: int = 4096
    weight_tying: bool = False
    family: str = "llada"
    qkv_bias: bool = False
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}: expected one of {FAMILIES}")
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: expected a positive integer")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: expected one of {_SUPPORTED_DTYPES}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of one position's key (or value) row: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def logit_shift(self) -> int:
        """How far before its position a token's prediction sits: the logit row of position
        i - logit_shift predicts token i (0 for LLaDA, 1 for Dream)."""
        return 1 if self.family == "dream" else 0

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no allocation)."""
        D, F, V = self.d_model, self.mlp_hidden_size, self.vocab_size
        attention = D * self.n_heads * self.head_dim * 2 + D * self.kv_dim * 2
        if self.qkv_bias:
            attention += self.n_heads * self.head_dim + 2 * self.kv_dim
        per_layer = attention + 3 * D * F + 2 * D
        head = 0 if self.weight_tying else V * D
        return self.n_layers * per_layer + V * D + D + head

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, dtype: str = "bfloat16", source: str = "config.json") -> ModelConfig:
        """Builds the config from a parsed Hugging Face LLaDA or Dream ``config.json``.

        Raises ConfigError naming the key for a missing key or an unsupported option
        (alibi, biases, qk-norm, a non-RMS norm, ...).
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type", "llada")
        if str(model_type).lower() == "dream":
            return dream_config_from_hf(hf, dtype=dtype, source=source)
        if str(model_type).lower() != "llada":
            raise ConfigError(f"{source}: model_type={model_type!r} is not supported (expected 'llada' or 'Dream')")
        for key, expected in _REQUIRED_VALUES.items():
            if key in hf and hf[key] != expected:
                raise ConfigError(
                    f"{source}: unsupported option {key}={hf[key]!r} (dllm_jax implements only {key}={expected!r})"
                )
        if hf.get("multi_query_attention"):
            raise ConfigError(f"{source}: unsupported option multi_query_attention=true; use n_kv_heads instead")

        def need(key: str) -> Any:
            if key not in hf:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return hf[key]

        n_heads = need("n_heads")
        n_kv_heads = hf.get("n_kv_heads") or n_heads
        d_model = need("d_model")
        mlp = hf.get("mlp_hidden_size")
        if mlp is None:
            mlp = need("mlp_ratio") * d_model
        vocab = hf.get("embedding_size") or need("vocab_size")
        if hf.get("vocab_size") and hf["vocab_size"] > vocab:
            raise ConfigError(f"{source}: vocab_size={hf['vocab_size']} exceeds embedding_size={vocab}")
        eos = need("eos_token_id")
        pad = hf.get("pad_token_id")
        try:
            return cls(
                d_model=d_model,
                n_layers=need("n_layers"),
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                mlp_hidden_size=mlp,
                vocab_size=vocab,
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                mask_token_id=need("mask_token_id"),
                eos_token_id=eos,
                pad_token_id=eos if pad is None else pad,
                bos_token_id=hf.get("bos_token_id"),
                max_sequence_length=int(hf.get("max_sequence_length", 4096)),
                weight_tying=bool(hf.get("weight_tying", False)),
                dtype=dtype,
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path, *, dtype: str = "bfloat16") -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_config(hf, dtype=dtype, source=str(path))

    def to_hf_config(self) -> dict[str, Any]:
        """The LLaDA (or Dream) ``config.json`` dictionary describing this architecture."""
        if self.family == "dream":
            return dream_config_to_hf(self)
        hf = dict(_REQUIRED_VALUES)
        hf.update(
            model_type="llada",
            architectures=["LLaDAModelLM"],
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            mlp_hidden_size=self.mlp_hidden_size,
            mlp_ratio=max(1, math.ceil(self.mlp_hidden_size / self.d_model)),
            vocab_size=self.vocab_size,
            embedding_size=self.vocab_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            mask_token_id=self.mask_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            max_sequence_length=self.max_sequence_length,
            weight_tying=self.weight_tying,
            precision="amp_bf16",
        )
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        return hf


def llada_8b_config(dtype: str = "bfloat16") -> ModelConfig:
    """LLaDA-8B-Instruct / LLaDA-1.5 architecture (published config.json)."""
    return ModelConfig(
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        mlp_hidden_size=12288,
        vocab_size=126464,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        mask_token_id=126336,
        eos_token_id=126081,
        pad_token_id=126081,
        bos_token_id=126080,
        max_sequence_length=4096,
        weight_tying=False,
        dtype=dtype,
    )


# ----- Dream (Qwen2 key names) -----------------------------------------------------------------

# Keys of a Dream config.json whose value must be this (when present) for the model to be
# computed the way dllm_jax computes it.
_DREAM_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu",
    "rope_scaling": None,
    "use_sliding_window": False,
}

# Dream's tokenizer: <|endoftext|> ends (and pads) a sequence, <|mask|> is the mask token.
DREAM_EOS_TOKEN_ID = 151643
DREAM_MASK_TOKEN_ID = 151666


def dream_config_from_hf(hf: dict[str, Any], *, dtype: str = "bfloat16", source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Dream ``config.json`` (model_type "Dream": Dream-v0, Dream-Coder,
    DiffuCoder). Qwen2 blocks: q/k/v biases, no o/MLP biases, GQA, rotate-half RoPE.

    ``auto_map`` (the folder's own modeling code) is ignored: nothing is imported or run.
    Raises ConfigError naming the key for a missing key or an unsupported option.
    """
    for key, expected in _DREAM_REQUIRED_VALUES.items():
        if key in hf and hf[key] != expected:
            raise ConfigError(
                f"{source}: unsupported option {key}={hf[key]!r} (dllm_jax implements only {key}={expected!r})"
            )

    def need(key: str) -> Any:
        if key not in hf:
            raise ConfigError(f"{source}: missing required key {key!r}")
        return hf[key]

    n_heads = need("num_attention_heads")
    d_model = need("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is not None and isinstance(n_heads, int) and n_heads > 0 and head_dim * n_heads != d_model:
        raise ConfigError(f"{source}: head_dim={head_dim} * num_attention_heads={n_heads} != hidden_size={d_model}")
    eos = hf.get("eos_token_id", DREAM_EOS_TOKEN_ID)
    if isinstance(eos, list):  # generation configs may list several; the first ends a sequence
        eos = eos[0] if eos else DREAM_EOS_TOKEN_ID
    pad = hf.get("pad_token_id")
    try:
        return ModelConfig(
            d_model=d_model,
            n_layers=need("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            mlp_hidden_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            mask_token_id=hf.get("mask_token_id", DREAM_MASK_TOKEN_ID),
            eos_token_id=eos,
            pad_token_id=eos if pad is None else pad,
            bos_token_id=hf.get("bos_token_id"),
            max_sequence_length=int(hf.get("max_position_embeddings", 32768)),
            weight_tying=bool(hf.get("tie_word_embeddings", False)),
            family="dream",
            qkv_bias=True,
            dtype=dtype,
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def dream_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Dream ``config.json`` dictionary of this architecture (no auto_map: no remote code)."""
    hf: dict[str, Any] = dict(_DREAM_REQUIRED_VALUES)
    hf.update(
        model_type="Dream",
        architectures=["DreamModel"],
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        intermediate_size=config.mlp_hidden_size,
        vocab_size=config.vocab_size,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        mask_token_id=config.mask_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        max_position_embeddings=config.max_sequence_length,
        tie_word_embeddings=config.weight_tying,
        torch_dtype=config.dtype,
    )
    if config.bos_token_id is not None:
        hf["bos_token_id"] = config.bos_token_id
    return hf


def dream_7b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Dream-v0-Base/Instruct-7B architecture (published config.json; Qwen2.5-7B shaped)."""
    return dream_config_from_hf(
        {
            "model_type": "Dream",
            "hidden_size": 3584,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "intermediate_size": 18944,
            "vocab_size": 152064,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "mask_token_id": DREAM_MASK_TOKEN_ID,
            "eos_token_id": DREAM_EOS_TOKEN_ID,
            "pad_token_id": DREAM_EOS_TOKEN_ID,
            "bos_token_id": DREAM_EOS_TOKEN_ID,
        },
        dtype=dtype,
        source="dream_7b_config",
    )
