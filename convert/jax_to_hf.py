"""Write dllm_jax parameters as a Hugging Face LLaDA or Dream checkpoint (config.json + safetensors,
and the generation_config.json a loaded model came with).

Used to ship the embedded tiny model and by the tests, which build small LLaDA- and Dream-format
checkpoints to exercise the real loading path. The output folder appears complete or not at
all: everything is written into a temporary sibling folder that is renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from dllm_jax.models.checkpoint.generation_config import GENERATION_CONFIG_FILE
from dllm_jax.models.checkpoint.tensor_names import leaf_shape, tensor_entries
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.transformer import Weights
from dllm_jax.text.tokenizer import TOKENIZER_FILES


def _leaf(params: Weights, path: tuple[str, ...]) -> jax.Array:
    node = params
    for key in path:
        node = node[key]
    return node


def hf_tensors(config: ModelConfig, params: Weights):
    """Yields (hf_name, numpy array in HF layout) for every tensor of the checkpoint."""
    for entry in tensor_entries(config):
        leaf = _leaf(params, entry.rule.path)
        expected = leaf_shape(entry.rule, config)
        if tuple(leaf.shape) != expected:
            raise ValueError(
                f"params{'/'.join(('',) + entry.rule.path)} has shape {tuple(leaf.shape)}, expected {expected}"
            )
        value = leaf[entry.layer] if entry.layer is not None else leaf
        value = np.asarray(jax.device_get(value))
        if entry.rule.transpose:
            value = value.T
        yield entry.hf_name, np.ascontiguousarray(value)


def save_hf_checkpoint(
    out_dir: str | Path,
    config: ModelConfig,
    params: Weights,
    *,
    max_shard_bytes: int | None = None,
    tokenizer_dir: str | Path | None = None,
    extra_config: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` (or shards plus the index).

    Args:
      out_dir: folder to create; it must not exist.
      config: the architecture; written as its family's config.json (plus ``extra_config`` keys).
      params: the params tree, in any float dtype (written as is).
      max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` shards of at most this
        many bytes (each tensor whole) with ``model.safetensors.index.json``; None = one file.
      tokenizer_dir: copy the tokenizer files found there.
      generation_config: written as ``generation_config.json`` (e.g. LoadedModel.generation_config,
        so that a converted folder's sampling defaults come back); None = none written.
    Returns:
      The output folder.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: output folder already exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        sizes = [0]
        total = 0
        for name, value in hf_tensors(config, params):
            if max_shard_bytes and shards[-1] and sizes[-1] + value.nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = value
            sizes[-1] += value.nbytes
            total += value.nbytes
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=metadata)
                weight_map.update({name: fname for name in shard})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf_config = config.to_hf_config()
        hf_config.update(extra_config or {})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        if generation_config is not None:
            (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config, indent=2) + "\n")
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
