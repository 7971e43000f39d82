"""DiffusionGemma's architecture: a frozen dataclass read from a Hugging Face ``config.json``.

The checkpoint's config.json (``model_type`` "diffusion_gemma", transformers'
``DiffusionGemmaConfig``) nests the language model under ``text_config`` (transformers'
``DiffusionGemmaTextConfig``) beside a ``vision_config`` for the Gemma 4 vision tower, which
is not ours: only the text part is read (an image in a prompt is an error at generation).

The text model is one Gemma 4 mixture-of-experts stack used in two modes that share every
weight: the encoder (causal over the prefix, fills the K/V cache) and the decoder (the canvas,
bidirectional over itself plus the cache). Layers are either sliding-window or full attention,
each kind with its own head width, key/value heads and RoPE; full layers take their values
from the key projection (no v_proj). The full-layer head width and kv heads come from
``global_head_dim`` / ``num_global_key_value_heads`` (the published config.json) or from the
``per_layer_config`` overrides transformers writes when it saves a config.

The published google/diffusiongemma-26B-A4B-it configuration is ``diffusion_gemma_26b_a4b_config``
(sources cited there).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, Any

from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS
from dllm_jax.models.config import ConfigError, _ConfigKeys, _is_int, _show, _size_problem

if TYPE_CHECKING:
    import jax.numpy as jnp

MODEL_TYPE = "diffusion_gemma"

# transformers' DiffusionGemmaTextConfig defaults for the keys a config.json may omit.
_DEFAULT_SLIDING_WINDOW = 512
_DEFAULT_GLOBAL_HEAD_DIM = 512
_DEFAULT_MAX_POSITIONS = 131_072
_DEFAULT_CANVAS_LENGTH = 256
_DEFAULT_SOFTCAP = 30.0
_SLIDING_WINDOW_PATTERN = 6  # transformers' default layer_types: five sliding layers, then one full

# Gemma 4 keys a DiffusionGemma text_config may carry; DiffusionGemma computes only these values.
_TEXT_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "tie_word_embeddings": True,
    "attention_k_eq_v": True,
    "enable_moe_block": True,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
    "attn_logit_softcapping": None,
}
_BIDIRECTIONAL_VALUES = (None, "vision")  # "vision": bidirectional among image tokens only, so text is causal
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
_LAYER_OVERRIDE_KEYS = {"head_dim", "num_key_value_heads"}
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class AttentionKind(enum.Enum):
    """A layer's attention: a window of recent keys, or every key."""

    SLIDING = "sliding_attention"
    FULL = "full_attention"


# the name of each kind's layer stack in the parameter tree (dllm_jax.models.diffusion_gemma)
STACKS = {AttentionKind.SLIDING: "sliding_layers", AttentionKind.FULL: "full_layers"}

