"""Model configuration: a frozen dataclass read from a Hugging Face LLaDA ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from dllm_jax.quantization import QUANTIZATIONS

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
# Sizes and token ids are indexed with int32 on the device.
_INT32_LIMIT = 2**31


class ConfigError(ValueError):
    """A model config that dllm_jax cannot run; the message names the key."""


def _is_int(value: Any) -> bool:
    """An integer and not a bool (True is an int in Python; in a config it is a mistake)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _size_problem(value: Any) -> str | None:
    """Why ``value`` is not a size (a positive integer below 2**31), or None when it is."""
    if not _is_int(value) or not 0 < value < _INT32_LIMIT:
        return "expected a positive integer below 2**31"
    return None


def _positive_real_problem(value: Any) -> str | None:
    """Why ``value`` is not a finite positive number, or None when it is."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        return "expected a finite positive number"
    return None


def _token_id_problem(value: Any, vocab_size: int) -> str | None:
    """Why ``value`` is not a token id of a vocabulary of ``vocab_size``, or None when it is."""
    if not _is_int(value) or not 0 <= value < vocab_size:
        return f"expected an integer token id in [0, {vocab_size})"
    return None


def _show(value: Any) -> str:
    """A config value as it is written in JSON (null, true, "128"), for messages."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _same_json_value(actual: Any, expected: Any) -> bool:
    """Equality that also compares types, so 0 is not false and 1.0 is not 1."""
    return type(actual) is type(expected) and actual == expected


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
      dtype: dtype of the weights and activations ("bfloat16" for serving, "float32" in tests);
        matmuls and attention accumulate in float32 either way.
      quantization: "none", "fp8" or "int8-weights": 8-bit block projections
        (dllm_jax.quantization); a load-time choice, not part of config.json.
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
    dtype: str = "bfloat16"
    quantization: str = "none"

    def __post_init__(self):
        def check(name: str, problem: str | None) -> None:
            if problem:
                raise ConfigError(f"{name}={getattr(self, name)!r}: {problem}")

        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "vocab_size",
                     "max_sequence_length"):
            check(name, _size_problem(getattr(self, name)))
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            check(name, _token_id_problem(getattr(self, name), self.vocab_size))
        if self.bos_token_id is not None:
            check("bos_token_id", _token_id_problem(self.bos_token_id, self.vocab_size))
        for name in ("rope_theta", "rms_norm_eps"):
            check(name, _positive_real_problem(getattr(self, name)))
        if not isinstance(self.weight_tying, bool):
            check("weight_tying", "expected true or false")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: expected one of {_SUPPORTED_DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r}: expected one of {QUANTIZATIONS}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of one position's key (or value) row: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no allocation)."""
        D, F, V = self.d_model, self.mlp_hidden_size, self.vocab_size
        attention = D * self.n_heads * self.head_dim * 2 + D * self.kv_dim * 2
        per_layer = attention + 3 * D * F + 2 * D
        head = 0 if self.weight_tying else V * D
        return self.n_layers * per_layer + V * D + D + head

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, dtype: str = "bfloat16", source: str = "config.json") -> ModelConfig:
        """Builds the config from a parsed Hugging Face LLaDA ``config.json``.

        Every key is checked for its type and range before anything is built: sizes are
        positive integers (never bools, strings or floats), rope_theta and rms_norm_eps finite
        positive numbers, token ids integers in [0, vocab). Optional keys that HF configs set
        to null (n_kv_heads, mlp_hidden_size, embedding_size, pad_token_id, bos_token_id) mean
        their default; any other null is an error.

        Raises ConfigError "SOURCE: KEY=VALUE: expected ..." for a missing key, a value of the
        wrong type or range, or an unsupported option (alibi, biases, qk-norm, a non-RMS norm, ...).
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")

        def fail(key: str, problem: str) -> None:
            raise ConfigError(f"{source}: {key}={_show(hf[key])}: {problem}")

        def need(key: str) -> Any:
            if key not in hf:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return hf[key]

        def given(key: str) -> bool:
            """The key is present and not null (for the keys whose null means 'the default')."""
            return hf.get(key) is not None

        def checked(key: str, problem: str | None) -> Any:
            if problem:
                fail(key, problem)
            return hf[key]

        def size(key: str) -> int:
            return checked(key, _size_problem(need(key)))

        def token_id(key: str) -> int:
            return checked(key, _token_id_problem(need(key), vocab))

        def positive_real(key: str, default: float) -> float:
            return float(checked(key, _positive_real_problem(hf[key]))) if key in hf else default

        def flag(key: str) -> bool:
            return key in hf and checked(key, None if isinstance(hf[key], bool) else "expected true or false")

        model_type = hf.get("model_type", "llada")
        if not isinstance(model_type, str) or model_type.lower() != "llada":
            raise ConfigError(f"{source}: model_type={_show(model_type)} is not supported (only \"llada\")")
        for key, expected in _REQUIRED_VALUES.items():
            if key in hf and not _same_json_value(hf[key], expected):
                raise ConfigError(
                    f"{source}: unsupported option {key}={_show(hf[key])} (dllm_jax implements only "
                    f"{key}={_show(expected)})"
                )
        if given("multi_query_attention") and flag("multi_query_attention"):
            raise ConfigError(f"{source}: unsupported option multi_query_attention=true; use n_kv_heads instead")

        d_model = size("d_model")
        n_layers = size("n_layers")
        n_heads = size("n_heads")
        n_kv_heads = size("n_kv_heads") if given("n_kv_heads") else n_heads
        if given("mlp_hidden_size"):
            mlp = size("mlp_hidden_size")
        else:
            mlp = size("mlp_ratio") * d_model
            if mlp >= _INT32_LIMIT:
                fail("mlp_ratio", f"mlp_ratio * d_model = {mlp}: expected below 2**31")
        if given("embedding_size"):
            vocab = size("embedding_size")
            if "vocab_size" in hf and size("vocab_size") > vocab:
                fail("vocab_size", f"exceeds embedding_size={vocab}")
        else:
            vocab = size("vocab_size")
        rope_theta = positive_real("rope_theta", 10000.0)
        rms_norm_eps = positive_real("rms_norm_eps", 1e-5)
        max_sequence_length = size("max_sequence_length") if "max_sequence_length" in hf else 4096
        weight_tying = flag("weight_tying")
        mask = token_id("mask_token_id")
        eos = token_id("eos_token_id")
        pad = token_id("pad_token_id") if given("pad_token_id") else eos
        bos = token_id("bos_token_id") if given("bos_token_id") else None
        try:
            return cls(
                d_model=d_model,
                n_layers=n_layers,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                mlp_hidden_size=mlp,
                vocab_size=vocab,
                rope_theta=rope_theta,
                rms_norm_eps=rms_norm_eps,
                mask_token_id=mask,
                eos_token_id=eos,
                pad_token_id=pad,
                bos_token_id=bos,
                max_sequence_length=max_sequence_length,
                weight_tying=weight_tying,
                dtype=dtype,
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path, *, dtype: str = "bfloat16") -> ModelConfig:
        """Reads and checks a config.json; any problem is a ConfigError naming the file."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not valid JSON (not UTF-8 text)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
        return cls.from_hf_config(hf, dtype=dtype, source=str(path))

    def to_hf_config(self) -> dict[str, Any]:
        """The LLaDA ``config.json`` dictionary describing this architecture."""
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
