"""What ``--model`` names, resolved the same way by every command line and by the library.

``resolve_model_path`` turns a name into a local folder: the folder itself, an embedded tiny model
("tiny-llada", "tiny-dream"), or a Hugging Face Hub id's snapshot in the local cache.
``read_model_config`` and ``load_tokenizer`` then read what a folder describes without its
weights. Nothing here imports JAX: a command line checks its input with these first.
"""

from __future__ import annotations

from pathlib import Path

from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.hf_config import CONFIG_FILE, config_from_hf, read_config
from dllm_jax.models.checkpoint.metadata import METADATA_FILE, is_converted, read_metadata
from dllm_jax.models.config import ConfigError, ModelConfig
from dllm_jax.models.embedded import EMBEDDED_MODELS, model_folder
from dllm_jax.text.tokenizer import Tokenizer, has_tokenizer_files

# The --model help of every command line (dllm-generate, dllm-serve), so they say the same.
MODEL_HELP = (
    "a Hugging Face LLaDA, Dream or DiffusionGemma folder, a converted one (dllm-convert), an embedded tiny model "
    f"({', '.join(EMBEDDED_MODELS)}), or a Hugging Face Hub id (ORG/NAME) found in the local Hugging Face "
    "cache (HF_HUB_CACHE; downloaded when not there, unless HF_HUB_OFFLINE=1); a local folder wins "
    "over the other kinds. Default: tiny-llada"
)


class ModelNotFoundError(ConversionError):
    """A model name that is neither a local folder nor a Hub id the Hugging Face cache holds."""


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


def resolve_model_path(name: str | Path | None) -> Path:
    """The local folder of a model (absolute): ``name`` itself when it exists, an embedded tiny
    model ("tiny-llada", "tiny-dream"; None: tiny-llada), else the snapshot of the Hub id ``name``
    (e.g. "GSAI-ML/LLaDA-8B-Instruct") in the Hugging Face cache.

    The cache is tried first; only when the model is not there and the Hub is not switched off
    (HF_HUB_OFFLINE) is it downloaded. The cache folder is huggingface_hub's (HF_HUB_CACHE, HF_HOME).

    Raises:
      ModelNotFoundError naming the model and where it was looked for.
    """
    if name is None:
        name = EMBEDDED_MODELS[0]
    try:
        path = model_folder(name)
    except (ValueError, FileNotFoundError) as e:
        raise ModelNotFoundError(str(e)) from None
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{name}: not a folder")
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
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise ModelNotFoundError(f"{name}: {where}, and downloading it failed ({reason})") from None


def read_model_config(path: str | Path, *, dtype: str) -> ModelConfig:
    """The architecture of a local model folder without reading any weights.

    Raises:
      ConversionError for a folder that is neither a converted nor a Hugging Face checkpoint,
      or whose config is malformed (the message names the file and key).
    """
    path = Path(path)
    if is_converted(path):
        try:
            return config_from_hf(read_metadata(path)["hf_config"], dtype=dtype, source=str(path / METADATA_FILE))
        except ConfigError as e:
            raise ConversionError(str(e)) from None
    if (path / CONFIG_FILE).is_file():
        return read_config(path, dtype=dtype)[0]
    raise not_a_model(path)


def not_a_model(path: Path) -> ConversionError:
    return ConversionError(
        f"{path}: neither a converted dllm_jax checkpoint (no {METADATA_FILE}) "
        f"nor a Hugging Face LLaDA, Dream or DiffusionGemma folder (no {CONFIG_FILE})"
    )


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a local model folder, or None when it holds no tokenizer files."""
    return Tokenizer.from_dir(path) if has_tokenizer_files(path) else None