# transformers' DiffusionGemmaForBlockDiffusion always builds the Gemma 4 vision tower: the
# smallest one, so the folder loads there (text checkpoints written for it: transformers
# initialises the tower, dllm_jax never reads it).
SMALLEST_VISION_CONFIG = {
    "model_type": "gemma4_vision",
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "patch_size": 2,
    "pooling_kernel_size": 1,
    "position_embedding_size": 4,
}


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """Rotate-half RoPE of one layer kind (transformers' "default" and "proportional" types).

    theta: the base wavelength.
    rotated_fraction: the share of the head's dimension pairs that rotate; the rest keep
      frequency 0 (cos 1, sin 0). "default" RoPE is fraction 1.
    factor: every frequency is divided by it (proportional RoPE's ``factor``).
    """

    theta: float
    rotated_fraction: float = 1.0
    factor: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> jnp.ndarray:
        """float32 [head_dim // 2]: theta^(-2i / head_dim) / factor for the first
        int(fraction * head_dim // 2) pairs, 0 after them (transformers' proportional RoPE)."""
        import jax.numpy as jnp  # here: reading a config (a command line's input check) imports no JAX

        rotated = int(self.rotated_fraction * head_dim // 2)
        exponents = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / head_dim
        inv = 1.0 / (jnp.float32(self.theta) ** exponents)
        inv = jnp.concatenate([inv, jnp.zeros(head_dim // 2 - rotated, jnp.float32)])
        return inv / jnp.float32(self.factor)


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text model of a DiffusionGemma checkpoint (hashable: static to jit).

    Attributes:
      d_model: hidden size D.
      n_heads: query heads H (every layer).
      layer_types: the attention kind of each layer; the last one is full.
      sliding_head_dim, sliding_kv_heads: head width and key/value heads of sliding layers.
      full_head_dim, full_kv_heads: the same for full layers (values are the keys' projection).
      mlp_hidden_size: inner size of the dense MLP beside the experts, and of self-conditioning.
      n_experts, top_k_experts, expert_hidden_size: the routed experts of every layer.
      vocab_size: rows of the (tied) embedding and LM head.
      sliding_window: W; an encoder query sees the W keys up to itself, a canvas row the last
        W - 1 cached keys (transformers' sliding cache keeps W - 1) and the whole canvas.
      sliding_rope, full_rope: RoPE of each kind.
      rms_norm_eps: epsilon of every RMSNorm.
      final_logit_softcap: logits = cap * tanh(logits / cap).
      canvas_length: L, the tokens denoised together (one block).
      max_sequence_length: longest sequence (prompt + canvases).
      pad_token_id, bos_token_id: special ids.
      eos_token_ids: the ids that end a sequence.
      image_token_id: the image placeholder id (None when outside the vocabulary).
      dtype: weights and activations ("bfloat16" to serve, "float32" in tests); matmuls,
        softmax and norm statistics are float32 either way.
      quantization: "none", "fp8" or "int8-weights": 8-bit attention projections, dense MLP
        and routed experts (dllm_jax.models.quantization); a load-time choice, not part of
        config.json.
    """

    d_model: int
    n_heads: int
    layer_types: tuple[AttentionKind, ...]
    sliding_head_dim: int
    sliding_kv_heads: int
    full_head_dim: int
    full_kv_heads: int
    mlp_hidden_size: int
    n_experts: int
    top_k_experts: int
    expert_hidden_size: int
    vocab_size: int
    sliding_window: int
    sliding_rope: RopeSettings
    full_rope: RopeSettings
    rms_norm_eps: float = 1e-6
    final_logit_softcap: float = _DEFAULT_SOFTCAP
    canvas_length: int = _DEFAULT_CANVAS_LENGTH
    max_sequence_length: int = _DEFAULT_MAX_POSITIONS
    pad_token_id: int = 0
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)
    image_token_id: int | None = None
    dtype: str = "bfloat16"
    quantization: str = "none"

    def __post_init__(self):
        for name in (
            "d_model",
            "n_heads",
            "sliding_head_dim",
            "sliding_kv_heads",
            "full_head_dim",
            "full_kv_heads",
            "mlp_hidden_size",
            "n_experts",
            "top_k_experts",
            "expert_hidden_size",
            "vocab_size",
            "sliding_window",
            "canvas_length",
            "max_sequence_length",
        ):
            problem = _size_problem(getattr(self, name))
            if problem:
                raise ConfigError(f"{name}={getattr(self, name)!r}: {problem}")
        if not self.layer_types or not all(isinstance(kind, AttentionKind) for kind in self.layer_types):
            raise ConfigError(f"layer_types={self.layer_types!r}: expected a non-empty tuple of AttentionKind")
        if self.layer_types[-1] is not AttentionKind.FULL:
            raise ConfigError("layer_types: the last layer must be full_attention (transformers forces it)")
        for kind in AttentionKind:
            if self.n_heads % self.kv_heads(kind):
                raise ConfigError(
                    f"n_heads={self.n_heads} is not a multiple of the {kind.value} kv heads ({self.kv_heads(kind)})"
                )
            if self.head_dim(kind) % 2:
                raise ConfigError(f"{kind.value} head_dim={self.head_dim(kind)} must be even for rotate-half RoPE")
        if self.top_k_experts > self.n_experts:
            raise ConfigError(f"top_k_experts={self.top_k_experts} exceeds n_experts={self.n_experts}")
        for name in ("pad_token_id", "bos_token_id", "image_token_id"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value < self.vocab_size):
                raise ConfigError(f"{name}={value!r}: expected a token id in [0, {self.vocab_size})")
        if not self.eos_token_ids or not all(_is_int(t) and 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ConfigError(f"eos_token_ids={self.eos_token_ids!r}: expected token ids in [0, {self.vocab_size})")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: expected one of {_SUPPORTED_DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r}: expected one of {QUANTIZATIONS}")

    family = "diffusion_gemma"

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def head_dim(self, kind: AttentionKind) -> int:
        return self.sliding_head_dim if kind is AttentionKind.SLIDING else self.full_head_dim

    def kv_heads(self, kind: AttentionKind) -> int:
        return self.sliding_kv_heads if kind is AttentionKind.SLIDING else self.full_kv_heads

    def rope(self, kind: AttentionKind) -> RopeSettings:
        return self.sliding_rope if kind is AttentionKind.SLIDING else self.full_rope

    def layers_of(self, kind: AttentionKind) -> int:
        """How many layers are of this kind (the length of its parameter stack)."""
        return sum(k is kind for k in self.layer_types)

    def quantized_matrices(self, kind: AttentionKind) -> tuple[tuple[int, int], ...]:
        """(entries, output channels) of each matrix a layer of this kind stores in 8 bits when
        quantized: q, k, (v,) o, the dense MLP's gate, up and down, the experts' gate/up and
        down stacks (their channels per expert, summed over the experts)."""
        D, F, E, Fe = self.d_model, self.mlp_hidden_size, self.n_experts, self.expert_hidden_size
        q, kv = self.n_heads * self.head_dim(kind), self.kv_heads(kind) * self.head_dim(kind)
        v = ((D * kv, kv),) if kind is AttentionKind.SLIDING else ()
        return (
            (D * q, q),
            (D * kv, kv),
            *v,
            (q * D, D),
            (D * F, F),
            (D * F, F),
            (F * D, D),
            (E * 2 * Fe * D, E * 2 * Fe),
            (E * D * Fe, E * D),
        )

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no allocation): the layers, the tied
        embedding, the final norm and self-conditioning."""
        D, E = self.d_model, self.n_experts
        # per layer besides its matrices: 7 norms, q/k norms, the router, the two layer scalars
        total = self.vocab_size * D + D + (D + 3 * D * self.mlp_hidden_size)
        for kind in AttentionKind:
            vectors = 7 * D + 2 * self.head_dim(kind) + (D * E + D + E) + 2
            matrices = sum(entries for entries, _ in self.quantized_matrices(kind))
            total += self.layers_of(kind) * (matrices + vectors)
        return total

    def weight_bytes(self) -> int:
        """Bytes of the params tree (dllm_jax.models.diffusion_gemma), computed from the shapes:
        every leaf in the model dtype, except with quantization each quantized_matrices entry
        takes 1 byte plus a float32 scale per output channel (dllm_jax.models.quantization)."""
        itemsize = self.jnp_dtype.itemsize
        if self.quantization == "none":
            return self.num_params() * itemsize
        quantized = stored = 0
        for kind in AttentionKind:
            matrices = self.quantized_matrices(kind)
            quantized += self.layers_of(kind) * sum(entries for entries, _ in matrices)
            stored += self.layers_of(kind) * sum(entries + 4 * channels for entries, channels in matrices)
        return (self.num_params() - quantized) * itemsize + stored

    def stack_index(self, layer: int) -> int:
        """Layer ``layer``'s index in the parameter stack of its kind."""
        kind = self.layer_types[layer]
        return sum(k is kind for k in self.layer_types[:layer])

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dictionary of this text model, in the published layout (full layers
        through global_head_dim / num_global_key_value_heads) and ``vision_config`` null: no vision
        tower (transformers' DiffusionGemmaForBlockDiffusion builds one regardless, so a folder
        for it needs a vision_config); ``from_hf_config`` reads it back (the dtype is not written)."""

        def rope(settings: RopeSettings) -> dict[str, Any]:
            if settings.rotated_fraction == 1 and settings.factor == 1:
                return {"rope_type": "default", "rope_theta": settings.theta}
            out = {"rope_type": "proportional", "rope_theta": settings.theta}
            out["partial_rotary_factor"] = settings.rotated_fraction
            if settings.factor != 1:  # transformers reads it but warns about it
                out["factor"] = settings.factor
            return out

        text = dict(_TEXT_REQUIRED_VALUES)
        text.update(
            model_type="diffusion_gemma_text",
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            intermediate_size=self.mlp_hidden_size,
            num_hidden_layers=self.n_layers,
            layer_types=[kind.value for kind in self.layer_types],
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.sliding_kv_heads,
            head_dim=self.sliding_head_dim,
            global_head_dim=self.full_head_dim,
            num_global_key_value_heads=self.full_kv_heads,
            num_experts=self.n_experts,
            top_k_experts=self.top_k_experts,
            moe_intermediate_size=self.expert_hidden_size,
            sliding_window=self.sliding_window,
            max_position_embeddings=self.max_sequence_length,
            rms_norm_eps=self.rms_norm_eps,
            final_logit_softcapping=self.final_logit_softcap,
            rope_parameters={
                AttentionKind.SLIDING.value: rope(self.sliding_rope),
                AttentionKind.FULL.value: rope(self.full_rope),
            },
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids),
            use_bidirectional_attention="vision",
        )
        hf = {
            "model_type": MODEL_TYPE,
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "canvas_length": self.canvas_length,
            "eos_token_id": list(self.eos_token_ids),
            "tie_word_embeddings": True,
            "text_config": text,
            "vision_config": None,
        }
        # without one, transformers' default ids (past a small vocabulary: read back as None)
        if self.image_token_id is not None:
            hf["image_token_id"] = self.image_token_id
        return hf

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], *, dtype: str = "bfloat16", source: str = "config.json"
    ) -> DiffusionGemmaConfig:
        """The text model of a parsed DiffusionGemma ``config.json``.

        Keys a config.json may omit take transformers' defaults; every present value is checked
        (sizes positive integers, token ids in the vocabulary, RoPE types "default" or
        "proportional", ...). A ``vision_config`` is allowed and not read.

        Raises ConfigError "SOURCE: [text_config: ]KEY=VALUE: ..." for a missing key, a value of
        the wrong type or range, or an option transformers' DiffusionGemma computes differently
        from this implementation (encoder bidirectional "all", biases, untied embeddings, a
        quantized checkpoint, ...).
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        top = _ConfigKeys(hf, source)
        if hf.get("model_type") != MODEL_TYPE:
            raise ConfigError(f'{source}: model_type={_show(hf.get("model_type"))}: expected "{MODEL_TYPE}"')
        for key in ("quantization_config", "quantization"):
            if key in hf:
                top.fail(key, "a pre-quantized checkpoint is not supported (quantize at load time instead)")
        top.require_values({"tie_word_embeddings": True})
        text = top.need("text_config")
        if not isinstance(text, dict):
            top.fail("text_config", "expected a JSON object")
        keys = _ConfigKeys(text, f"{source}: text_config")
        keys.require_values(_TEXT_REQUIRED_VALUES)
        if text.get("use_bidirectional_attention") not in _BIDIRECTIONAL_VALUES:
            keys.fail("use_bidirectional_attention", 'only null or "vision" (a causal text encoder) is supported')

        size = keys.size
        vocab = size("vocab_size")
        layer_types = _layer_types(keys, size("num_hidden_layers"))
        n_heads = size("num_attention_heads")
        sliding_head_dim = size("head_dim")
        sliding_kv_heads = size("num_key_value_heads")
        full_head_dim, full_kv_heads = _full_layer_shape(keys, layer_types, sliding_head_dim, sliding_kv_heads)
        sliding_rope, full_rope = _rope_settings(keys)

        def token_id(k: _ConfigKeys, key: str, default: int | None) -> int | None:
            return k.token_id(key, vocab) if k.given(key) else default

        eos_source, eos_keys = (hf, top) if top.given("eos_token_id") else (text, keys)
        eos = eos_source.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        if not eos_ids or not all(_is_int(t) and 0 <= t < vocab for t in eos_ids):
            eos_keys.fail("eos_token_id", f"expected a token id or a non-empty list of token ids in [0, {vocab})")
        image = hf.get("image_token_id")
        with keys.naming_source():
            return cls(
                d_model=size("hidden_size"),
                n_heads=n_heads,
                layer_types=layer_types,
                sliding_head_dim=sliding_head_dim,
                sliding_kv_heads=sliding_kv_heads,
                full_head_dim=full_head_dim,
                full_kv_heads=full_kv_heads,
                mlp_hidden_size=size("intermediate_size"),
                n_experts=size("num_experts"),
                top_k_experts=size("top_k_experts"),
                expert_hidden_size=size("moe_intermediate_size"),
                vocab_size=vocab,
                sliding_window=size("sliding_window") if "sliding_window" in text else _DEFAULT_SLIDING_WINDOW,
                sliding_rope=sliding_rope,
                full_rope=full_rope,
                rms_norm_eps=keys.positive_real("rms_norm_eps", 1e-6),
                final_logit_softcap=keys.positive_real("final_logit_softcapping", _DEFAULT_SOFTCAP),
                canvas_length=top.size("canvas_length") if top.given("canvas_length") else _DEFAULT_CANVAS_LENGTH,
                max_sequence_length=(
                    size("max_position_embeddings") if "max_position_embeddings" in text else _DEFAULT_MAX_POSITIONS
                ),
                pad_token_id=token_id(keys, "pad_token_id", 0),
                bos_token_id=token_id(keys, "bos_token_id", None),
                eos_token_ids=eos_ids,
                image_token_id=image if _is_int(image) and 0 <= image < vocab else None,
                dtype=dtype,
            )


def _layer_types(keys: _ConfigKeys, n_layers: int) -> tuple[AttentionKind, ...]:
    """layer_types as AttentionKinds; null means transformers' default (five sliding, one full,
    repeated; the last forced full)."""
    if not keys.given("layer_types"):
        kinds = [
            AttentionKind.SLIDING if (i + 1) % _SLIDING_WINDOW_PATTERN else AttentionKind.FULL for i in range(n_layers)
        ]
        kinds[-1] = AttentionKind.FULL
        return tuple(kinds)
    names = keys.hf["layer_types"]
    values = {kind.value: kind for kind in AttentionKind}
    if not isinstance(names, list) or len(names) != n_layers or not all(n in values for n in names):
        keys.fail("layer_types", f"expected a list of {n_layers} of {sorted(values)}")
    if names[-1] != AttentionKind.FULL.value:
        keys.fail("layer_types", "the last layer must be full_attention (transformers forces it)")
    return tuple(values[name] for name in names)


def _full_layer_shape(
    keys: _ConfigKeys, layer_types: tuple[AttentionKind, ...], head_dim: int, kv_heads: int
) -> tuple[int, int]:
    """(head_dim, kv heads) of the full layers: from per_layer_config when present (what
    transformers writes; it must override the full layers alike and nothing else), else from
    global_head_dim / num_global_key_value_heads (the published config.json)."""
    if not keys.given("per_layer_config"):
        full_head_dim = keys.size("global_head_dim") if keys.given("global_head_dim") else _DEFAULT_GLOBAL_HEAD_DIM
        full_kv = keys.size("num_global_key_value_heads") if keys.given("num_global_key_value_heads") else kv_heads
        return full_head_dim, full_kv
    overrides = keys.hf["per_layer_config"]
    if not isinstance(overrides, dict):
        keys.fail("per_layer_config", "expected an object of layer index -> overrides")
    shapes = set()
    for index, kind in enumerate(layer_types):
        override = overrides.get(str(index), overrides.get(index, {}))
        if not isinstance(override, dict) or not set(override) <= _LAYER_OVERRIDE_KEYS:
            keys.fail("per_layer_config", f"layer {index}: only {sorted(_LAYER_OVERRIDE_KEYS)} may be overridden")
        for key, value in override.items():
            if _size_problem(value):
                keys.fail("per_layer_config", f"layer {index}: {key}={_show(value)}: {_size_problem(value)}")
        shape = (override.get("head_dim", head_dim), override.get("num_key_value_heads", kv_heads))
        if kind is AttentionKind.SLIDING and shape != (head_dim, kv_heads):
            keys.fail(
                "per_layer_config",
                f"layer {index} is sliding: its shape comes from head_dim and num_key_value_heads only",
            )
        if kind is AttentionKind.FULL:
            shapes.add(shape)
    unknown = [k for k in overrides if not (str(k).isdigit() and int(k) < len(layer_types))]
    if unknown:
        keys.fail("per_layer_config", f"{_show(unknown)}: not layer indices")
    if len(shapes) != 1:
        keys.fail("per_layer_config", "the full-attention layers must share one head_dim and num_key_value_heads")
    return shapes.pop()


def _rope_settings(keys: _ConfigKeys) -> tuple[RopeSettings, RopeSettings]:
    """(sliding, full) RoPE from rope_parameters (null: transformers' defaults, theta 10k default
    RoPE for sliding layers and theta 1M proportional RoPE over a quarter of the pairs for full)."""
    if not keys.given("rope_parameters"):
        return RopeSettings(10_000.0), RopeSettings(1_000_000.0, rotated_fraction=0.25)
    params = keys.hf["rope_parameters"]
    if not isinstance(params, dict):
        keys.fail("rope_parameters", "expected an object with sliding_attention and full_attention")
    settings = []
    for kind in AttentionKind:
        entry = params.get(kind.value)
        where = f"{kind.value}"
        if not isinstance(entry, dict):
            keys.fail("rope_parameters", f"{where}: expected an object")
        unknown = sorted(set(entry) - _ROPE_KEYS)
        rope_type = entry.get("rope_type", "default")
        fraction = entry.get("partial_rotary_factor", 1.0)
        factor = entry.get("factor", 1.0)
        theta = entry.get("rope_theta")
        if unknown:
            keys.fail("rope_parameters", f"{where}: unsupported key(s) {_show(unknown)}")
        if rope_type not in ("default", "proportional"):
            keys.fail("rope_parameters", f'{where}: rope_type={_show(rope_type)}: expected "default" or "proportional"')
        for name, value in (("rope_theta", theta), ("factor", factor)):
            if not _is_positive(value):
                keys.fail("rope_parameters", f"{where}: {name}={_show(value)}: expected a finite positive number")
        if not (_is_positive(fraction) and fraction <= 1):
            keys.fail("rope_parameters", f"{where}: partial_rotary_factor={_show(fraction)}: expected in (0, 1]")
        if rope_type == "default" and (fraction != 1 or factor != 1):
            keys.fail(
                "rope_parameters",
                f"{where}: default RoPE rotates every pair, unscaled "
                '(partial_rotary_factor and factor need rope_type "proportional")',
            )
        settings.append(RopeSettings(float(theta), rotated_fraction=float(fraction), factor=float(factor)))
    return settings[0], settings[1]


def _is_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def diffusion_gemma_26b_a4b_hf_config() -> dict[str, Any]:
    """google/diffusiongemma-26B-A4B-it's config.json, its text model (no vision_config): 30
    layers (five sliding, then one full, five times), D 2816, 16 query heads, 128 experts of which 8 per token.

    Sources: google-deepmind/gemma, gemma/diffusion/_models.py (``DiffusionGemma_A26B_A4B`` is
    ``Gemma4_26B_A4B`` plus self-conditioning of width embed_dim x hidden_dim) and
    gemma/gm/nn/gemma4/_gemma4.py (``Gemma4_26B_A4B``: embed 2816, 16 heads of 256, 8 kv heads,
    global key size 512 with 2 kv heads and K = V, dense MLP 2112, 128 experts of 704, top 8,
    window 1024, RoPE bases 10k / 1M with a quarter of the global pairs rotated, final softcap
    30, 262144 tokens); the checkpoint's config.json as quoted in public model ports (e.g. the
    mlx conversions of google/diffusiongemma-26B-A4B-it): the same values under transformers'
    names plus max_position_embeddings 262144, canvas_length 256, eos_token_id [1, 106, 50],
    pad 0, bos 2, rms_norm_eps 1e-6 and use_bidirectional_attention "vision". The model card
    (huggingface.co/google/diffusiongemma-26B-A4B-it) gives 30 layers, a 1024-token window and
    25.2B total / 3.8B active parameters; vLLM's recipe 128 experts with top-8 routing.
    """
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "canvas_length": 256,
        "eos_token_id": [1, 106, 50],
        "image_token_id": 258880,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "diffusion_gemma_text",
            "vocab_size": 262144,
            "hidden_size": 2816,
            "intermediate_size": 2112,
            "num_hidden_layers": 30,
            "layer_types": layer_types * 5,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "global_head_dim": 512,
            "num_global_key_value_heads": 2,
            "num_experts": 128,
            "top_k_experts": 8,
            "moe_intermediate_size": 704,
            "sliding_window": 1024,
            "max_position_embeddings": 262144,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "full_attention": {
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                    "rope_type": "proportional",
                },
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "use_bidirectional_attention": "vision",
        },
    }


def diffusion_gemma_26b_a4b_config(dtype: str = "bfloat16") -> DiffusionGemmaConfig:
    """The 26B-A4B model's config (diffusion_gemma_26b_a4b_hf_config, read) in this dtype."""
    return DiffusionGemmaConfig.from_hf_config(
        diffusion_gemma_26b_a4b_hf_config(), dtype=dtype, source="diffusion_gemma_26b_a4b_config"
    )
