"""A plain-Python decoder, one request at a time, used as the reference in engine tests.

It re-implements each method's step from the reference spec with host-side numpy state and
explicit per-layer K/V arrays, calling only the model's own per-layer pieces (LLaDABlock
methods, dense_attention). It shares no code with the engine's cached pass, policies, slot
state or loop, so agreement token for token checks all of those.

Shifted logits (Dream): the prediction for position p is the output row at p - shift, so a
cached step also recomputes the row before every candidate (those rows come first and feed
the tracking score) and the verify stage adds one predictor row per mask view.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.llada import LLaDABlock, LLaDAModel
from dllm_jax.models.transformer import forward
from dllm_jax.runtime.decode_config import DecodeConfig
from pallas_kernels.attention.reference import dense_attention

# Rows and keys of the jitted pieces are padded to multiples of this, so that one test's
# requests (and every test of a model) reuse a few compiled shapes instead of compiling one per
# prompt length and step; padded rows are dropped, padded keys masked.
_PAD = 32


def _padded(n: int) -> int:
    return -(-n // _PAD) * _PAD


@functools.cache
def _model_pieces(config: ModelConfig) -> SimpleNamespace:
    """The model's per-layer pieces, jitted once per config (shared by every decoder of it)."""
    block, model = LLaDABlock(config), LLaDAModel(config)
    return SimpleNamespace(
        qkv=jax.jit(
            lambda lp, h, pos: block.apply(
                lp, block.apply(lp, h, method=LLaDABlock.attention_input), pos, method=LLaDABlock.project_qkv
            )
        ),
        out_mlp=jax.jit(lambda lp, h, out: block.apply(lp, h, out, method=LLaDABlock.output_and_mlp)),
        attend=jax.jit(dense_attention),
        embed=jax.jit(lambda p, t: model.apply({"params": p}, t, method=LLaDAModel.embed)),
        head=jax.jit(lambda p, h: model.apply({"params": p}, h, method=LLaDAModel.logits)),
        full_forward=jax.jit(lambda p, t, valid: forward(config, p, t, key_valid=valid)),
    )


