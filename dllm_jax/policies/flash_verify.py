"""Flash-Verify: the model checks its own low-confidence drafts in one small read-only pass.

After a Flash-Cache step commits its confident window positions ("stage 1"), the rest of the
window (up to W/2 positions, by descending draft confidence: the search set, in "verify
order" i = 0..S-1) is checked. Each slot's verify query has 2W rows:

  C  T = 2W - 2S context rows: the most recently decoded tokens (this step's stage-1 commits,
     then the previous step's pinned tokens, then the previous step's best tracking scores)
  D  S rows: the search positions holding their drafts          (the draft view)
  M  S rows: the same positions holding [MASK]                  (the mask view)

all at their true rotary positions. Every row also attends to the slot's cached keys except
the C and search positions (those are represented by the query rows). Among the query rows
(True = may attend; i, k in verify order):

  rows \\ cols | C    | D_k        | M_k
  C           | all  | none       | all
  D_i         | all  | k <= i     | k > i
  M_i         | all  | k < i      | k >= i

so the mask view at search position i sees the drafts of positions before it in verify order
and masks from i on, never its own draft: its prediction is the conditional one-at-a-time
decoding in that order would see. The pass writes nothing to the cache; logits are computed
for the M rows only.

Shifted logits (Dream, logit_shift 1): the prediction for search position i is the output
row at position i - 1, so the query adds S predictor rows P_i at those positions, each
holding what that position holds in view i (the draft of a search position before i in
verify order, [MASK] for one from i on, else the canvas token) and attending exactly as M_i
does; nobody attends to them, and logits are computed for the P rows instead.

Acceptance ("stage 2"), p_i = mask view's probability of draft i:
  cumprod (published code): accept the longest prefix with prod_{k<=i} p_k >= gamma. Each
    accepted block of m drafts is then within 1 - gamma (total variation) of sequential
    decoding in this order, and with gamma > 0.5 each accepted draft is the mask view's top.
  paper (Eq. 5): walk in order, accept while the mask view's top token equals the draft and
    p_i >= gamma; stop at the first failure. Each token is within 1 - gamma, a block of m
    within 1 - gamma^m <= m (1 - gamma). It accepts a superset of what cumprod accepts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.runtime.slots import Slots, commit_tokens

_FIRST = 3.0e38  # rank keys: this step's commits, then the previous pinned, then scores
_SECOND = 2.0e38


@struct.dataclass
class WindowDraft:
    """Stage-1 outcome for one slot's window: positions, drafts, confidence [W], flags [W]."""

    positions: jax.Array
    tokens: jax.Array
    confidence: jax.Array
    eligible: jax.Array
    committed: jax.Array


@struct.dataclass
class VerifyPlan:
    """One slot's verify query (2W rows) and its search set (S_max = W // 2 entries)."""

    tokens: jax.Array  # int32 [N]: N = 2W (+ S_max predictor rows with shifted logits)
    positions: jax.Array  # int32 [N]
    row_valid: jax.Array  # bool [N]
    key_exclude: jax.Array  # bool [L]
    extra_mask: jax.Array  # bool [N, N]
    mask_rows: jax.Array  # int32 [S_max]: the rows predicting the search positions, in verify order
    search_positions: jax.Array  # int32 [S_max]
    search_drafts: jax.Array  # int32 [S_max]
    num_search: jax.Array  # int32: S


def plan_verify(old: Slots, new: Slots, draft: WindowDraft, mask_id: int, logit_shift: int = 0) -> VerifyPlan:
    """Builds the verify query of one slot after its stage-1 commit.

    old: the slot before this step (its pinned tokens and scores rank the context);
    new: after stage 1; logit_shift: the model family's (see the module docstring).
    """
    W = draft.positions.shape[0]
    rows, s_max = 2 * W, W // 2
    L = new.tokens.shape[0]

    # search set: uncommitted eligible candidates, most confident first
    open_ = draft.eligible & ~draft.committed
    order = jnp.argsort(-jnp.where(open_, draft.confidence, -jnp.inf), stable=True)[:s_max]
    num_search = jnp.minimum(jnp.sum(open_), s_max).astype(jnp.int32)
    search_positions = draft.positions[order]
    search_drafts = draft.tokens[order]
    num_context = rows - 2 * num_search

    # context: the most recently decoded tokens, ranked as the reference's decoded prefix
    fresh = jnp.zeros((L,), bool).at[jnp.where(draft.committed, draft.positions, L)].set(True, mode="drop")
    rank = jnp.where(fresh, _FIRST, jnp.where(old.pinned, _SECOND, old.scores))
    values, context = jax.lax.top_k(jnp.where(new.decoded, rank, -jnp.inf), rows)
    context_valid = (jnp.arange(rows) < num_context) & (values > -jnp.inf)

    r = jnp.arange(rows)
    is_c, is_d = r < num_context, (r >= num_context) & (r < num_context + num_search)
    is_m = r >= num_context + num_search
    i = jnp.where(is_d, r - num_context, r - num_context - num_search)  # verify-order index
    i_safe = jnp.clip(i, 0, s_max - 1)
    positions = jnp.where(is_c, context, search_positions[i_safe]).astype(jnp.int32)
    tokens = jnp.where(is_c, new.tokens[positions], jnp.where(is_d, search_drafts[i_safe], mask_id))
    row_valid = jnp.where(is_c, context_valid, True)

    # [2W, 2W] mask among the query rows (rows: queries, columns: keys)
    col_c, col_d, col_m, col_i = is_c[None, :], is_d[None, :], is_m[None, :], i[None, :]
    row_i = i[:, None]
    sees_c = col_c & row_valid[None, :]
    c_row = sees_c | col_m
    d_row = sees_c | (col_d & (col_i <= row_i)) | (col_m & (col_i > row_i))
    m_row = sees_c | (col_d & (col_i < row_i)) | (col_m & (col_i >= row_i))
    extra_mask = jnp.where(is_c[:, None], c_row, jnp.where(is_d[:, None], d_row, m_row))

    excluded = jnp.where(row_valid, positions, L)
    key_exclude = jnp.zeros((L,), bool).at[excluded].set(True, mode="drop")
    mask_rows = jnp.minimum(num_context + num_search + jnp.arange(s_max), rows - 1).astype(jnp.int32)
    if logit_shift:
        tokens, positions, row_valid, extra_mask, mask_rows = _with_predictor_rows(
            tokens,
            positions,
            row_valid,
            extra_mask,
            m_row,
            is_m,
            i,
            new.tokens,
            search_positions,
            search_drafts,
            num_search,
            mask_id,
            logit_shift,
        )
    return VerifyPlan(
        tokens=tokens.astype(jnp.int32),
        positions=positions,
        row_valid=row_valid,
        key_exclude=key_exclude,
        extra_mask=extra_mask,
        mask_rows=mask_rows,
        search_positions=search_positions.astype(jnp.int32),
        search_drafts=search_drafts.astype(jnp.int32),
        num_search=num_search,
    )


