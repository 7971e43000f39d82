"""The ``dllm_jax`` model of lm-evaluation-harness: any decoding method over one Engine.

    lm_eval --model dllm_jax \\
        --model_args pretrained=PATH,method=flash_cache,verify=True,gen_length=256,batch_size=32 \\
        --tasks gsm8k --num_fewshot 5

(lm-eval 0.4.13 finds models only in its registry: run ``python -m dllm_jax.evaluation`` or
``dllm-jax-lm-eval`` with the same arguments, which is lm-eval's command line with this
module imported; lm-eval versions that load ``lm_eval.models`` entry points find it from
the package metadata.)

model_args: every DecodeConfig field (method, gen_length, block_length, steps, schedule,
cache, mask_num, track_num, batch_size, verify, accept, pin), the requests' threshold, gamma and
seed, and the adapter's
own options (dllm_jax.evaluation.model_args.AdapterArgs).

generate_until: every request of a call goes through one Engine.generate call (continuous
batching over batch_size slots), longest prompt first, answers back in request order, each
with its own SamplingParams: ``until`` as stop strings, ``max_gen_toks`` as the request's
gen_length, its canvas (gen_length is the bucket and the default, as in the papers, which decode gen_length
positions whatever max_gen_toks says), temperature/top_p/top_k. The answer is then cut as the
papers' adapters (LLaDA/Fast-dLLM/Flash-dLLM eval_llada.py) cut it: decoded with special
tokens kept, split at each ``until`` string, re-encoded, decoded without special tokens (so a
stop string such as ``<|eot_id|>`` works; the engine matches stop strings on text without
special tokens).

loglikelihood: LLaDA's Monte-Carlo estimator (dllm_jax.evaluation.mc_loglikelihood) over the
full bidirectional forward; for DiffusionGemma the exact autoregressive likelihood of its
causal encoder (dllm_jax.evaluation.encoder_loglikelihood), which also gives
loglikelihood_rolling (refused for the masked diffusion families: see its docstring).

DiffusionGemma (pretrained= a DiffusionGemma folder): the method defaults to diffusion_gemma,
every request samples with its own seed (seed + i) under the denoising values model_args give
(max_denoising_steps, t_min, t_max, ...), else the model's generation_config.json's, and a task's
temperature is refused: its sampler anneals its own from t_max to t_min.

What neither model_args nor a task's generation kwargs set (a task that names neither
temperature nor do_sample, top_p, top_k, the sampler values) takes the model's
generation_config.json values, as transformers' generate does; model_args
generation_config=none turns that off.

Throughput is counted as the published Flash-dLLM eval_llada.py counts it: tokens = the
engine's credited tokens, NFE = the sum over requests of their decode steps, tokens/s over
the wall time from tokenization to the last answer. The counters go to lm-eval's results
(``config.dllm_jax``) and, with ``stats_path=FILE``, to a JSON file after every call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import jax
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm.auto import tqdm

from dllm_jax.common.atomic_write import write_text_atomically
from dllm_jax.engine.engine import Engine
from dllm_jax.evaluation.encoder_loglikelihood import EncoderLoglikelihood
from dllm_jax.evaluation.mc_loglikelihood import MonteCarloLoglikelihood
from dllm_jax.evaluation.model_args import ModelArgsError, ParsedArgs, decode_config_for, parse_model_args
from dllm_jax.models.loading import load_model
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.generation_defaults import GenerationDefaults
from dllm_jax.sampling.params import MAX_SEED, SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

SUPPORTED_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")
# Values of other generation kwargs that change nothing (lm-eval tasks sometimes spell them out).
_NEUTRAL_GEN_KWARGS = {"num_beams": (1, None)}


class GenerationKwargsError(ValueError):
    """A generation kwarg of a request that dllm_jax cannot honour; the message names it."""


class LoglikelihoodRollingError(NotImplementedError):
    """loglikelihood_rolling asked of a masked diffusion model."""


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """The answers of one engine call (token ids, request order) and its totals."""

    token_ids: list[list[int]]
    reference_num_tokens: int
    steps: int
    forward_passes: int
    iterations: int
    decode_seconds: float
    compile_seconds: float


def run_engine(
    engine: Engine, prompts: list[list[int]], sampling: list[SamplingParams], decode_config: DecodeConfig
) -> EngineCall:
    """All requests through one Engine.generate call; the only place this module calls the engine."""
    out = engine.generate(prompts, sampling, decode_config=decode_config)
    failed = [r for r in out.results if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"dllm_jax engine: request {failed[0].index} failed: {failed[0].error}")
    s = out.stats
    return EngineCall(
        [r.token_ids for r in out.results],
        s.reference_num_tokens,
        s.steps,
        s.forward_passes,
        s.iterations,
        s.wall_seconds,
        s.compile_seconds,
    )


def _load_hf_tokenizer(path: str):
    """The checkpoint's own Hugging Face tokenizer, from its folder only (no network)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # config.json's model_type "llada" is unknown to transformers
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError and JSON errors alike
        raise ModelArgsError(
            f"model_args: pretrained={path}: cannot load its tokenizer ({type(e).__name__}: {e})"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)