class ReferenceDecoder:
    """One request at a time, by the reference spec. `threshold` and `gamma` are the request's
    values (SamplingParams'; None: the decode config's defaults)."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        decode: DecodeConfig,
        max_len: int,
        *,
        threshold: float | None = None,
        gamma: float | None = None,
    ):
        self.cfg, self.params, self.decode, self.L = config, params, decode, max_len
        self.threshold = decode.default_threshold if threshold is None else threshold
        self.gamma = decode.default_gamma if gamma is None else gamma
        self.shift = config.logit_shift
        pieces = _model_pieces(config)
        self.qkv, self.out_mlp, self.attend = pieces.qkv, pieces.out_mlp, pieces.attend
        self.embed, self.head, self._full_forward = pieces.embed, pieces.head, pieces.full_forward
        self.layer_params = [
            {"params": jax.tree_util.tree_map(lambda w: w[i], params["layers"])} for i in range(config.n_layers)
        ]

    def full_forward(self, tokens) -> np.ndarray:
        """Output logits [T, V] of a full forward pass over tokens [T] (keys padded, masked)."""
        T = len(tokens)
        padded = np.full(_padded(T), self.cfg.mask_token_id, np.int64)
        padded[:T] = tokens
        valid = np.arange(len(padded)) < T
        logits = self._full_forward(self.params, jnp.asarray(padded)[None], jnp.asarray(valid)[None])
        return np.asarray(logits[0, :T], np.float32)

    # ----- model pieces -------------------------------------------------------------------

    def rows_forward(self, tokens, rows, K, V, key_len, score_rows):
        """Recomputes `rows` over the per-layer caches K, V (lists of [L, KVD] numpy arrays).

        Returns logits [len(rows), V] and the tracking score [L] (raw q.k summed over the
        score rows and heads, layers >= 2, divided by W * H).
        """
        c = self.cfg
        rows = np.asarray(rows)
        n, S = len(rows), _padded(key_len)
        padded_rows = np.concatenate([rows, np.full(_padded(n) - n, rows[0])])
        pos = jnp.asarray(padded_rows)[None]
        h = self.embed(self.params, jnp.asarray(tokens[padded_rows])[None])
        key_mask = jnp.asarray(np.arange(S) < key_len)[None, None]
        score = np.zeros(self.L, np.float64)
        for layer in range(c.n_layers):
            lp = self.layer_params[layer]
            q, k, v = self.qkv(lp, h, pos)
            K[layer][rows] = np.asarray(k[0, :n]).reshape(n, -1)
            V[layer][rows] = np.asarray(v[0, :n]).reshape(n, -1)
            keys = np.zeros((S, c.kv_dim), np.float32)
            values = np.zeros((S, c.kv_dim), np.float32)
            keys[:key_len], values[:key_len] = K[layer][:key_len], V[layer][:key_len]
            keys = jnp.asarray(keys).reshape(1, S, c.n_kv_heads, c.head_dim)
            values = jnp.asarray(values).reshape(1, S, c.n_kv_heads, c.head_dim)
            out = self.attend(q, keys, values, key_mask)
            if layer >= 2:
                qs = np.asarray(q[0, :n], np.float64)[np.asarray(score_rows)]  # [n, H, Dh]
                kk = np.repeat(np.asarray(keys[0, :key_len], np.float64), c.n_heads // c.n_kv_heads, axis=1)
                score[:key_len] += np.einsum("nhd,khd->k", qs, kk)  # [Kd, H, Dh] keys
            h = self.out_mlp(lp, h, out)
        logits = self.head(self.params, h[0])[:n]
        return np.asarray(logits, np.float32), score / (self.decode.window * c.n_heads)

    def verify_forward(self, tokens_rows, positions_rows, K, V, key_len, exclude, extra_mask):
        """Read-only pass: rows attend to cached keys [0, key_len) minus `exclude`, plus each other
        where extra_mask allows. Returns logits of every row."""
        c = self.cfg
        n = len(tokens_rows)
        R = _padded(n)
        rows_tok = np.concatenate([np.asarray(tokens_rows), np.full(R - n, c.mask_token_id)])
        rows_pos = np.concatenate([np.asarray(positions_rows), np.zeros(R - n, np.int64)])
        pos = jnp.asarray(rows_pos)[None]
        h = self.embed(self.params, jnp.asarray(rows_tok)[None])
        cached = np.array([p for p in range(key_len) if p not in exclude], np.int64)
        S = _padded(len(cached))
        mask = np.zeros((R, S + R), bool)  # [rows, cached keys (padded) + the rows' own keys]
        mask[:n, : len(cached)] = True
        mask[:n, S : S + n] = extra_mask
        for layer in range(c.n_layers):
            lp = self.layer_params[layer]
            q, k, v = self.qkv(lp, h, pos)
            keys = np.zeros((S, c.kv_dim), np.float32)
            values = np.zeros((S, c.kv_dim), np.float32)
            keys[: len(cached)], values[: len(cached)] = K[layer][cached], V[layer][cached]
            keys = jnp.concatenate([jnp.asarray(keys).reshape(1, S, c.n_kv_heads, c.head_dim), k], axis=1)
            values = jnp.concatenate([jnp.asarray(values).reshape(1, S, c.n_kv_heads, c.head_dim), v], axis=1)
            h = self.out_mlp(lp, h, self.attend(q, keys, values, jnp.asarray(mask)[None]))
        return np.asarray(self.head(self.params, h[0])[:n], np.float32)

    def empty_cache(self):
        shape = (self.L, self.cfg.kv_dim)
        return [np.zeros(shape, np.float32) for _ in range(self.cfg.n_layers)], [
            np.zeros(shape, np.float32) for _ in range(self.cfg.n_layers)
        ]

    @staticmethod
    def confidence(logits):
        logits = np.asarray(logits, np.float64)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        tokens = probs.argmax(-1)
        return tokens, probs[np.arange(len(tokens)), tokens]

    def canvas(self, prompt):
        c, G = self.cfg, self.decode.gen_length
        P = len(prompt)
        tokens = np.full(self.L, c.eos_token_id, np.int64)
        tokens[:P] = prompt
        tokens[P : P + G] = c.mask_token_id
        decoded = np.arange(self.L) < P
        return tokens, decoded

    # ----- Flash-Cache ----------------------------------------------------------------------

    def flash_cache(self, prompt, *, no_cache: bool = False, rule: str = "attention", seed: int = 0, stream: int = 0):
        """Section C of the reference spec, one request. no_cache: a full model forward every step.

        rule: the tracking rule (SamplingParams.track_rule) that fills the budget after the
        pinned commits: "attention" (the spec's), "recent" (latest commit step first),
        "random" (uniform keys from the request's step key, `seed` and `stream`), "drift"
        (largest change of the row's last-layer K/V at its last sparse refresh) or "none".

        Returns (answer tokens [G], steps, committed generated positions).
        """
        d, c = self.decode, self.cfg
        W, G, L = d.window, d.gen_length, self.L
        P = len(prompt)
        key_len = min(((P + G) // 128 + 1) * 128, L - 1)
        tokens, decoded = self.canvas(prompt)
        bound, eos_found = P + G, False
        K, V = self.empty_cache()
        scores = np.zeros(L)
        pinned = np.zeros(L, bool)
        scores_before = scores
        positions = np.arange(L)
        commit_step = np.full(L, -1)
        drift = np.zeros(L)
        steps = 0
        self.accepted = 0
        while np.any(~decoded & (positions < bound)):
            undecoded = [p for p in range(key_len) if not decoded[p]]
            window = undecoded[:W]
            predictors = [p - self.shift for p in window]
            if no_cache:
                logits = self.full_forward(tokens[:key_len])[predictors]
            else:
                if steps == 0 or d.track_num < 0:
                    rows = window + [p for p in range(key_len) if p not in window]
                else:
                    lookahead = undecoded[W : W + (d.mask_num - 1) * W]
                    rule_key = self._rule_key(rule, scores, commit_step, drift, seed, stream, steps)
                    ranked = sorted(
                        (p for p in range(L) if decoded[p]),
                        key=lambda p: (0, 0.0, p) if pinned[p] else (1, -rule_key[p], p),
                    )
                    rows = window + lookahead + ([] if rule == "none" else ranked[: d.track_num * W])
                if self.shift:
                    rows = predictors + rows
                score_rows = np.arange(len(rows)) < len(window)
                last_before = K[-1][rows].copy(), V[-1][rows].copy()
                logits, scores = self.rows_forward(tokens, rows, K, V, key_len, score_rows)
                if steps > 0 and d.track_num >= 0:
                    change = (K[-1][rows] - last_before[0], V[-1][rows] - last_before[1])
                    drift[rows] = np.maximum(*(np.max(np.abs(c.astype(np.float64)), axis=1) for c in change))
                logits = logits[: len(window)]
            cand, conf = self.confidence(logits)
            eligible = np.array([p < bound for p in window])
            order = [i for i in np.argsort(-np.where(eligible, conf, -np.inf), kind="stable") if eligible[i]]
            keep = max(sum(conf[i] >= self.threshold for i in order), 1)
            committed = [window[i] for i in order[:keep]]
            for i in order[:keep]:
                tokens[window[i]] = cand[i]
                decoded[window[i]] = True
                commit_step[window[i]] = steps
            eos_at = [window[i] for i in order[:keep] if cand[i] == c.eos_token_id]
            if eos_at and not eos_found:
                bound, eos_found = max(eos_at) + 1, True
            if d.verify:
                accepted = self._verify_stage(
                    tokens, decoded, window, cand, order[keep:], committed, pinned, scores_before, K, V, key_len, bound
                )
                commit_step[accepted] = steps
                eos_at = [p for p in accepted if tokens[p] == c.eos_token_id]
                if eos_at and not eos_found:
                    bound, eos_found = max(eos_at) + 1, True
                self.accepted += len(accepted)
                committed = (committed if d.pin == "all_commits" else []) + accepted
            pinned = np.isin(positions, committed)
            scores_before = scores
            steps += 1
        return tokens[P : P + G].copy(), steps, int(decoded[P:].sum())

    def _rule_key(self, rule, scores, commit_step, drift, seed, stream, step):
        """Each position's key under a tracking rule (higher is refreshed first)."""
        if rule == "random":
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), step)
            return np.asarray(jax.random.uniform(jax.random.fold_in(key, 2), (self.L,), jnp.float32))
        return {"attention": scores, "recent": commit_step, "drift": drift, "none": scores}[rule]

    def _verify_stage(self, tokens, decoded, window, cand, rest, committed, pinned, scores, K, V, key_len, bound):
        """Section E: builds C/D/M rows, runs the read-only pass, commits accepted drafts."""
        d, c = self.decode, self.cfg
        W = d.window
        search = rest[: W // 2]  # window indices, most confident first
        S = len(search)
        T = 2 * W - 2 * S
        ranked = sorted(
            (p for p in range(self.L) if decoded[p]),
            key=lambda p: (0, 0.0, p) if p in committed else ((1, 0.0, p) if pinned[p] else (2, -scores[p], p)),
        )
        context = ranked[:T]
        search_pos = [window[i] for i in search]
        drafts = [int(cand[i]) for i in search]
        n_c = len(context)
        rows_tok = [int(tokens[p]) for p in context] + drafts + [c.mask_token_id] * S
        rows_pos = context + search_pos + search_pos
        role = ["C"] * n_c + ["D"] * S + ["M"] * S
        idx = list(range(n_c)) + list(range(S)) + list(range(S))
        if self.shift:  # P_i: the row before search position i, as view i holds it, attending as M_i
            for i in range(S):
                p = search_pos[i] - self.shift
                if p in search_pos:
                    j = search_pos.index(p)
                    rows_tok.append(drafts[j] if j < i else c.mask_token_id)
                else:
                    rows_tok.append(int(tokens[p]))
                rows_pos.append(p)
            role += ["P"] * S
            idx += list(range(S))
        n = len(rows_tok)
        mask = np.zeros((n, n), bool)
        for r in range(n):
            for col in range(n):
                if role[col] == "P":
                    mask[r, col] = False
                elif role[col] == "C":
                    mask[r, col] = True
                elif role[r] == "C":
                    mask[r, col] = role[col] == "M"
                elif role[r] == "D":
                    mask[r, col] = idx[col] <= idx[r] if role[col] == "D" else idx[col] > idx[r]
                else:  # M and P rows
                    mask[r, col] = idx[col] < idx[r] if role[col] == "D" else idx[col] >= idx[r]
        if S == 0:
            return []
        logits = self.verify_forward(rows_tok, rows_pos, K, V, key_len, set(context) | set(search_pos), mask)
        m_logits = np.asarray(logits[n_c + S : n_c + 2 * S] if not self.shift else logits[n_c + 2 * S :], np.float64)
        probs = np.exp(m_logits - m_logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        accepted, running = [], 1.0
        for i in range(S):
            p = probs[i, drafts[i]] if search_pos[i] < bound else 0.0
            if d.accept == "cumprod":
                running *= p
                ok = running >= self.gamma
            else:
                ok = probs[i].argmax() == drafts[i] and p >= self.gamma
            if not ok:
                break
            accepted.append(search_pos[i])
            tokens[search_pos[i]] = drafts[i]
            decoded[search_pos[i]] = True
        return accepted

    # ----- LLaDA and Fast-dLLM block decoding ---------------------------------------------------

    def block_decode(self, prompt, cache: str):
        """Section H: LLaDA (cache 'none', fixed schedule) or Fast-dLLM ('prefix'/'dual', threshold)."""
        d = self.decode
        Wb, G = d.window, d.gen_length
        P = len(prompt)
        key_len = P + G
        tokens, decoded = self.canvas(prompt)
        K, V = self.empty_cache()
        steps = 0
        for block_start in range(P, P + G, Wb):
            block = list(range(block_start, block_start + Wb))
            step_in_block = 0
            while not decoded[block].all():
                predictors = [p - self.shift for p in block]
                if cache == "none":
                    logits = self.full_forward(tokens[:key_len])[predictors]
                else:
                    if step_in_block == 0:
                        rows = list(range(key_len))
                    else:
                        rows = block if cache == "dual" else list(range(block_start, key_len))
                        rows = (predictors if self.shift else []) + rows
                    logits, _ = self.rows_forward(tokens, rows, K, V, key_len, np.zeros(len(rows), bool))
                    logits = logits[[rows.index(p) for p in predictors]]
                cand, conf = self.confidence(logits)
                eligible = ~decoded[block]
                order = [i for i in np.argsort(-np.where(eligible, conf, -np.inf), kind="stable") if eligible[i]]
                if d.fixed_schedule:
                    spb = d.total_steps // (G // Wb)
                    count = Wb // spb + (1 if step_in_block < Wb % spb else 0)
                    chosen = order[:count]
                else:
                    chosen = order[:1] + [i for i in order[1:] if conf[i] >= self.threshold]
                for i in chosen:
                    tokens[block[i]] = cand[i]
                    decoded[block[i]] = True
                steps += 1
                step_in_block += 1
        return tokens[P : P + G].copy(), steps
