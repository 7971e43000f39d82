"""Request bodies of the OpenAI-compatible API, as pydantic models with OpenAI's field names.

Unknown top-level fields are rejected (OpenAI does the same), so a misspelt option is a 400
naming it instead of a silently ignored setting. Diffusion options live in the extension
object ``"dllm": {...}``; ``top_k`` is also accepted at the top level, as vLLM does.

OpenAI fields this server cannot honour are accepted at their defaults (what clients send
unasked: presence/frequency_penalty 0, response_format text, an empty logit_bias) and refused
otherwise with the reason (``unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, create_model, model_validator

from dllm_jax.sampling.params import FLOAT32_MAX, INT32_MAX, MAX_SEED, Knob, server_knobs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _knob_type(spec: Knob) -> Any:
    """The pydantic type of a SamplingParams knob: its kind within its bounds (and its dtype's)."""
    if spec.kind == "choice":
        return Literal[spec.choices]
    if spec.kind == "int":
        low = -INT32_MAX - 1 if spec.low is None else spec.low
        high = INT32_MAX if spec.high is None else spec.high
        return Annotated[StrictInt, Field(ge=low, le=high)]
    bounds = {
        "gt" if spec.low_open else "ge": -FLOAT32_MAX if spec.low is None else spec.low,
        "le": FLOAT32_MAX if spec.high is None else spec.high,
    }
    return Annotated[StrictFloat, Field(allow_inf_nan=False, **bounds)]


class _DllmControls(_Strict):
    """What the extension holds besides the SamplingParams knobs: canvas: stream each step's
    commits; timeout: seconds until the request is abandoned (at most the server's limit);
    method: one of the methods the server was started with (default: the first)."""

    canvas: StrictBool = False
    timeout: Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)] | None = None
    method: str | None = None


# The diffusion extension "dllm": {...}: the SamplingParams knobs declared for the server
# (dllm_jax.sampling.params: same names, bounds and meaning; unset = the server's default), and
# the controls above.
DllmOptions = create_model(
    "DllmOptions",
    __base__=_DllmControls,
    __doc__="The diffusion extension: per-request SamplingParams knobs and the request's controls.",
    **{name: (_knob_type(spec) | None, None) for name, spec in server_knobs().items()},
)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


MAX_CHOICES = 16  # n at most: each choice is a request of its own
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of top_logprobs (chat); completions' logprobs at most 5
_Penalty = Annotated[StrictFloat | StrictInt, Field(ge=-2, le=2, allow_inf_nan=False)]


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED - 1)] | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    logit_bias: dict[str, float] | None = None
    dllm: DllmOptions = Field(default_factory=DllmOptions)

    @model_validator(mode="after")
    def _check(self):
        stops = self.stop_list
        if len(stops) > 4:
            raise ValueError("stop: at most 4 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop: stop strings must be non-empty")
        if self.top_k is not None and self.dllm.top_k is not None and self.top_k != self.dllm.top_k:
            raise ValueError("top_k and dllm.top_k disagree; give one of them")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def effective_top_k(self) -> int | None:
        return self.top_k if self.top_k is not None else self.dllm.top_k

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token the request asks for (None: no logprobs)."""
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) of a field this server accepts only at its default, or None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, (
                    f"{name}={getattr(self, name)} is not supported: a diffusion model commits tokens anywhere in the "
                    "answer, several per step, so there is no 'already generated' prefix to penalise (send 0)"
                )
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server (send none or {})"
        return None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys (name, tool_calls, ...) are ignored: clients echo whole messages back
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_tokens(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; give one of them")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", (
                f"response_format {self.response_format.type!r} is not supported: this server does not constrain "
                "decoding to a format (send {'type': 'text'})"
            )
        return super().unsupported()

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (developer is OpenAI's new system)."""
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text} for m in self.messages]


class CompletionRequest(_Sampling):
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    suffix: str | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo and self.logprobs is not None:
            return "logprobs", (
                "echo with logprobs is not supported: it asks for the prompt tokens' log-probabilities, which a "
                "masked diffusion model does not assign (it never predicts its prompt)"
            )
        if self.best_of is not None and self.best_of != self.n:
            return (
                "best_of",
                f"best_of={self.best_of} is not supported: it must equal n={self.n} (no ranking of samples)",
            )
        if self.suffix:
            return "suffix", "suffix (infilling) is not supported by this server"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice (raises ValueError for an empty one)."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise ValueError("prompt: empty list")
        for i, item in enumerate(items):
            if not item:
                raise ValueError(f"prompt[{i}]: empty prompt")
        return items
