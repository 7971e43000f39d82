"""Stream a Hugging Face checkpoint (config.json + safetensors) of LLaDA, Dream or DiffusionGemma
(its text model) into a dllm_jax params tree.

Each output leaf is allocated once, in the target dtype, and every tensor is copied into its
slot in blocks of rows straight from the memory-mapped shard (cast and transposed on the way,
as the family's table in ``tensor_names.py`` beside this file says). Host memory therefore holds the output being built plus
the pages of the one shard being read, never a second copy of the model.

Everything about the input is checked against the table before or while it is read: the shard
list, names, shapes and dtypes; anything wrong is a ConversionError naming file and tensor.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dllm_jax.common.json_file import read_json
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.hf_config import read_config
from dllm_jax.models.checkpoint.tensor_names import TensorEntry, is_skipped, leaf_shape, rules_for, tensor_entries
from dllm_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype codes a floating-point checkpoint may use; each is cast to the target dtype.
_ACCEPTED_DTYPES = ("F16", "BF16", "F32")
# Size of one row block copied from a shard: bounds the temporary copy of a large tensor
# (a 126464 x 4096 embedding is 1 GB in bf16).
_BLOCK_BYTES = 64 * 2**20
# Size bound of model.safetensors.index.json (a 1000-shard model's index is a few MB).
_MAX_INDEX_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class HFCheckpointInfo:
    """What was read besides the parameters.

    config: the architecture, with ``dtype`` set to the dtype of the params that were built.
    hf_config: the parsed config.json.
    tensor_count: number of tensors read from the shards.
    source: the Hugging Face folder, resolved.
    skipped: names of the tensors not read (a DiffusionGemma checkpoint's vision tower).
    """

    config: ModelConfig
    hf_config: dict[str, Any]
    tensor_count: int
    source: Path
    skipped: tuple[str, ...] = ()


def shard_files(hf_dir: Path, config: ModelConfig) -> list[Path]:
    """The safetensors files of the checkpoint, each checked to exist before anything is read.

    With ``model.safetensors.index.json`` the shards are the files its ``weight_map`` names, and
    its tensor names must be exactly those of the table; otherwise ``model.safetensors`` alone.
    """
    index_path = hf_dir / INDEX_FILE
    if not index_path.is_file():
        single = hf_dir / SINGLE_FILE
        if not single.is_file():
            raise ConversionError(f"{hf_dir}: no {INDEX_FILE} and no {SINGLE_FILE}")
        return [single]
    weight_map = _read_weight_map(index_path)
    _check_names(index_path, set(weight_map), config)
    shards = [hf_dir / name for name in sorted(set(weight_map.values()))]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ConversionError(f"{index_path}: shard file(s) named by the index not found: {', '.join(missing)}")
    return shards


def read_checkpoint(hf_dir: str | Path, *, dtype: str = "bfloat16") -> tuple[HFCheckpointInfo, dict[str, Any]]:
    """Reads a Hugging Face LLaDA, Dream or DiffusionGemma (text model) folder into host memory.

    Args:
      hf_dir: folder with config.json and model.safetensors (or shards plus their index).
      dtype: "bfloat16", "float16" or "float32"; every tensor is cast to it.
    Returns:
      (info, params): params is the nested dict of numpy arrays of dllm_jax.models' layout
      (e.g. ``params["layers"]["q_proj"]["kernel"]`` is [NL, D, H*Dh]) in ``dtype``.
    Raises:
      ConversionError naming the file / tensor for any missing, unexpected or malformed input.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir}: checkpoint folder not found")
    config, hf_config = read_config(hf_dir, dtype=dtype)
    shards = shard_files(hf_dir, config)
    entries = {entry.hf_name: entry for entry in tensor_entries(config)}
    params = _allocate(config)
    found: dict[str, Path] = {}
    skipped: list[str] = []
    with tqdm(total=len(entries), unit="tensor", desc=f"reading {hf_dir.name}", disable=None) as progress:
        for shard in shards:
            _read_shard(shard, config, entries, params, found, skipped, progress)
    missing = [name for name in entries if name not in found]
    if missing:
        raise ConversionError(f"{hf_dir}: missing tensor(s) {_some(missing)}")
    if skipped:
        log.warning("%s: loaded the text model only; %d tensors of the vision tower not read", hf_dir, len(skipped))
    info = HFCheckpointInfo(
        config=config, hf_config=hf_config, tensor_count=len(found), source=hf_dir.resolve(), skipped=tuple(skipped)
    )
    return info, params


