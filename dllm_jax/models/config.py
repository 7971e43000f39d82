"""Model configuration: a frozen dataclass read from a Hugging Face ``config.json``.

Two families: LLaDA (``model_type`` "llada", LLaDA's own key names) and Dream
(``model_type`` "Dream", Qwen2's key names: q/k/v biases, grouped-query attention, logits
shifted by one). A folder's ``auto_map`` (its own modeling code) is never read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS, quantizes_embedding

if TYPE_CHECKING:
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

# Keys of a Dream config.json whose value must be this (when present).
_DREAM_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu",
    "rope_scaling": None,
    "use_sliding_window": False,
}

# Dream's tokenizer: <|endoftext|> ends (and pads) a sequence, <|mask|> is the mask token.
DREAM_EOS_TOKEN_ID = 151643
DREAM_MASK_TOKEN_ID = 151666

_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
FAMILIES = ("llada", "dream")
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
    """Architecture of a masked diffusion LM of the LLaDA or Dream family (bidirectional blocks).

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
      quantization: "none", "fp8" or "int8-weights": 8-bit block projections and (unless
        weight_tying) an int8 embedding (dllm_jax.models.quantization); a load-time choice, not part
        of config.json.
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
    quantization: str = "none"

    def __post_init__(self):
        def check(name: str, problem: str | None) -> None:
            if problem:
                raise ConfigError(f"{name}={getattr(self, name)!r}: {problem}")

        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}: expected one of {FAMILIES}")
        for name in (
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "mlp_hidden_size",
            "vocab_size",
            "max_sequence_length",
        ):
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
        for name in ("weight_tying", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                check(name, "expected true or false")
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
    def logit_shift(self) -> int:
        """How far before its position a token's prediction sits: the logit row of position
        i - logit_shift predicts token i (0 for LLaDA, 1 for Dream)."""
        return 1 if self.family == "dream" else 0

    @property
    def jnp_dtype(self) -> jnp.dtype:
        import jax.numpy as jnp  # here: reading a config (a command line's input check) imports no JAX

        return jnp.dtype(self.dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end an answer (one here; DiffusionGemma has several)."""
        return (self.eos_token_id,)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no allocation)."""
        D, F, V = self.d_model, self.mlp_hidden_size, self.vocab_size
        attention = D * self.n_heads * self.head_dim * 2 + D * self.kv_dim * 2
        if self.qkv_bias:
            attention += self.n_heads * self.head_dim + 2 * self.kv_dim
        per_layer = attention + 3 * D * F + 2 * D
        head = 0 if self.weight_tying else V * D
        return self.n_layers * per_layer + V * D + D + head

    def weight_bytes(self) -> int:
        """Bytes of the params tree (dllm_jax.models), computed from the shapes (no allocation).

        Every leaf is in the model dtype, except with quantization: each block projection's
        weights take 1 byte plus a float32 scale per output channel, and an untied embedding
        1 byte per entry plus a float32 scale per row (dllm_jax.models.quantization).
        """
        itemsize = self.jnp_dtype.itemsize
        if self.quantization == "none":
            return self.num_params() * itemsize
        D, F, V, q = self.d_model, self.mlp_hidden_size, self.vocab_size, self.n_heads * self.head_dim
        projections = [(D, q), (D, self.kv_dim), (D, self.kv_dim), (q, D), (D, F), (D, F), (F, D)]  # [in, out]
        quantized = self.n_layers * sum(i * o for i, o in projections)
        stored = self.n_layers * sum(i * o + 4 * o for i, o in projections)
        if quantizes_embedding(self.quantization, self.weight_tying):
            quantized += V * D
            stored += V * D + 4 * V
        return (self.num_params() - quantized) * itemsize + stored

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, dtype: str = "bfloat16", source: str = "config.json") -> ModelConfig:
        """Builds the config from a parsed Hugging Face LLaDA or Dream ``config.json``.

        Every key is checked for its type and range before anything is built: sizes are
        positive integers (never bools, strings or floats), rope_theta and rms_norm_eps finite
        positive numbers, token ids integers in [0, vocab). Optional keys that HF configs set
        to null (n_kv_heads, mlp_hidden_size, embedding_size, pad_token_id, bos_token_id) mean
        their default; any other null is an error.

        A Dream config (model_type "Dream") uses Qwen2's key names (hidden_size,
        num_attention_heads, num_key_value_heads, intermediate_size, ...), checked the same way.

        Raises ConfigError "SOURCE: KEY=VALUE: expected ..." for a missing key, a value of the
        wrong type or range, or an unsupported option (alibi, biases, qk-norm, a non-RMS norm, ...).
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        keys = _ConfigKeys(hf, source)
        model_type = hf.get("model_type", "llada")
        family = model_type.lower() if isinstance(model_type, str) else None
        if family == "dream":
            return _dream_config(keys, dtype)
        if family != "llada":
            raise ConfigError(
                f'{source}: model_type={_show(model_type)} is not supported (expected "llada" or "Dream")'
            )
        keys.require_values(_REQUIRED_VALUES)
        fail, given, size, positive_real, flag = (
            keys.fail,
            keys.given,
            keys.size,
            keys.positive_real,
            keys.flag,
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
        mask = keys.token_id("mask_token_id", vocab)
        eos = keys.token_id("eos_token_id", vocab)
        pad = keys.token_id("pad_token_id", vocab) if given("pad_token_id") else eos
        bos = keys.token_id("bos_token_id", vocab) if given("bos_token_id") else None
        with keys.naming_source():
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

    @classmethod
    def from_json_file(cls, path: str | Path, *, dtype: str = "bfloat16") -> ModelConfig:
        """Reads and checks a config.json; any problem is a ConfigError naming the file."""
        return cls.from_hf_config(read_config_json(Path(path)), dtype=dtype, source=str(path))

    def to_hf_config(self) -> dict[str, Any]:
        """The family's ``config.json`` dictionary describing this architecture."""
        if self.family == "dream":
            return _dream_hf_config(self)
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


def read_config_json(path: Path) -> Any:
    """The parsed config.json; any problem reading it is a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None


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


def dream_7b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Dream-v0-Base/Instruct-7B architecture (published config.json; Qwen2.5-7B shaped)."""
    return ModelConfig.from_hf_config(
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


class _ConfigKeys:
    """Reads the keys of one parsed config.json; every problem is a ConfigError
    "SOURCE: KEY=VALUE: expected ..."."""

    def __init__(self, hf: dict[str, Any], source: str):
        self.hf, self.source = hf, source

    def fail(self, key: str, problem: str) -> None:
        raise ConfigError(f"{self.source}: {key}={_show(self.hf[key])}: {problem}")

    def need(self, key: str) -> Any:
        if key not in self.hf:
            raise ConfigError(f"{self.source}: missing required key {key!r}")
        return self.hf[key]

    def given(self, key: str) -> bool:
        """The key is present and not null (for the keys whose null means 'the default')."""
        return self.hf.get(key) is not None

    def checked(self, key: str, problem: str | None) -> Any:
        if problem:
            self.fail(key, problem)
        return self.hf[key]

    def size(self, key: str) -> int:
        return self.checked(key, _size_problem(self.need(key)))

    def token_id(self, key: str, vocab: int) -> int:
        return self.checked(key, _token_id_problem(self.need(key), vocab))

    def positive_real(self, key: str, default: float) -> float:
        return float(self.checked(key, _positive_real_problem(self.hf[key]))) if key in self.hf else default

    def flag(self, key: str) -> bool:
        return key in self.hf and self.checked(
            key, None if isinstance(self.hf[key], bool) else "expected true or false"
        )

    def require_values(self, required: dict[str, Any]) -> None:
        """Each key of ``required`` that is present holds exactly its value there."""
        for key, expected in required.items():
            if key in self.hf and not _same_json_value(self.hf[key], expected):
                raise ConfigError(
                    f"{self.source}: unsupported option {key}={_show(self.hf[key])} (dllm_jax implements only "
                    f"{key}={_show(expected)})"
                )

    @contextlib.contextmanager
    def naming_source(self) -> Iterator[None]:
        """ModelConfig's own checks (divisibility, ...) raised inside name the file."""
        try:
            yield
        except ConfigError as e:
            raise ConfigError(f"{self.source}: {e}") from None


def _dream_config(keys: _ConfigKeys, dtype: str) -> ModelConfig:
    """The ModelConfig of a Dream ``config.json`` (model_type "Dream": Dream-v0, Dream-Coder,
    DiffuCoder). Qwen2 blocks: q/k/v biases, no o/MLP biases, GQA, rotate-half RoPE.

    ``auto_map`` (the folder's own modeling code) is ignored: nothing is imported or run.
    Optional keys set to null (num_key_value_heads, head_dim, pad/bos/mask/eos token ids)
    mean their default.
    """
    hf, given, size = keys.hf, keys.given, keys.size
    keys.require_values(_DREAM_REQUIRED_VALUES)
    d_model = size("hidden_size")
    n_heads = size("num_attention_heads")
    n_kv_heads = size("num_key_value_heads") if given("num_key_value_heads") else n_heads
    if given("head_dim") and size("head_dim") * n_heads != d_model:
        keys.fail(
            "head_dim", f"head_dim * num_attention_heads = {hf['head_dim'] * n_heads}: expected hidden_size={d_model}"
        )
    vocab = size("vocab_size")

    def token_id(key: str, default: int | None) -> int | None:
        if not given(key):
            return default
        if isinstance(hf[key], list):  # generation configs may list several; the first ends a sequence
            if not hf[key]:
                keys.fail(key, "expected a token id or a non-empty list of token ids")
            problem = next((p for p in (_token_id_problem(v, vocab) for v in hf[key]) if p), None)
            return keys.checked(key, problem)[0]
        return keys.token_id(key, vocab)

    eos = token_id("eos_token_id", DREAM_EOS_TOKEN_ID)
    with keys.naming_source():
        return ModelConfig(
            d_model=d_model,
            n_layers=size("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            mlp_hidden_size=size("intermediate_size"),
            vocab_size=vocab,
            rope_theta=keys.positive_real("rope_theta", 10000.0),
            rms_norm_eps=keys.positive_real("rms_norm_eps", 1e-6),
            mask_token_id=token_id("mask_token_id", DREAM_MASK_TOKEN_ID),
            eos_token_id=eos,
            pad_token_id=token_id("pad_token_id", eos),
            bos_token_id=token_id("bos_token_id", None),
            max_sequence_length=size("max_position_embeddings") if "max_position_embeddings" in hf else 32768,
            weight_tying=keys.flag("tie_word_embeddings"),
            family="dream",
            qkv_bias=True,
            dtype=dtype,
        )


def _dream_hf_config(config: ModelConfig) -> dict[str, Any]:
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