@register_model("dllm_jax")
class DLLMJaxLM(LM):
    """lm-eval's view of a dllm_jax Engine (see the module docstring).

    Construct with model_args as keywords (``DLLMJaxLM(pretrained=PATH, method="llada")``);
    lm-eval builds it through create_from_arg_string / create_from_arg_obj.
    """

    def __init__(self, parsed: ParsedArgs | None = None, **model_args: Any):
        super().__init__()
        parsed = parsed if parsed is not None else parse_model_args(model_args)
        a = parsed.adapter
        self.args = a
        dtype = a.dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
        try:
            loaded = load_model(a.pretrained, dtype=dtype, quantization=a.quantization)
            defaults = GenerationDefaults.from_hf(
                loaded.generation_config if a.generation_config == "auto" else None,
                source=loaded.generation_config_file,
            )
        except ValueError as e:
            raise ModelArgsError(f"model_args: pretrained={a.pretrained}: {e}") from None
        self.config = loaded.config
        self.decode_config = decode_config_for(parsed, loaded.config)
        self.tokenizer = _load_hf_tokenizer(str(loaded.path))  # the folder found (an embedded name, a Hub id)
        self.engine = Engine(
            loaded.config, loaded.weights, loaded.tokenizer, backend=a.backend, generation_defaults=defaults
        )
        self.block_diffusion = loaded.config.family == "diffusion_gemma"
        if self.block_diffusion:
            if a.cfg_scale:
                raise ModelArgsError(
                    f"model_args: cfg_scale={a.cfg_scale}: LLaDA's guidance of the Monte-Carlo loglikelihood; "
                    "DiffusionGemma's loglikelihood is its encoder's (exact, unguided)"
                )
            # the engine's weights (its layers unrolled or not): no second copy of the model
            self.scorer: MonteCarloLoglikelihood | EncoderLoglikelihood = EncoderLoglikelihood(
                loaded.config, self.engine.weights
            )
        else:
            self.scorer = MonteCarloLoglikelihood(
                loaded.config,
                loaded.weights,
                mc_num=a.mc_num,
                mc_batch_size=a.mc_batch_size if a.mc_batch_size is not None else self.decode_config.batch_size,
                cfg_scale=a.cfg_scale,
                seed=a.seed,
            )
        self.dtype = dtype
        self.generation_calls: list[dict[str, Any]] = []
        self.loglikelihood_calls: list[dict[str, Any]] = []

    # ----- construction from lm-eval --------------------------------------------------------

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DLLMJaxLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> DLLMJaxLM:
        # lm-eval's CLI always passes its --batch_size (default 1): model_args' batch_size wins.
        harness = additional_config or {}
        return cls(parse_model_args(dict(arg_dict), harness_batch_size=harness.get("batch_size")))

    # ----- chat templates (--apply_chat_template) ------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.args.pretrained).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError(
                f"{self.args.pretrained}: the tokenizer has no chat template; run without --apply_chat_template"
            )
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token strings (from a chat template) become their ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ----- generate_until -------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        start = time.perf_counter()
        prompts, params = zip(*(self._generation_request(i, req) for i, req in enumerate(requests)))
        # longest prompt first: the slots that refill last hold the shortest requests
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        call = run_engine(self.engine, [prompts[i] for i in order], [params[i] for i in order], self.decode_config)
        texts: list[str] = [""] * len(prompts)
        for ids, i in zip(call.token_ids, order):
            texts[i] = self.cut_at_stop_strings(ids, params[i].stop)
        wall = time.perf_counter() - start
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        self.generation_calls.append(self._throughput(call, len(prompts), wall))
        self._write_stats()
        return texts

    def _generation_request(self, i: int, req: Instance) -> tuple[list[int], SamplingParams]:
        """The prompt ids and SamplingParams of request i; GenerationKwargsError names a bad kwarg."""
        context, kwargs = req.args[0], dict(req.args[1] or {})
        where = f"request {i} (task {req.task_name}, doc {req.doc_id})"
        for key, value in kwargs.items():
            if key not in SUPPORTED_GEN_KWARGS and value not in _NEUTRAL_GEN_KWARGS.get(key, ()):
                raise GenerationKwargsError(
                    f"{where}: generation kwarg {key}={value!r} is not supported by dllm_jax "
                    f"(supported: {', '.join(SUPPORTED_GEN_KWARGS)})"
                )
        until = kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(s for s in until if s != "")
        G = self.decode_config.gen_length
        max_new = kwargs.get("max_gen_toks")
        if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
            raise GenerationKwargsError(
                f"{where}: generation kwarg max_gen_toks={max_new!r}: expected a positive integer"
            )
        # a task that says neither leaves them to the model's generation_config (as transformers does)
        chooses = "temperature" in kwargs or "do_sample" in kwargs
        temperature = kwargs.get("temperature", 0.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise GenerationKwargsError(f"{where}: generation kwarg temperature={temperature!r}: expected a number")
        do_sample = kwargs.get("do_sample", temperature > 0)
        if do_sample and temperature == 0:
            raise GenerationKwargsError(f"{where}: generation kwarg do_sample=True needs temperature > 0")
        if do_sample and self.block_diffusion:
            raise GenerationKwargsError(
                f"{where}: generation kwargs do_sample=True, temperature={temperature!r}: DiffusionGemma's sampler "
                "anneals its own temperature from t_max to t_min (model_args t_max=..., t_min=...)"
            )
        requests = self.args.request_defaults()
        if self.block_diffusion:  # its sampler always samples: every request its own seed
            requests["seed"] = (self.args.seed + i) % MAX_SEED
            length = dict(max_new_tokens=None if max_new is None else min(max_new, G))
        else:
            requests["seed"] = (self.args.seed + i) % MAX_SEED if do_sample else None
            # the canvas, as the published evaluations set gen_length (not a cut of a longer one)
            length = dict(gen_length=None if max_new is None or max_new >= G else max_new)
        if do_sample:
            requests.update(temperature=float(temperature), top_p=kwargs.get("top_p"), top_k=kwargs.get("top_k"))
        elif chooses and not self.block_diffusion:
            requests.update(temperature=0.0)  # greedy, whatever the model's default
        try:
            params = SamplingParams(stop=until, **length, **requests)
        except SamplingParamsError as e:
            raise GenerationKwargsError(f"{where}: generation kwargs: {e}") from None
        prompt_ids = self.encode(context)
        if not prompt_ids:
            raise GenerationKwargsError(f"{where}: the context is empty")
        limit = self.config.max_sequence_length
        if len(prompt_ids) + (params.gen_length or G) > limit:
            raise GenerationKwargsError(
                f"{where}: {len(prompt_ids)} prompt tokens + {params.gen_length or G} generated exceed the "
                f"model's max_sequence_length={limit}"
            )
        return prompt_ids, params

    def cut_at_stop_strings(self, token_ids: list[int], until: tuple[str, ...]) -> str:
        """The papers' post-processing: text with special tokens, cut before each stop string
        in turn, re-encoded and decoded without special tokens."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return self.tokenizer.decode(self.encode(text), skip_special_tokens=True)

    def _throughput(self, call: EngineCall, requests: int, wall: float) -> dict[str, Any]:
        nfe = call.steps
        return {
            "requests": requests,
            "num_tokens": call.reference_num_tokens,
            "nfe": nfe,
            "avg_steps": nfe / requests,
            "tokens_per_step": call.reference_num_tokens / nfe if nfe else float("nan"),
            "max_tokens_per_step": requests * self.decode_config.gen_length / nfe if nfe else float("nan"),
            "forward_passes": call.forward_passes,
            "iterations": call.iterations,
            "wall_seconds": wall,
            "tokens_per_second": call.reference_num_tokens / wall if wall > 0 else float("nan"),
            "decode_seconds": call.decode_seconds,
            "decode_tokens_per_second": (
                call.reference_num_tokens / call.decode_seconds if call.decode_seconds > 0 else float("nan")
            ),
            "compile_seconds": call.compile_seconds,
        }

    # ----- loglikelihood --------------------------------------------------------------------

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as LLaDA's adapter splits them: trailing spaces of the
        context move to the continuation; the continuation is the whole text's ids after the
        context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        prefix = self.encode(context)
        return prefix, whole[len(prefix) :]

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        start = time.perf_counter()
        passes = self.scorer.forward_passes
        out = []
        for i, req in enumerate(tqdm(requests, desc="dllm_jax loglikelihood", disable=disable_tqdm)):
            prefix, target = self.encode_pair(*req.args)
            limit = self.config.max_sequence_length
            if len(prefix) + len(target) > limit:
                raise ValueError(
                    f"request {i} (task {req.task_name}, doc {req.doc_id}): {len(prefix)} context + "
                    f"{len(target)} continuation tokens exceed the model's max_sequence_length={limit}"
                )
            if self.block_diffusion:  # exact, and greedy comes with the same pass
                score = self.scorer.score(prefix, target)
                value, greedy = score.value, score.greedy
            else:
                value = self.scorer.estimate(prefix, target).value
                greedy = self.scorer.greedy_reproduces(prefix, target) if self.args.is_check_greedy else False
            out.append((value, greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, (value, greedy))
        self.loglikelihood_calls.append(
            {
                "requests": len(requests),
                "forward_passes": self.scorer.forward_passes - passes,
                "wall_seconds": time.perf_counter() - start,
            }
        )
        self._write_stats()
        return out

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks: log p of each token given the tokens before it, summed over the text.

        DiffusionGemma: its causal encoder's, over lm-eval's rolling windows of
        max_sequence_length tokens (the first after BOS), as for any autoregressive model.
        LLaDA and Dream: refused. A masked diffusion model has no left-to-right factorisation;
        LLaDA's Monte-Carlo estimate of a whole text is a bound over random maskings, not that
        quantity, so these tasks' perplexities would not be comparable."""
        if not self.block_diffusion:
            raise LoglikelihoodRollingError(
                "dllm_jax: loglikelihood_rolling (perplexity tasks) is not available: a masked diffusion "
                "model has no left-to-right factorisation, so the per-token rolling likelihood these tasks "
                "define does not exist; use generate_until or multiple-choice (loglikelihood) tasks"
            )
        if self.config.bos_token_id is None:
            raise LoglikelihoodRollingError(f"{self.args.pretrained}: the model has no BOS token to start a text from")
        start = time.perf_counter()
        passes = self.scorer.forward_passes
        out = []
        for req in tqdm(requests, desc="dllm_jax loglikelihood_rolling", disable=disable_tqdm):
            windows = get_rolling_token_windows(
                self.encode(req.args[0]),
                prefix_token=self.config.bos_token_id,
                max_seq_len=self.config.max_sequence_length,
                context_len=1,
            )
            value = sum(self.scorer.score(*make_disjoint_window(w)).value for w in windows)
            out.append(value)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), value)
        self.loglikelihood_calls.append(
            {
                "requests": len(requests),
                "rolling": True,
                "forward_passes": self.scorer.forward_passes - passes,
                "wall_seconds": time.perf_counter() - start,
            }
        )
        self._write_stats()
        return out

    # ----- reporting ------------------------------------------------------------------------

    def throughput(self) -> dict[str, Any]:
        """Totals over every generate_until call so far, and the calls themselves."""
        calls = self.generation_calls
        tokens = sum(c["num_tokens"] for c in calls)
        nfe = sum(c["nfe"] for c in calls)
        wall = sum(c["wall_seconds"] for c in calls)
        decode = sum(c["decode_seconds"] for c in calls)
        return {
            "requests": sum(c["requests"] for c in calls),
            "num_tokens": tokens,
            "nfe": nfe,
            "tokens_per_step": tokens / nfe if nfe else None,
            "forward_passes": sum(c["forward_passes"] for c in calls),
            "wall_seconds": wall,
            "tokens_per_second": tokens / wall if wall > 0 else None,
            "decode_tokens_per_second": tokens / decode if decode > 0 else None,
            "generate_until_calls": calls,
            "loglikelihood_calls": self.loglikelihood_calls,
        }

    def get_model_info(self) -> dict[str, Any]:
        return {"dllm_jax": self._report()}

    def _report(self) -> dict[str, Any]:
        return {
            "pretrained": str(self.args.pretrained),
            "dtype": self.dtype,
            "backend": self.engine.backend,
            "device": str(jax.devices()[0].device_kind),
            "decode": dataclasses.asdict(self.decode_config),
            "adapter": dataclasses.asdict(self.args),
            "throughput": self.throughput(),
        }

    def _write_stats(self) -> None:
        if self.args.stats_path:
            write_text_atomically(self.args.stats_path, json.dumps(self._report(), indent=1) + "\n")