def _read_weight_map(index_path: Path) -> dict[str, str]:
    index = read_json(index_path, max_bytes=_MAX_INDEX_BYTES, error=ConversionError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(
            f"{index_path}: expected an object with a non-empty 'weight_map' (tensor name -> shard file)"
        )
    for name, file_name in weight_map.items():
        # A shard is a plain file of the checkpoint folder; anything else (a path, a number) is malformed.
        if not isinstance(file_name, str) or not file_name or Path(file_name).name != file_name:
            raise ConversionError(
                f"{index_path}: weight_map[{name!r}] = {file_name!r} is not a file name in the folder"
            )
    return weight_map


def _check_names(index_path: Path, names: set[str], config: ModelConfig) -> None:
    """Fails before any shard is opened when the index does not list exactly the table's tensors."""
    expected = [entry.hf_name for entry in tensor_entries(config)]
    unexpected = sorted(name for name in names.difference(expected) if not is_skipped(config, name))
    if unexpected:
        raise ConversionError(f"{index_path}: unexpected tensor(s) {_some(unexpected)} for this config.json")
    missing = [name for name in expected if name not in names]
    if missing:
        raise ConversionError(f"{index_path}: missing tensor(s) {_some(missing)}")


def _allocate(config: ModelConfig) -> dict[str, Any]:
    """The params tree of uninitialised numpy leaves in config.dtype (pages are touched as tensors land)."""
    params: dict[str, Any] = {}
    for rule in rules_for(config):
        node = params
        for key in rule.path[:-1]:
            node = node.setdefault(key, {})
        node[rule.path[-1]] = np.empty(leaf_shape(rule, config), dtype=config.jnp_dtype)
    return params


def _read_shard(
    shard: Path,
    config: ModelConfig,
    entries: dict[str, TensorEntry],
    params: dict[str, Any],
    found: dict[str, Path],
    skipped: list[str],
    progress: tqdm,
) -> None:
    """Copies every tensor of one shard into its leaf, checking name, shape and dtype first;
    the family's skipped tensors are listed in ``skipped``, not read."""
    try:
        with safe_open(str(shard), framework="np") as f:
            for name in f.keys():
                if is_skipped(config, name):
                    skipped.append(name)
                    continue
                entry = entries.get(name)
                if entry is None:
                    raise ConversionError(
                        f"{shard}: unexpected tensor {name!r} (not part of a checkpoint of this config.json)"
                    )
                if name in found:
                    raise ConversionError(f"{shard}: tensor {name!r} is also stored in {found[name].name}")
                tensor = f.get_slice(name)
                shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
                if shape != entry.hf_shape:
                    raise ConversionError(
                        f"{shard}: tensor {name!r} has shape {shape}, expected {entry.hf_shape} from config.json"
                    )
                if dtype not in _ACCEPTED_DTYPES:
                    raise ConversionError(
                        f"{shard}: tensor {name!r} has dtype {dtype}, expected one of {', '.join(_ACCEPTED_DTYPES)}"
                    )
                _copy_into_leaf(tensor, entry, params)
                found[name] = shard
                progress.update()
    except (SafetensorError, OSError) as e:
        raise ConversionError(f"{shard}: not a readable safetensors file ({e})") from None


def _copy_into_leaf(tensor: Any, entry: TensorEntry, params: dict[str, Any]) -> None:
    """Writes one HF tensor (a safetensors slice, HF layout) into its slot of the params tree."""
    leaf = params
    for key in entry.rule.path:
        leaf = leaf[key]
    target = leaf[entry.layer] if entry.layer is not None else leaf
    rows = entry.hf_shape[0]
    row_bytes = math.prod(entry.hf_shape[1:]) * 4  # 4: the widest accepted source dtype (F32)
    step = max(1, _BLOCK_BYTES // row_bytes)
    for start in range(0, rows, step):
        stop = min(start + step, rows)  # safetensors slices, unlike numpy, refuse to run past the end
        # [stop - start, ...] rows of the HF tensor; the assignment casts to the target dtype
        block = tensor[start:stop]
        if entry.rule.transpose:
            target[:, start:stop] = block.T
        else:
            target[start:stop] = block


def _some(names: list[str], limit: int = 8) -> str:
    """A readable list of names, cut after ``limit``."""
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
