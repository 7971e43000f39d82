"""An online session over the engine's compiled decode loop (one DecodeConfig for all requests).

Requests are added at any time and pushed into the on-device request ring between calls;
each call runs `max_iterations` loop iterations, then the host reads every slot's canvas
and reports what each request committed, and the finished results. Aborting a request
frees its slot before the next call.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decode_config import DecodeConfig
from dllm_jax.engine import Engine
from dllm_jax.serve.worker import FinalAnswer, RequestUpdate, StepCommits


@dataclasses.dataclass
class _Tracked:
    request_id: str
    prompt_len: int
    seen: np.ndarray  # bool [G]: answer positions already reported
    steps: int = 0
    aborted: bool = False


class LoopSession:
    """Args: engine; decode: the method and shapes; max_prompt_len: longest prompt accepted."""

    def __init__(self, engine: Engine, decode: DecodeConfig, max_prompt_len: int):
        self.engine = engine
        self.decode = decode
        self.gen_length = decode.gen_length
        self.num_slots = decode.batch_size
        self.max_prompt_len = max_prompt_len
        compiled = engine.compile(decode, max_prompt_len)
        self._init, self._run = compiled.init, compiled.run
        Q, width = compiled.queue_capacity, compiled.prompt_width
        self._capacity = Q
        self._tokens = np.zeros((Q, width), np.int32)
        self._lengths = np.zeros((Q,), np.int32)
        self._pending: collections.deque[tuple[str, list[int]]] = collections.deque()
        self._by_index: dict[int, _Tracked] = {}  # pushed and not yet collected
        self._index_of: dict[str, int] = {}
        self._collected: list[bool] = []
        self._knobs = decode.knobs()
        self._seed = jnp.int32(decode.seed)
        self._state = self._init(jnp.asarray(self._tokens), jnp.asarray(self._lengths), jnp.int32(0))
        self._mask_id = engine.config.mask_token_id

    @property
    def num_running(self) -> int:
        return len(self._by_index)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, prompt_ids: list[int], params=None) -> None:
        if not 0 < len(prompt_ids) <= self.max_prompt_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens: expected 1 to {self.max_prompt_len}")
        self._pending.append((request_id, list(prompt_ids)))

    def abort(self, request_id: str) -> None:
        for i, (rid, _) in enumerate(self._pending):
            if rid == request_id:
                del self._pending[i]
                return
        g = self._index_of.get(request_id)
        if g is not None:
            self._by_index[g].aborted = True

    def _push(self) -> bool:
        pushed = False
        Q = self._capacity
        while self._pending:
            g = len(self._collected)
            if g >= Q and not self._collected[g - Q]:
                break
            request_id, ids = self._pending.popleft()
            self._tokens[g % Q] = 0
            self._tokens[g % Q, : len(ids)] = ids
            self._lengths[g % Q] = len(ids)
            self._collected.append(False)
            self._by_index[g] = _Tracked(request_id, len(ids), np.zeros(self.gen_length, bool))
            self._index_of[request_id] = g
            pushed = True
        return pushed

    def _forget(self, g: int) -> None:
        tracked = self._by_index.pop(g)
        self._index_of.pop(tracked.request_id, None)
        self._collected[g] = True

    def _free_aborted_slots(self, slots) -> None:
        request, active = np.asarray(slots.request), np.asarray(slots.active)
        drop = [i for i in range(len(active)) if active[i] and self._by_index.get(int(request[i]), None) is not None
                and self._by_index[int(request[i])].aborted]
        if drop:
            free = np.asarray(active).copy()
            free[drop] = False
            self._state = self._state.replace(slots=self._state.slots.replace(active=jnp.asarray(free)))
            for i in drop:
                self._forget(int(request[i]))

    def step(self, max_iterations: int) -> list[RequestUpdate]:
        """Runs up to max_iterations loop iterations (one step per active slot each)."""
        if any(t.aborted for t in self._by_index.values()):
            self._free_aborted_slots(jax.device_get(self._state.slots))
        if self._push():
            state = self._state
            queue = state.queue.replace(tokens=jnp.asarray(self._tokens), lengths=jnp.asarray(self._lengths),
                                        count=jnp.int32(len(self._collected)))
            self._state = state.replace(queue=queue)
        iteration = int(self._state.iteration)
        self._state = self._run(self.engine.params, self._state, self._knobs, self._seed,
                                jnp.int32(iteration + max_iterations), jnp.bool_(bool(self._pending)))
        slots, results = jax.device_get((self._state.slots, self._state.results))
        updates = []
        finished = np.nonzero(results.done)[0]
        for entry in finished:
            g = int(results.request[entry])
            tracked = self._by_index.get(g)
            if tracked is None or tracked.aborted:
                if tracked is not None:
                    self._forget(g)
                continue
            answer = np.asarray(results.tokens[entry])
            commits = self._new_commits(tracked, answer, answer != self._mask_id, int(results.steps[entry]))
            updates.append(RequestUpdate(tracked.request_id, commits, self._final(tracked, answer, results, entry)))
            self._forget(g)
        if len(finished):
            self._state = self._state.replace(results=self._state.results.replace(done=jnp.zeros_like(self._state.results.done)))
        G = self.gen_length
        for i in np.nonzero(slots.active)[0]:
            tracked = self._by_index.get(int(slots.request[i]))
            if tracked is None or tracked.aborted:
                continue
            P = int(slots.prompt_len[i])
            answer = slots.tokens[i, P: P + G]
            decoded = slots.decoded[i, P: P + G]
            commits = self._new_commits(tracked, answer, decoded, int(slots.steps[i]))
            if commits:
                updates.append(RequestUpdate(tracked.request_id, commits, None))
        return updates

    def _new_commits(self, tracked: _Tracked, answer: np.ndarray, decoded: np.ndarray, steps: int) -> tuple[StepCommits, ...]:
        new = np.nonzero(decoded & ~tracked.seen)[0]
        tracked.seen |= decoded
        if steps == tracked.steps and not len(new):
            return ()
        tracked.steps = steps
        positions = tuple(int(p) for p in new)
        return (StepCommits(steps, positions, tuple(int(answer[p]) for p in new), (False,) * len(positions)),)

    def _final(self, tracked: _Tracked, answer: np.ndarray, results, entry: int) -> FinalAnswer:
        eos = self.engine.config.eos_token_id
        ids = [int(t) for t in answer]
        ids = ids[: ids.index(eos)] if eos in ids else ids
        ended = len(ids) < len(answer)
        text = self.engine.tokenizer.decode(ids) if self.engine.tokenizer is not None else None
        return FinalAnswer(
            token_ids=tuple(ids),
            text=text,
            finish_reason="stop" if ended else "length",
            prompt_tokens=tracked.prompt_len,
            completion_tokens=len(ids),
            steps=int(results.steps[entry]),
            forward_passes=int(results.passes[entry] + results.verify_passes[entry]),
            verify_passes=int(results.verify_passes[entry]),
            accepted_drafts=int(results.accepted[entry]),
        )
