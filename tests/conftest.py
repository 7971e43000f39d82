"""Shared test fixtures. Tests run on the CPU; Pallas kernels run in interpret mode."""

import atexit
import dataclasses
import logging
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The command lines the tests start keep no compiled loops in ~/.cache (tests of the cache set their own).
os.environ.setdefault("DLLM_JAX_COMPILE_CACHE", "off")

from jaxlib import version as _jaxlib_version  # noqa: E402 (reads no XLA flag)

# XLA:CPU's code generation at its lowest optimization level, in this process and the ones the
# tests start (they inherit XLA_FLAGS). A tiny decode loop then compiles in about a third of the
# time and runs a few times slower; the suite is compile-bound (about 100 distinct loops, each run
# for well under a second), so this halves its CPU time. Only how the host code is optimized
# changes: the programs, their HLO and what the tests check are the same. Flags already in
# XLA_FLAGS come after these and win.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if _jaxlib_version.__version_info__ < (0, 11):  # XLA:CPU of jaxlib 0.11 has no such flag (an unknown flag is fatal)
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()

# Compiler options for an engine whose test runs its loop much longer than it compiles it (held-out
# evaluations on the embedded models, hundreds of steps): XLA's default optimization level, which
# TEST_XLA_FLAGS lowers for the rest of the suite (those loops run about twice as fast with it).
RUN_HEAVY_COMPILER_OPTIONS = {"xla_backend_optimization_level": 2}

# One XLA compilation cache for the whole run: this process, pytest-xdist's workers and every
# process the tests start (servers, command lines, scripts) read and write the same temporary
# folder, removed at exit, so nothing persists from one run to the next (a fresh clone's first
# run is what is timed). A program compiled once (the same HLO, devices and compiler options: a
# loop another test, worker, server or command line already compiled) is read back instead of
# compiled again. Only a speed-up: every process still traces and lowers its own programs, and a
# server's dllm_compilations_after_warmup counts cache hits as compilations (jax reports both as
# one backend-compile event). The first process (pytest itself, or xdist's controller) makes the
# folder; the workers and the processes the tests start inherit JAX_COMPILATION_CACHE_DIR.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="dllm-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
# Every program goes into that cache, not only those that took a second to compile (jax's
# default): each module's jax.clear_caches (below) would otherwise compile the same small
# programs (an op at a shape, a model's init, a jitted reference) again in every module. On the
# 2-core machine this took the quick tier from 418 to 345 s (2026-12-07, one run each).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# before jax is imported: it reads JAX_COMPILATION_CACHE_DIR then
import jax  # noqa: E402
import pytest  # noqa: E402

# Four CPU devices, so the sharded tests run on a real mesh; unsharded code uses the first.
# Must be set before JAX's backend starts (nothing here or in the imports below starts it).
jax.config.update("jax_num_cpu_devices", 4)


def child_process_env() -> dict[str, str]:
    """The environment entries a process the tests start needs to compile as this one does (the
    run's compilation cache and XLA flags); processes started with os.environ have them already."""
    keys = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "XLA_FLAGS")
    return {key: os.environ[key] for key in keys}


