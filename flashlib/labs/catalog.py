"""The labs and the mistakes their checkers know, as data: what cells, hints and messages are made of.

A lab names the function the learner writes (the same name is its key in ``LABS``), the
notebook it ends, its signature, the task, what its checker tries, three hints from gentle to
nearly the answer, and the known mistakes its checker names.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lab:
    name: str
    notebook: str               # the notebook whose end it sits at, e.g. "02_online_softmax"
    title: str
    signature: str
    task: str                   # markdown: what to write, in a few sentences
    tries: tuple[str, ...]      # what the checker runs the function on
    mistakes: tuple[str, ...]   # keys of MISTAKES the checker recognises
    hints: tuple[str, str, str]
    triton: bool = False


# key -> the name a message gives the mistake, and why it is wrong
MISTAKES = {
    "no_rescale": ("no rescale when the max grew",
                   "the running sum was not rescaled when the row max grew: rows whose max is in a later block "
                   "come out too large. Multiply what was accumulated under the old max by exp(m_old - m_new)."),
    "max_starts_at_zero": ("a running max that starts at 0",
                           "rows whose entries are all far below 0 come out wrong: with m starting at 0 instead "
                           "of -inf, exp(x - 0) underflows to 0 (and the max of such a row is not 0). Start m "
                           "at -inf."),
    "nan_empty_rows": ("NaN for rows that see nothing",
                       "a row that has seen nothing yet (no visible key, or only -inf) has m = -inf, and "
                       "exp(-inf - (-inf)) = exp(NaN) = NaN. Shift by 0 where m is -inf (the course's _finite), "
                       "so that exp(-inf - 0) = 0; a row that ends with l = 0 gives out = 0 and lse = -inf."),
    "top_left_causal": ("top-left causal diagonal",
                        "the mask lets query i see key j when j <= i (PyTorch SDPA's convention). The course "
                        "aligns causal attention bottom-right: query i sees key j when j <= i + seq_k - seq_q, "
                        "so that the last query sees every key."),
    "dropped_last_tile": ("the last uneven tile dropped",
                          "when a length is not a multiple of the tile size the last tile is shorter, and it "
                          "still has to be computed: loop over range(0, n, block) and cut each tile at "
                          "min(start + block, n)."),
    "full_matrix": ("the full score matrix held",
                    "the point of tiling is that only one (block_q, block_k) tile of scores exists at a time; "
                    "a (seq_q, seq_k) score or probability matrix is what FlashAttention never builds."),
    "natural_exp_base2": ("natural exp mixed with base-2 units",
                          "the kernel's scores are in base-2 units (qk_scale = scale · log2 e), so its running "
                          "max is too: every exponential must be exp2, and a natural lse must be multiplied by "
                          "log2 e before it meets base-2 scores."),
    "no_delta": ("no delta term in dS",
                 "dS = P ∘ (dP - delta) with delta = rowsum(dO ∘ O): softmax's Jacobian subtracts, for each "
                 "row, the probability-weighted mean of dP. Without it dq and dk are wrong while dv is right."),
    "unscaled_gradient": ("dq or dk not scaled",
                          "S = q kᵀ · scale, so dq = dS k · scale and dk = dSᵀ q · scale: the scale appears once "
                          "in each."),
    "masked_loads_missing": ("masked loads missing",
                             "a tile of BLOCK rows and HEAD_DIM_PAD columns reaches past the tensor at the last "
                             "tile and in the padded columns: load it with mask=(rows < n) & (cols < HEAD_DIM) "
                             "and other=0.0 (what _load_rows does)."),
    "store_outside": ("a store outside the tensor",
                      "every tl.store needs the same mask as its load: rows < n and columns < HEAD_DIM."),
    "read_after_next": ("a block kept after the next one arrived",
                        "blocks stream past once: when the next block arrives the previous one is gone. Keep "
                        "only the running (m, l) between blocks."),
    "read_twice": ("the blocks read twice",
                   "blocks is an iterator and can be read once; a second pass finds nothing. One pass with a "
                   "running max and a rescaled sum is the whole point."),
    "overflow": ("exp of an unshifted max",
                 "exp(m) overflows for m in the hundreds (float32 tops out near exp(88)); only ever "
                 "exponentiate differences, exp(m_a - m), which are <= 0."),
    "inverted_rescale": ("the rescale factor inverted",
                         "the part whose max is smaller than the new max must shrink: multiply it by "
                         "exp(m_part - m), not exp(m - m_part)."),
    "unscaled_scores": ("scores not scaled",
                        "the scores are q kᵀ · scale with scale = 1/sqrt(head_dim)."),
    "causal_mask_missing": ("the causal mask not applied",
                            "pairs above the diagonal must not count: their probabilities are 0 (tl.where with "
                            "the _visible mask)."),
    "nothing_done": ("nothing computed yet",
                     "the function returned what it was given."),
}


LABS = {lab.name: lab for lab in (
    Lab("online_softmax", "02_online_softmax", "Online softmax over a stream of blocks",
         "online_softmax(blocks) -> (m, l)",
         "`blocks` is an iterator of `(rows, b_j)` tensors: the columns of one matrix, left to right, "
         "widths that may differ. Read each block once and return each row's max `m` and "
         "`l = sum(exp(x - m))`, both of shape `(rows,)`. A row of only `-inf` gives `m = -inf`, `l = 0`, "
         "no NaN.",
         ("blocks of different widths", "rows whose max comes in a later block",
          "rows of large negative numbers", "rows that begin with -inf or are all -inf",
          "a block wiped once the next one is read"),
         ("no_rescale", "max_starts_at_zero", "nan_empty_rows", "read_after_next", "read_twice", "full_matrix"),
         ("Keep two tensors of shape (rows,) between blocks: the running max m (start: -inf) and the "
          "running sum l (start: 0). Each block updates both.",
          "For a block b: m_new = max(m, b.amax(dim=-1)). The old l was a sum of exp(x - m); under the new "
          "max it is l * exp(m - m_new). Add the block's own exp(b - m_new).sum(dim=-1).",
          "Where m_new is still -inf (only -inf seen so far) exp(m - m_new) is NaN: subtract "
          "torch.where(m_new == -inf, 0, m_new) instead of m_new.")),
    Lab("merge_states", "02_online_softmax", "Merge two partial states",
         "merge_states(m_a, l_a, m_b, l_b) -> (m, l)",
         "Two chunks of the same rows have states `(m_a, l_a)` and `(m_b, l_b)` (tensors of one shape). "
         "Return the state `(m, l)` of their concatenation. An empty state `(-inf, 0)` merges without NaN.",
         ("states of random chunks", "maxima in the hundreds", "one or both states empty"),
         ("no_rescale", "inverted_rescale", "overflow", "nan_empty_rows"),
         ("The merged max is the larger of the two maxima; each l must then be expressed relative to it.",
          "l = l_a * exp(m_a - m) + l_b * exp(m_b - m): both exponents are <= 0, nothing overflows.",
          "When both maxima are -inf, m - m is NaN: shift by torch.where(m == -inf, 0, m) instead of m.")),
    Lab("tiled_forward", "03_tiled_attention", "The tiled forward pass",
         "tiled_forward(q, k, v, block_q, block_k, causal) -> (out, lse)",
         "q is `(batch, heads, seq_q, d)`, k and v `(batch, heads, seq_k, d)`; the scale is `1/sqrt(d)`; causal "
         "is aligned bottom-right. Loop over query blocks of `block_q` rows and, inside, over key tiles of "
         "`block_k` rows, carrying `m_i`, `l_i` and `acc`; return the output and `lse` `(batch, heads, seq_q)`. "
         "Rows that see no key give zeros and `lse = -inf`. Hold one tile of scores at a time.",
         ("uneven last tiles", "seq_q < seq_k and seq_q > seq_k", "causal rows that see no key",
          "scores in the hundreds", "no (seq_q, seq_k) tensor created"),
         ("full_matrix", "nan_empty_rows", "top_left_causal", "dropped_last_tile", "unscaled_scores",
          "max_starts_at_zero", "no_rescale"),
         ("For each query block q_blk = q[..., q0:q1, :] start m_i = -inf, l_i = 0, acc = 0; for each key tile "
          "compute s = q_blk @ k_tile.transpose(-2, -1) * scale, a (block_q, block_k) tile.",
          "Fold a tile in: m_new = max(m_i, s.amax(-1)); alpha = exp(m_i - m_new); p = exp(s - m_new); "
          "l_i = alpha * l_i + p.sum(-1); acc = alpha * acc + p @ v_tile. After the last tile, out = acc / l_i "
          "and lse = m_i + log(l_i).",
          "Causal: build the tile's mask from indices, key j visible to query i when j <= i + seq_k - seq_q, and "
          "fill s with -inf outside it. Shift by 0 where m_new is -inf, and give rows with l_i == 0 out = 0, "
          "lse = -inf.")),
    Lab("tiled_backward", "04_backward", "The tiled backward pass",
         "tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal) -> (dq, dk, dv)",
         "From the forward's `out` and `lse` (never from a stored P), compute the gradients tile by tile: "
         "recompute `p = exp(s - lse)` per tile, then `dv += pᵀ dO`, `dp = dO vᵀ`, `ds = p ∘ (dp - delta)` with "
         "`delta = rowsum(dO ∘ O)`, `dq += ds k · scale`, `dk += dsᵀ q · scale`. Same conventions and cases as "
         "the forward.",
         ("uneven last tiles", "seq_q < seq_k and seq_q > seq_k", "causal rows that see no key",
          "scores in the hundreds", "no (seq_q, seq_k) tensor created"),
         ("full_matrix", "nan_empty_rows", "no_delta", "unscaled_gradient", "top_left_causal",
          "dropped_last_tile"),
         ("Compute delta = (dout * out).sum(-1) once. Loop over key tiles outside and query blocks inside, "
          "accumulating dk_j and dv_j for the key tile and adding into dq[..., q0:q1, :].",
          "Per tile: s = q_blk @ k_tile.transpose(-2, -1) * scale (masked to -inf), p = exp(s - lse_blk[..., None]), "
          "dv_j += p.transpose(-2, -1) @ do_blk, dp = do_blk @ v_tile.transpose(-2, -1), "
          "ds = p * (dp - delta_blk[..., None]).",
          "dq += ds @ k_tile * scale and dk_j += ds.transpose(-2, -1) @ q_blk * scale. Rows with lse = -inf saw "
          "no key: replace their lse by +inf so that p = exp(-inf - inf) = 0.")),
    Lab("attn_fwd_inner", "06_fused_forward", "The kernel's loop over key tiles",
         "attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end, qk_scale, "
         "SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_K, CAUSAL, INPUT_PRECISION) -> (m_i, l_i, acc)",
         "Write, as a `@triton.jit` function, the loop of the forward kernel over the key/value tiles before "
         "`k_end`: load each tile, score it in base-2 units (`qk_scale` already holds `scale · log2 e`), mask "
         "it, and fold it into `m_i`, `l_i`, `acc`. The checker launches it inside the course's forward kernel "
         "through Triton's interpreter and watches every address it loads. The signature is that of the teaching "
         "kernel's `_attn_fwd_inner` (`flashlib/kernels/forward.py`): write the body without its helpers "
         "`_score_tile` and `_online_update`.",
         ("uneven lengths", "causal rows that see no key", "a head dim that is not a power of two",
          "scores in the hundreds", "loads outside K and V"),
         ("masked_loads_missing", "store_outside", "nothing_done", "nan_empty_rows", "top_left_causal",
          "causal_mask_missing", "dropped_last_tile", "natural_exp_base2", "no_rescale"),
         ("for k0 in range(0, k_end, BLOCK_K): offs_k = k0 + tl.arange(0, BLOCK_K); load K and V rows offs_k "
          "with a mask on rows < SEQ_K and columns offs_d < HEAD_DIM, other=0.0.",
          "s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION) * qk_scale, then "
          "tl.where(mask, s, float('-inf')) with the mask of pairs that exist and, if CAUSAL, "
          "offs_k[None, :] <= offs_q[:, None] + SEQ_K - SEQ_Q.",
          "m_new = tl.maximum(m_i, tl.max(s, 1)); shift = tl.where(m_new == -inf, 0, m_new); "
          "alpha = tl.math.exp2(m_i - shift); p = tl.math.exp2(s - shift[:, None]); l_i = alpha * l_i + "
          "tl.sum(p, 1); acc = alpha[:, None] * acc + tl.dot(p, v_tile); m_i = m_new."),
         triton=True),
    Lab("attn_bwd_dkdv_inner", "07_backward_kernels", "The dK/dV kernel's loop over query blocks",
         "attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_k, offs_d, "
         "q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_Q, CAUSAL, INPUT_PRECISION) -> (dk, dv)",
         "Write, as a `@triton.jit` function, the loop of the dK/dV kernel over the query blocks from "
         "`q_start` on: load each block of q and dO with its rows of `Lse` (natural log) and `Delta`, recompute "
         "the transposed probabilities in base 2, and accumulate `dv` and `dk` for this program's key tile (the "
         "kernel multiplies dk by the scale after the loop). The checker launches it inside the course's "
         "dK/dV kernel through Triton's interpreter and watches every address it loads. The signature is that of "
         "the teaching kernel's `_attn_bwd_dkdv_inner` (`flashlib/kernels/backward.py`).",
         ("uneven lengths", "causal rows that see no key", "a head dim that is not a power of two",
          "scores in the hundreds", "loads outside Q, dO, Lse and Delta"),
         ("masked_loads_missing", "store_outside", "nothing_done", "natural_exp_base2", "no_delta",
          "top_left_causal", "causal_mask_missing", "dropped_last_tile"),
         ("for q0 in range(q_start, SEQ_Q, BLOCK_Q): offs_q = q0 + tl.arange(0, BLOCK_Q); load q and dO rows "
          "with a mask (rows < SEQ_Q, columns < HEAD_DIM), and Lse, Delta with mask offs_q < SEQ_Q.",
          "Keys are this program's rows, so work transposed: s_t = tl.dot(k_tile, tl.trans(q_blk)) * qk_scale "
          "is (BLOCK_K, BLOCK_Q) in base 2; the lse must be too: lse * log2 e (+inf for padding rows and rows "
          "that saw no key). p_t = tl.math.exp2(s_t - lse[None, :]), set to 0 outside the visible pairs.",
          "dv += tl.dot(p_t, do_blk); dp_t = tl.dot(v_tile, tl.trans(do_blk)); ds_t = p_t * (dp_t - "
          "delta[None, :]); dk += tl.dot(ds_t, q_blk). Return dk, dv."),
         triton=True),
)}
