"""The converted dllm_jax checkpoint folder: an orbax params tree plus a small metadata file.

Layout::

  params/                  orbax checkpoint of the params tree (layout: dllm_jax.models)
  dllm_jax_metadata.json   {"format_version", "hf_config", "dtype", "tensor_count", "source"}
  tokenizer files          copied from the Hugging Face folder when present
  generation_config.json   likewise (the sampling defaults the model was published with)

Memory: orbax deep-copies numpy leaves before writing them (all at once), which would double
the host footprint, so the tree is moved to jax arrays one leaf at a time and written through
orbax's jax.Array handler, uncompressed (compressed chunks are held until the checkpoint
commits). Its host copies, and the buffers of a restore, are limited to what
``_one_leaf_at_a_time`` allows in flight: peak = the params plus about their largest leaf.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dllm_jax.common.late_callbacks import tolerant_event_loops
from dllm_jax.common.quiet_logs import quiet_logs
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.hf_config import config_from_hf
from dllm_jax.models.checkpoint.metadata import FORMAT_VERSION, METADATA_FILE, read_metadata
from dllm_jax.models.config import ConfigError, ModelConfig
from dllm_jax.models.quantization import quantize_params
from dllm_jax.models.transformer import Weights, abstract_params

PARAMS_DIR = "params"


def _one_leaf_at_a_time(largest_leaf_bytes: int) -> int:
    """The in-flight byte limit for orbax: it refuses any single array at or above the limit,
    so the limit sits just above the largest leaf and the largest leaf travels alone."""
    return largest_leaf_bytes + 1


def move_to_jax(params: dict[str, Any]) -> Weights:
    """Returns the tree with jax arrays on the default device, emptying ``params`` as it goes.

    Each numpy leaf is dropped as soon as its copy exists, so host memory grows by at most one
    leaf instead of by the whole tree. The caller must hold no other reference to the leaves.
    """
    moved = {}
    for key in list(params):
        value = params.pop(key)
        if isinstance(value, dict):
            moved[key] = move_to_jax(value)
        else:
            moved[key] = jax.device_put(value).block_until_ready()
        del value
    return moved


def write_metadata(
    folder: Path, *, hf_config: dict[str, Any], dtype: str, tensor_count: int, source: Path, quantization: str = "none"
) -> None:
    """Writes ``folder/dllm_jax_metadata.json``: what loading needs to rebuild the config, and provenance."""
    metadata = {
        "format_version": FORMAT_VERSION,
        "hf_config": hf_config,
        "dtype": dtype,
        "quantization": quantization,
        "tensor_count": tensor_count,
        "source": str(source),
    }
    (folder / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def save_params(path: Path, params: Weights) -> None:
    """Writes a params tree of jax arrays as an orbax checkpoint at ``path`` (which must not exist).

    Raises whatever orbax / TensorStore / the OS raise on a write failure (the caller names
    the output folder).
    """
    largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
    handler = ocp.BasePyTreeCheckpointHandler(
        save_device_host_concurrent_bytes=_one_leaf_at_a_time(largest),
        # zstd output is buffered until the whole checkpoint commits: with compression the
        # save holds a second (compressed) copy of the params
        use_compression=False,
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(handler_impl=handler)) as checkpointer:
        checkpointer.save(path.absolute(), args=ocp.args.PyTreeSave(params))


def load_converted(folder: Path, *, dtype: str, quantization: str | None = None) -> tuple[ModelConfig, Weights]:
    """Config and params (jax arrays in ``dtype``, cast on restore) of a converted folder.

    quantization: None = as stored; a folder stored unquantized can be quantized on load,
    a quantized one loads only as it was stored.
    """
    metadata = read_metadata(folder)
    stored = metadata["quantization"]
    wanted = stored if quantization is None else quantization
    if stored != "none" and wanted != stored:
        raise ConversionError(
            f"{folder / METADATA_FILE}: the params are stored with quantization={stored!r}; "
            f"they cannot be loaded as quantization={wanted!r} (convert the original checkpoint again)"
        )
    try:
        config = config_from_hf(metadata["hf_config"], dtype=dtype, source=str(folder / METADATA_FILE))
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    params_dir = folder / PARAMS_DIR
    if not params_dir.is_dir():
        raise ConversionError(f"{params_dir}: params checkpoint folder not found")
    params = _restore_params(
        params_dir, dataclasses.replace(config, quantization=stored), stored_dtype=metadata["dtype"]
    )
    return dataclasses.replace(config, quantization=wanted), quantize_params(
        params, wanted if stored == "none" else "none"
    )


def _restore_params(path: Path, config: ModelConfig, *, stored_dtype: str) -> Weights:
    """Restores into the tree, shapes and dtype that ``config`` describes (orbax refuses other shapes).

    stored_dtype: the dtype on disk; a leaf's read buffer is the larger of it and config.dtype.
    """
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = (dg.abstract_params if config.family == "diffusion_gemma" else abstract_params)(config)
    target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), abstract)
    itemsize = max(jnp.dtype(stored_dtype).itemsize, config.jnp_dtype.itemsize)
    largest = max(leaf.size for leaf in jax.tree.leaves(abstract)) * itemsize
    handler = ocp.BasePyTreeCheckpointHandler(restore_concurrent_bytes=_one_leaf_at_a_time(largest))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    try:
        # a damaged file fails every read in flight: asyncio logs each one with its traceback, and
        # reads finishing after orbax closed its loop would print theirs (tolerant_event_loops)
        with (
            quiet_logs(),
            tolerant_event_loops(),
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler(handler_impl=handler)) as checkpointer,
        ):
            return checkpointer.restore(
                path.absolute(), args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
            )
    except Exception as e:  # orbax / tensorstore report damaged files with many exception types
        difference = _tree_difference(path, abstract)
        if difference:
            raise ConversionError(
                f"{path}: the stored params are not the tree this dllm_jax builds for quantization="
                f"{config.quantization!r} ({difference}): convert the original checkpoint again"
            ) from None
        raise ConversionError(f"{path}: cannot restore the params ({root_cause(e)})") from None


def _tree_difference(path: Path, expected: Weights) -> str | None:
    """'missing wte/qembedding; not expected wte/embedding' when the leaf names of the checkpoint
    at ``path`` differ from ``expected``'s (e.g. an 8-bit checkpoint written before the
    embedding was stored in int8); None when they match or the stored names cannot be read."""
    try:
        with quiet_logs(), tolerant_event_loops(), ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            stored = checkpointer.metadata(path.absolute()).item_metadata.tree
    except Exception:  # noqa: BLE001 - only an explanation of an error already being raised
        return None

    def names(tree) -> set[str]:
        return {
            "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
            for keys, _ in jax.tree_util.tree_leaves_with_path(tree)
        }

    missing, extra = sorted(names(expected) - names(stored)), sorted(names(stored) - names(expected))
    parts = [f"missing {', '.join(missing)}"] * bool(missing) + [f"not expected {', '.join(extra)}"] * bool(extra)
    return "; ".join(parts) or None


def root_cause(error: BaseException, limit: int = 300) -> str:
    """One line for the innermost exception of a chain: orbax wraps TensorStore's precise
    error ("DATA_LOSS: Error reading ... in OCDBT database ...") in a generic one whose text
    is a multi-line dump of the TensorStore spec."""
    seen = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    text = lines[0].split(" [tensorstore_spec=")[0] if lines else ""
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