# `python -c` this, a module and its arguments: the module runs as `python -m module` with the
# signal dispositions of a process started from a terminal. A runner in the background (nohup,
# `cmd &`) hands its children SIGINT ignored, and Python, and our command lines, then keep
# ignoring it; the signal tests must not depend on what runs the suite.
_FROM_A_TERMINAL = (
    "import runpy, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "for s in (signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


def python_module_from_a_terminal(module: str) -> list[str]:
    """The command that runs `python -m module` with a terminal's signal dispositions (SIGINT
    raising KeyboardInterrupt, SIGTERM and SIGHUP at their defaults); append its arguments."""
    return [sys.executable, "-c", _FROM_A_TERMINAL, module]


from dllm_jax.engine.engine import Engine  # noqa: E402 (after the JAX settings above)
from dllm_jax.models.config import ModelConfig  # noqa: E402
from dllm_jax.models.transformer import init_params  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer LLaDA-shaped config with grouped-query attention (4 query heads, 2 kv heads)."""
    base = ModelConfig(
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden_size=96,
        vocab_size=128,
        rope_theta=10000.0,
        mask_token_id=126,
        eos_token_id=127,
        pad_token_id=127,
        bos_token_id=125,
        max_sequence_length=512,
        dtype="float32",
    )
    return dataclasses.replace(base, **overrides)


def tiny_dream_config(**overrides) -> ModelConfig:
    """A 2-layer Dream-shaped config: q/k/v biases, 4 query heads over 1 kv head, shifted logits."""
    base = dataclasses.replace(tiny_config(), n_kv_heads=1, rms_norm_eps=1e-6, family="dream", qkv_bias=True)
    return dataclasses.replace(base, **overrides)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.key(0))


@pytest.fixture(scope="session")
def lively():
    """A random tiny model whose predictions vary by position and are often confident.

    Layer weights are scaled up so attention and MLP shape the predictions, the LM head so
    confidences spread over (0, 1), and EOS takes over one frequent token so answers end.
    """
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))
    params["layers"] = jax.tree_util.tree_map(lambda w: w * 8 if w.ndim == 3 else w, params["layers"])
    head = params["lm_head"]["kernel"] * 20
    params["lm_head"]["kernel"] = head.at[:, cfg.eos_token_id].set(head[:, 125] * 1.02)
    return cfg, params


@pytest.fixture(scope="session")
def lively_engine(lively) -> Engine:
    """One XLA engine over the lively model for every test that only decodes with it: the loops
    it compiles (tests/engine_checks.py) serve the whole session. A test that counts
    compilations or changes an engine option builds its own."""
    cfg, params = lively
    return Engine(cfg, params, backend="xla")


@pytest.fixture(scope="session")
def embedded():
    """The embedded tiny LLaDA (dllm_jax/assets/tiny-llada) in float32, as load_model returns it."""
    from dllm_jax.models.embedded import tiny_model_path
    from dllm_jax.models.loading import load_model

    return load_model(tiny_model_path(), dtype="float32")


@pytest.fixture(scope="session")
def embedded_engine(embedded) -> Engine:
    """One XLA engine over the embedded model for the tests that only decode with it."""
    return Engine(embedded.config, embedded.weights, embedded.tokenizer, backend="xla")


# A LLaDA-like chat template (reference-spec A.5): BOS before the first message, every turn as
# header + content (trimmed) + <|eot_id|>, and always an open assistant header at the end.
LLADA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)
TOKENIZER_SPECIAL_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|mdm_mask|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)


def save_tiny_tokenizer(folder, *, chat_template: str | None = LLADA_CHAT_TEMPLATE):
    """Trains a byte-level BPE tokenizer (300 ids, LLaDA's special tokens) and saves it as a HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "What is 2 + 2? The answer is 4.",
        "Masked diffusion language models decode many tokens in parallel.",
    ] * 10
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(TOKENIZER_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mdm_mask|>",
        chat_template=chat_template,
    ).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


TIERS = ("unit", "kernels", "engine", "integration")  # registered in pyproject.toml


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """Clears jax's caches of traced and compiled programs when a module's tests are done, so one
    process does not hold the executables of every test (shared engines keep their own compiled
    loops). Two CI runs died inside XLA:CPU (a segfault compiling or serializing) about 1050 tests
    into the suite, at a test that passes alone."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _restore_log_levels():
    """A command line run in process (dllm-generate's main, the server's) sets the dllm_jax
    logger's level (ERROR with --quiet) and the root logger's; later tests' caplog must still see
    dllm_jax's warnings."""
    loggers = [logging.getLogger(), logging.getLogger("dllm_jax")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def pytest_collection_modifyitems(items):
    """A test with no tier mark (say, of a new file) runs in the full suite only: it is marked
    integration, so the quick loop (-m "not integration") stays quick until its file says its tier."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.integration)
