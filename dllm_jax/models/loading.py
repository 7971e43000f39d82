"""Load a model for inference: a converted dllm_jax folder, a Hugging Face folder, or a Hub id.

``load_model`` is three cheap steps and one expensive one, also callable one by one so that a
command line can check its input before the weights load: ``resolve_model_path`` (a name to a
local folder), ``read_model_config`` (config.json or the converted metadata only),
``load_tokenizer``, then the params.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dllm_jax.common.deprecation import warn_renamed
from dllm_jax.models.checkpoint.converted import METADATA_FILE, is_converted, load_converted, move_to_jax, read_metadata
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.hf_reader import CONFIG_FILE, read_checkpoint, read_config
from dllm_jax.models.config import ConfigError, ModelConfig
from dllm_jax.models.embedded import model_folder
from dllm_jax.models.quantization import QUANTIZATIONS, quantize_params
from dllm_jax.models.transformer import Weights
from dllm_jax.text.tokenizer import Tokenizer, has_tokenizer_files


class ModelNotFoundError(ConversionError):
    """A model name that is neither a local folder nor a Hub id the Hugging Face cache holds."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run.

    config: the architecture; ``config.dtype`` is the dtype of ``weights``.
    weights: the weights tree of jax arrays (layout: dllm_jax.models.transformer; `params` is
      its deprecated name).
    tokenizer: the folder's tokenizer, or None when it holds no tokenizer files.
    path: the local folder it came from (for a Hub id, its snapshot in the cache).
    """

    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | None
    path: Path

    @property
    def params(self) -> Weights:
        """Deprecated name of `weights`."""
        warn_renamed("LoadedModel.params", "LoadedModel.weights")
        return self.weights


def default_dtype() -> str:
    """The weights' dtype used when none is given: float32 on the CPU, bfloat16 on accelerators.

    The CPU has no fast bfloat16 matmuls (bfloat16 is slower there, and less exact); GPUs and
    TPUs are built for it and the weights take half the memory.
    """
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _looks_like_hub_id(name: str) -> bool:
    """True for "org/name" (or "name"): no leading "/", "." or "~", at most one "/"."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not name or name[0] in "/.~" or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model_path(name: str | Path) -> Path:
    """The local folder of a model (absolute): ``name`` itself when it exists, an embedded tiny
    model ("tiny-llada", "tiny-dream"), else the snapshot of the Hub id ``name`` (e.g.
    "GSAI-ML/LLaDA-8B-Instruct") in the Hugging Face cache.

    The cache is tried first; only when the model is not there and the Hub is not switched off
    (HF_HUB_OFFLINE) is it downloaded. The cache folder is huggingface_hub's (HF_HUB_CACHE, HF_HOME).

    Raises:
      ModelNotFoundError naming the model and where it was looked for.
    """
    path = model_folder(name)
    if path.exists():
        return path.absolute()  # orbax restores absolute paths only
    name = str(name)
    if not _looks_like_hub_id(name):
        raise ModelNotFoundError(f"{name}: model folder not found")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = f"not a local folder and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{name}: {where}; HF_HUB_OFFLINE is set, so it was not downloaded") from None
    try:
        return Path(snapshot_download(name))
    except Exception as e:  # network, authentication and missing-repository errors alike
        raise ModelNotFoundError(f"{name}: {where}, and downloading it failed ({type(e).__name__}: {e})") from None


def read_model_config(path: str | Path, *, dtype: str | None = None) -> ModelConfig:
    """The architecture of a local model folder without reading any weights.

    Raises:
      ConversionError for a folder that is neither a converted nor a Hugging Face checkpoint,
      or whose config is malformed (the message names the file and key).
    """
    path, dtype = Path(path), dtype or default_dtype()
    if is_converted(path):
        try:
            return ModelConfig.from_hf_config(
                read_metadata(path)["hf_config"], dtype=dtype, source=str(path / METADATA_FILE)
            )
        except ConfigError as e:
            raise ConversionError(str(e)) from None
    if (path / CONFIG_FILE).is_file():
        return read_config(path, dtype=dtype)[0]
    raise _not_a_model(path)


def _not_a_model(path: Path) -> ConversionError:
    return ConversionError(
        f"{path}: neither a converted dllm_jax checkpoint (no {METADATA_FILE}) "
        f"nor a Hugging Face LLaDA or Dream folder (no {CONFIG_FILE})"
    )


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a local model folder, or None when it holds no tokenizer files."""
    return Tokenizer.from_dir(path) if has_tokenizer_files(path) else None


def load_model(name: str | Path, *, dtype: str | None = None, quantization: str | None = None) -> LoadedModel:
    """Loads a converted folder (has dllm_jax_metadata.json), a Hugging Face LLaDA or Dream folder, or a
    Hub id from the Hugging Face cache (``resolve_model_path``; a local folder wins).

    A Hugging Face folder is converted in memory by the same streaming reader as
    ``python -m convert.hf_to_jax``; nothing is written. Weights are cast to ``dtype``
    (None: ``default_dtype()``). quantization: "none", "fp8" or "int8-weights"
    (dllm_jax.models.quantization); None = as the folder stores it (a Hugging Face folder: "none").

    Raises:
      ModelNotFoundError for a name that is neither a folder nor a cached (or downloadable) Hub id;
      ConversionError for a folder that is neither kind, or whose files are missing or malformed;
      TokenizerError for tokenizer files that cannot be loaded.
    """
    path = resolve_model_path(name)
    dtype = dtype or default_dtype()
    if is_converted(path):
        config, params = load_converted(path, dtype=dtype, quantization=quantization)
    elif (path / CONFIG_FILE).is_file():
        quantization = quantization or "none"
        if quantization not in QUANTIZATIONS:
            raise ConversionError(f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
        info, host_params = read_checkpoint(path, dtype=dtype)
        config = dataclasses.replace(info.config, quantization=quantization)
        params = move_to_jax(quantize_params(host_params, quantization))
    else:
        raise _not_a_model(path)
    return LoadedModel(config=config, weights=params, tokenizer=load_tokenizer(path), path=path)
