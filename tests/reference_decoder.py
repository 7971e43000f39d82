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

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models.config import ModelConfig
from dllm_jax.models.llada import LLaDABlock, LLaDAModel
from dllm_jax.models.transformer import forward
from dllm_jax.runtime.decode_config import DecodeConfig
from pallas_kernels.attention.reference import dense_attention


class ReferenceDecoder:
    def __init__(self, config: ModelConfig, params, decode: DecodeConfig, max_len: int):
        self.cfg, self.params, self.decode, self.L = config, params, decode, max_len
        self.shift = config.logit_shift
        block, model = LLaDABlock(config), LLaDAModel(config)
        self.qkv = jax.jit(
            lambda lp, h, pos: block.apply(
                lp, block.apply(lp, h, method=LLaDABlock.attention_input), pos, method=LLaDABlock.project_qkv
            )
        )
        self.out_mlp = jax.jit(lambda lp, h, out: block.apply(lp, h, out, method=LLaDABlock.output_and_mlp))
        self.attend = jax.jit(dense_attention)
        self.embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method=LLaDAModel.embed))
        self.head = jax.jit(lambda p, h: model.apply({"params": p}, h, method=LLaDAModel.logits))
        self.full_forward = jax.jit(lambda p, t: forward(config, p, t))
        self.layer_params = [
            {"params": jax.tree_util.tree_map(lambda w: w[i], params["layers"])} for i in range(config.n_layers)
        ]

    # ----- model pieces -------------------------------------------------------------------

    def rows_forward(self, tokens, rows, K, V, key_len, score_rows):
        """Recomputes `rows` over the per-layer caches K, V (lists of [L, KVD] numpy arrays).

        Returns logits [len(rows), V] and the tracking score [L] (raw q.k summed over the
        score rows and heads, layers >= 2, divided by W * H).
        """
        c = self.cfg
        rows = np.asarray(rows)
        pos = jnp.asarray(rows)[None]
        h = self.embed(self.params, jnp.asarray(tokens[rows])[None])
        score = np.zeros(self.L, np.float64)
        for layer in range(c.n_layers):
            lp = self.layer_params[layer]
            q, k, v = self.qkv(lp, h, pos)
            K[layer][rows] = np.asarray(k[0]).reshape(len(rows), -1)
            V[layer][rows] = np.asarray(v[0]).reshape(len(rows), -1)
            keys = jnp.asarray(K[layer][:key_len]).reshape(1, key_len, c.n_kv_heads, c.head_dim)
            values = jnp.asarray(V[layer][:key_len]).reshape(1, key_len, c.n_kv_heads, c.head_dim)
            out = self.attend(q, keys, values, jnp.ones((1, 1, key_len), bool))
            if layer >= 2:
                qs = np.asarray(q[0], np.float64)[np.asarray(score_rows)]  # [n, H, Dh]
                kk = np.repeat(np.asarray(keys[0], np.float64), c.n_heads // c.n_kv_heads, axis=1)  # [Kd, H, Dh]
                score[:key_len] += np.einsum("nhd,khd->k", qs, kk)
            h = self.out_mlp(lp, h, out)
        logits = self.head(self.params, h[0])
        return np.asarray(logits, np.float32), score / (self.decode.window * c.n_heads)

    def verify_forward(self, tokens_rows, positions_rows, K, V, key_len, exclude, extra_mask):
        """Read-only pass: rows attend to cached keys [0, key_len) minus `exclude`, plus each other
        where extra_mask allows. Returns logits of every row."""
        c = self.cfg
        n = len(tokens_rows)
        pos = jnp.asarray(positions_rows)[None]
        h = self.embed(self.params, jnp.asarray(tokens_rows)[None])
        cached = np.array([p for p in range(key_len) if p not in exclude], np.int64)
        mask = np.concatenate([np.ones((n, len(cached)), bool), extra_mask], axis=1)[None]
        for layer in range(c.n_layers):
            lp = self.layer_params[layer]
            q, k, v = self.qkv(lp, h, pos)
            keys = jnp.concatenate([jnp.asarray(K[layer][cached]).reshape(1, -1, c.n_kv_heads, c.head_dim), k], axis=1)
            values = jnp.concatenate(
                [jnp.asarray(V[layer][cached]).reshape(1, -1, c.n_kv_heads, c.head_dim), v], axis=1
            )
            h = self.out_mlp(lp, h, self.attend(q, keys, values, jnp.asarray(mask)))
        return np.asarray(self.head(self.params, h[0]), np.float32)

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
                logits_all = self.full_forward(self.params, jnp.asarray(tokens[:key_len])[None])[0]
                logits = np.asarray(logits_all, np.float32)[predictors]
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
                    drift[rows] = np.sqrt(sum(np.sum(np.square(c.astype(np.float64)), axis=1) for c in change))
                logits = logits[: len(window)]
            cand, conf = self.confidence(logits)
            eligible = np.array([p < bound for p in window])
            order = [i for i in np.argsort(-np.where(eligible, conf, -np.inf), kind="stable") if eligible[i]]
            keep = max(sum(conf[i] >= d.threshold for i in order), 1)
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
                ok = running >= d.gamma
            else:
                ok = probs[i].argmax() == drafts[i] and p >= d.gamma
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
                    logits = np.asarray(
                        self.full_forward(self.params, jnp.asarray(tokens[:key_len])[None])[0], np.float32
                    )[predictors]
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
                    chosen = order[:1] + [i for i in order[1:] if conf[i] >= d.threshold]
                for i in chosen:
                    tokens[block[i]] = cand[i]
                    decoded[block[i]] = True
                steps += 1
                step_in_block += 1
        return tokens[P : P + G].copy(), steps