def _with_predictor_rows(
    tokens,
    positions,
    row_valid,
    extra_mask,
    m_row,
    is_m,
    i,
    canvas,
    search_positions,
    search_drafts,
    num_search,
    mask_id: int,
    shift: int,
):
    """Appends the S_max predictor rows P_i (position search_positions[i] - shift) to the 2W
    rows; returns the query's tokens, positions, validity, [N, N] mask and the P rows."""
    rows, s_max = tokens.shape[0], search_positions.shape[0]
    k = jnp.arange(s_max)
    p_positions = search_positions - shift
    p_valid = (k < num_search) & (p_positions >= 0)
    p_positions = jnp.maximum(p_positions, 0).astype(jnp.int32)
    # [i, j]: P_i's position is search position j; in view i it holds draft j (j < i) or [MASK]
    same = (p_positions[:, None] == search_positions[None, :]) & (k[None, :] < num_search)
    j = jnp.argmax(same, axis=1)
    p_tokens = jnp.where(jnp.any(same, axis=1), jnp.where(j < k, search_drafts[j], mask_id), canvas[p_positions])
    # P_i attends as M_i does: M_i is the M row with verify-order index i
    m_index = jnp.argmax(is_m[None, :] & (i[None, :] == k[:, None]), axis=1)
    p_mask = m_row[m_index]  # [S_max, 2W]
    n = rows + s_max
    mask = jnp.zeros((n, n), bool).at[:rows, :rows].set(extra_mask).at[rows:, :rows].set(p_mask)
    return (
        jnp.concatenate([tokens, p_tokens.astype(tokens.dtype)]),
        jnp.concatenate([positions, p_positions]),
        jnp.concatenate([row_valid, p_valid]),
        mask,
        (rows + k).astype(jnp.int32),
    )


def accepted_count(
    draft_prob: jax.Array, top_is_draft: jax.Array, num_search: jax.Array, gamma: jax.Array, rule: str
) -> jax.Array:
    """Drafts accepted, a prefix of the search set in verify order.

    draft_prob: float32 [S_max] mask view's probability of each draft; top_is_draft: bool
    [S_max] the mask view's argmax is the draft; entries >= num_search are ignored.
    """
    in_set = jnp.arange(draft_prob.shape[0]) < num_search
    if rule == "cumprod":
        ok = in_set & (jnp.cumprod(jnp.where(in_set, draft_prob, 0.0)) >= gamma)
    elif rule == "paper":
        ok = in_set & top_is_draft & (draft_prob >= gamma)
    else:
        raise ValueError(f"accept={rule!r}: expected 'cumprod' or 'paper'")
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)


def verify_commit(
    slot: Slots,
    plan: VerifyPlan,
    logits: jax.Array,
    stage1_committed: jax.Array,
    gamma: jax.Array,
    rule: str,
    pin: str,
    eos_id: int,
) -> Slots:
    """Stage 2: commits the accepted drafts. logits: [S_max, V] of the M rows.

    stage1_committed: bool [L] this step's stage-1 commits (pinned too with pin='all_commits').
    """
    L = slot.tokens.shape[0]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    draft_prob = jnp.take_along_axis(probs, plan.search_drafts[:, None], axis=-1)[:, 0]
    # a draft at or past the answer bound (set by an EOS, possibly in stage 1) never passes
    draft_prob = jnp.where(plan.search_positions < slot.bound, draft_prob, 0.0)
    top_is_draft = jnp.argmax(probs, axis=-1) == plan.search_drafts
    accepted = accepted_count(draft_prob, top_is_draft, plan.num_search, gamma, rule)
    take = jnp.arange(plan.search_positions.shape[0]) < accepted
    slot = commit_tokens(slot, plan.search_positions, plan.search_drafts, take, eos_id, stop_at_eos=True)
    verified = jnp.zeros((L,), bool).at[jnp.where(take, plan.search_positions, L)].set(True, mode="drop")
    pinned = verified | stage1_committed if pin == "all_commits" else verified
    return slot.replace(
        pinned=pinned,
        verified=slot.verified | verified,
        verify_passes=slot.verify_passes + 1,
        accepted=slot.accepted + accepted,
    )
