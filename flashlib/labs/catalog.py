"""The labs and the mistakes their checkers know, as data: what cells, hints and messages are made of.

A lab names the function the learner writes (the same name is its key in ``LABS``), the
notebook it ends, its signature, the task, what its checker tries, three hints (an idea in words,
then where in the notebook the step is, then something close to code), the known mistakes its
checker names, and the course's own code that ``labs.reveal`` prints once the lab is passed.
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
    reveal: tuple[str, ...] = ()  # "module:function" of the course's code the lab rewrites
    loop: bool = False  # its text asks for the loop written out: torch's fused attention is no answer either

    @property
    def answers(self) -> tuple[str, ...]:
        """"module:function" of the course's own code that computes what this lab asks for: no answer
        may be it, copy its code or call it (:mod:`flashlib.labs.own_code`)."""
        return self.reveal + COURSE_ANSWERS.get(self.name, ())


# beyond what labs.reveal prints: the course's other code that computes a lab's answer
COURSE_ANSWERS = {
    "online_softmax": ("flashlib.softmax:online_softmax", "flashlib.softmax:online_softmax_state",
                       "flashlib.softmax:online_softmax_steps", "flashlib.softmax:softmax_state",
                       "flashlib.softmax:merge_states"),
    "merge_states": ("flashlib.softmax:merge_states", "flashlib.softmax:merge_partials"),
    "tiled_forward": ("flashlib.tiled:tiled_forward", "flashlib.tiled:forward_pass", "flashlib.backward:tiled_attention",
                      "flashlib.dense:dense_attention"),
    "tiled_backward": ("flashlib.backward:tiled_backward", "flashlib.backward:backward_pass",
                       "flashlib.backward:tiled_attention"),
    "split_kv": ("flashlib.splitkv:decode_partials", "flashlib.splitkv:decode_reference", "flashlib.splitkv:split_attention",
                 "flashlib.softmax:merge_partials", "flashlib.dense:dense_attention"),
}


# key -> the name a message gives the mistake, and why it is wrong
MISTAKES = {
    "course_code": ("the course's own code handed in",
                    "the checker compares a lab's answer with the definition; the course's own function (or a "
                    "call to it) is not an answer to the lab."),
    "library_attention": ("PyTorch's fused attention handed in",
                          "this lab asks for the loop written out: torch's scaled_dot_product_attention and "
                          "flex_attention compute the whole answer in one call."),
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
                          "S = q kᵀ · scale, so dq = dS k · scale and dk = dSᵀ q · scale: the scale appears "
                          "once in each."),
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
    "swapped_outputs": ("results returned in each other's place",
                        "the values are right but in the wrong slots: return them in the order the signature "
                        "gives."),
    "exp2_for_exp": ("exp2 where exp is meant",
                     "these scores and this max are natural (no log2 e folded in): 2^(s - m) is the softmax of "
                     "s · ln 2, too flat. Use torch.exp; exp2 belongs to the kernels, whose scores are in base 2."),
    "strict_diagonal": ("the diagonal itself masked",
                        "query i sees key j when j <= i + seq_k - seq_q, the key on its diagonal included "
                        "(a token attends to itself): the visible pairs are j <= i + seq_k - seq_q, not "
                        "j < i + seq_k - seq_q."),
    "lse_base2": ("lse in base 2",
                  "lse is a natural logarithm, m_i + log(l_i): log2(l_i) mixes bases, and the backward pass "
                  "recomputes P as exp(s - lse)."),
    "lse_without_max": ("lse without the max",
                        "l_i is a sum of exp(s - m_i), taken under the running max: log(l_i) lacks it. "
                        "lse = m_i + log(l_i)."),
    "not_normalised": ("the output not divided by l_i",
                       "acc is the unnormalised sum of exp(s - m_i) v: after the last key tile, out = acc / l_i "
                       "(0 where l_i is 0)."),
    "last_tile_only": ("only the last key tile counts",
                       "the running state must carry from one key tile to the next: start m_i, l_i and acc "
                       "before the loop over key tiles, and at the end of each trip set m_i = m_new, so that "
                       "the next tile's alpha rescales what came before instead of wiping it."),
    "padded_keys": ("padded keys left in the scores",
                    "the last key tile reaches past SEQ_K; its padded keys load as 0, so their scores are 0, "
                    "not -inf, and they take a share of the softmax. Mask the scores with offs_k < SEQ_K (as "
                    "well as the causal rule), not only the loads."),
    "tile_delta": ("delta from one tile",
                   "delta_i = sum over every key j of P_ij dP_ij = rowsum(dO ∘ O)_i, a whole row: the sum over "
                   "one tile's p · dp leaves out the other tiles. Read delta (the lab's Delta, or "
                   "(dout * out).sum(-1)) instead."),
    "scaled_twice": ("the scale applied twice",
                     "S = q kᵀ · scale puts the scale once in dq and once in dk. In the dK/dV kernel the "
                     "program multiplies dk by the scale after the loop, so the loop itself leaves dk unscaled."),
    "dot_shapes": ("a product of tiles whose shapes do not fit",
                   "tl.dot(a, b) multiplies a (M, K) tile by a (K, N) tile. k_tile and q_blk are both (rows, "
                   "HEAD_DIM_PAD): their product needs one of them transposed, tl.dot(q_blk, tl.trans(k_tile)) "
                   "for (BLOCK_Q, BLOCK_K) scores, tl.dot(k_tile, tl.trans(q_blk)) for their transpose."),
    "missing_cast": ("a tl.dot of two dtypes",
                     "with float16 inputs the loaded tiles are float16 while p (or ds) is float32, and tl.dot "
                     "needs both operands in one dtype (the tensor cores multiply 16-bit numbers): cast the "
                     "float32 one, p.to(v_tile.dtype), before the product."),
    "no_input_precision": ("a tl.dot without input_precision",
                           "the interpreter multiplies float32 exactly whatever it is told, but on a GPU a float32 "
                           "tl.dot defaults to tf32 (about 3 decimal digits). Pass "
                           "input_precision=INPUT_PRECISION to every tl.dot, as the kernel asks."),
    "bare_inf": ("-inf written as a name",
                 "Triton reads kernels as Python: inf is not a name it knows. Write float(\"-inf\")."),
    "wrong_stride": ("one tensor's stride used for another",
                     "K, V, Q and dO each have their own row stride (here they differ on purpose): the rows of "
                     "a tile of V are stride_vn apart, those of K stride_kn, those of Q stride_qm, those of dO "
                     "stride_dom."),
    "causal_tiles_not_skipped": ("causal tiles computed that could be skipped",
                                 "with CAUSAL, the tiles past the diagonal hold no pair that may attend: the "
                                 "kernel hands the loop its range (k_end for the forward's key tiles, q_start "
                                 "for the dK/dV kernel's query blocks) so that it never loads them. The mask "
                                 "gives the right output either way; skipping them is about half the work."),
    "transposed_broadcast": ("a row term broadcast along the wrong axis",
                             "in the transposed (BLOCK_K, BLOCK_Q) tiles the keys are rows and the queries "
                             "columns: a number per query (lse, delta) spreads along the rows, lse[None, :] "
                             "and delta[None, :]; lse[:, None] gives key r the lse of query r of the block."),
    "averaged_partials": ("the partial outputs averaged",
                          "that averages the partial outputs: each split's output is normalised over the split "
                          "alone, and it weighs e^(lse_s - lse), its share of the softmax denominator, not "
                          "1/num_splits."),
    "summed_partials": ("the partial outputs added",
                        "that adds the partial outputs: each split weighs e^(lse_s - lse), its share of the "
                        "softmax denominator, and the shares add up to 1."),
    "unnormalised_weights": ("the splits' weights not divided by their sum",
                             "the weights e^(lse_s) are not divided by their sum e^lse: weigh split s by "
                             "e^(lse_s - lse), with lse = logsumexp of the lse_s."),
    "last_split_only": ("only the last split kept",
                        "that is the last split's output alone: every split's partial output enters the merge."),
    "no_split": ("the keys not split",
                 "split-KV computes each split of ⌈L / num_splits⌉ keys from its own keys alone (scores, softmax, "
                 "partial output, lse) and only then merges: on a GPU each split is one program, and none reads "
                 "the whole cache. A product over more keys, such as plain attention that ignores num_splits, "
                 "gives the right output without splitting anything."),
    "sink_sign": ("the sign of the sink's gradient",
                  "the sink takes a share of the denominator, so raising it lowers every other probability: "
                  "its gradient is -p · delta, not +p · delta."),
    "sink_not_normalised": ("exp(sink) taken for a probability",
                            "exp(sink) alone is not a probability: divide by the row's denominator, "
                            "p = exp(sink - lse)."),
    "flipped_exponent": ("the exponent's sign flipped",
                         "the sink's probability is exp(sink - lse), at most 1; exp(lse - sink) is its inverse."),
    "sum_axes": ("the wrong sum",
                 "one gradient per head: the sum of -p · delta over every row of that head in every sequence "
                 "(the batch and the rows), neither a mean nor one sequence alone."),
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
         ("no_rescale", "max_starts_at_zero", "nan_empty_rows", "read_after_next", "read_twice", "full_matrix",
          "swapped_outputs", "exp2_for_exp"),
         ("Keep two tensors of shape (rows,) between blocks: the running max m (start: -inf) and the "
          "running sum l (start: 0). Each block updates both.",
          "For a block b: m_new = max(m, b.amax(dim=-1)). The old l was a sum of exp(x - m); under the new "
          "max it is l * exp(m - m_new). Add the block's own exp(b - m_new).sum(dim=-1).",
          "Where m_new is still -inf (only -inf seen so far) exp(m - m_new) is NaN: subtract "
          "torch.where(m_new == float(\"-inf\"), 0.0, m_new) instead of m_new.")),
    Lab("merge_states", "02_online_softmax", "Merge two partial states",
         "merge_states(m_a, l_a, m_b, l_b) -> (m, l)",
         "Two chunks of the same rows have states `(m_a, l_a)` and `(m_b, l_b)` (tensors of one shape). "
         "Return the state `(m, l)` of their concatenation. An empty state `(-inf, 0)` merges without NaN.",
         ("states of random chunks", "maxima in the hundreds", "one or both states empty"),
         ("no_rescale", "inverted_rescale", "overflow", "nan_empty_rows", "swapped_outputs", "exp2_for_exp"),
         ("The merged max is the larger of the two maxima; each l must then be expressed relative to it.",
          "l = l_a * exp(m_a - m) + l_b * exp(m_b - m): both exponents are <= 0, nothing overflows.",
          "When both maxima are -inf, m - m is NaN: shift by torch.where(m == float(\"-inf\"), 0.0, m) instead "
          "of m.")),
    Lab("tiled_forward", "03_tiled_attention", "The tiled forward pass",
         "tiled_forward(q, k, v, block_q, block_k, causal) -> (out, lse)",
         "q is `(batch, heads, seq_q, d)`, k and v `(batch, heads, seq_k, d)`; the scale is `1/sqrt(d)`; causal "
         "is aligned bottom-right. Loop over query blocks of `block_q` rows and, inside, over key tiles of "
         "`block_k` rows, carrying `m_i`, `l_i` and `acc`; return the output and `lse` `(batch, heads, seq_q)`. "
         "Rows that see no key give zeros and `lse = -inf`. Hold one tile of scores at a time.",
         ("uneven last tiles", "seq_q < seq_k and seq_q > seq_k", "causal rows that see no key",
          "scores in the hundreds", "no (seq_q, seq_k) tensor created"),
         ("full_matrix", "nan_empty_rows", "top_left_causal", "strict_diagonal", "causal_mask_missing",
          "dropped_last_tile", "last_tile_only", "unscaled_scores", "max_starts_at_zero", "no_rescale",
          "inverted_rescale", "exp2_for_exp", "lse_base2", "lse_without_max", "not_normalised"),
         ("Two loops: query blocks outside, key tiles inside. A query block carries three things per row from "
          "one key tile to the next (a running max, a running sum and an unnormalised output) and divides only "
          "after its last key tile, so that only one tile of scores ever exists.",
          "Each key tile is one step of notebook 02's online softmax applied to a tile of scores: this "
          "notebook's \"The idea\" gives the step (m_new, alpha, P̃, then l_i, acc and m_i). After the last "
          "tile, out = acc / l_i and lse = m_i + log(l_i). Causal is bottom-right: query i sees key j when "
          "j <= i + seq_k - seq_q.",
          "Per query block q_blk = q[..., q0:q1, :], start m_i at -inf, l_i and acc at 0; per key tile, "
          "s = q_blk @ k[..., k0:k1, :].transpose(-2, -1) * scale with causal pairs filled with -inf; "
          "m_new = torch.maximum(m_i, s.amax(-1)); shift = torch.where(m_new == float(\"-inf\"), 0.0, m_new); "
          "alpha = torch.exp(m_i - shift); p = torch.exp(s - shift[..., None]); l_i = alpha * l_i + p.sum(-1); "
          "acc = alpha[..., None] * acc + p @ v[..., k0:k1, :]; m_i = m_new. Rows whose l_i ends at 0 give "
          "out = 0 and lse = -inf."), loop=True),
    Lab("tiled_backward", "04_backward", "The tiled backward pass",
         "tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal) -> (dq, dk, dv)",
         "From the forward's `out` and `lse` (never from a stored P), compute the gradients tile by tile: "
         "recompute `p = exp(s - lse)` per tile, then `dv += pᵀ dO`, `dp = dO vᵀ`, `ds = p ∘ (dp - delta)` with "
         "`delta = rowsum(dO ∘ O)`, `dq += ds k · scale`, `dk += dsᵀ q · scale`. Same conventions and cases as "
         "the forward.",
         ("uneven last tiles", "seq_q < seq_k and seq_q > seq_k", "causal rows that see no key",
          "scores in the hundreds", "no (seq_q, seq_k) tensor created"),
         ("full_matrix", "nan_empty_rows", "no_delta", "tile_delta", "unscaled_gradient", "scaled_twice",
          "top_left_causal", "strict_diagonal", "causal_mask_missing", "dropped_last_tile", "swapped_outputs",
          "exp2_for_exp"),
         ("Nothing but sums is carried from tile to tile: with lse saved, each tile of P is rebuilt on its "
          "own, with no running max and no rescaling. One number per query row is needed before the loops "
          "start; then each (query block, key tile) pair adds its share to dv and dk of its keys and to dq "
          "of its queries.",
          "This notebook's \"Recomputation from the log-sum-exp\" rebuilds P from lse, \"δ without P\" gives "
          "delta from dO and O alone, and \"The tiled backward\" lists the five products of a tile in order "
          "(dV, dP, dS, dQ, dK). Loop over key tiles outside and query blocks inside.",
          "Once: delta = (dout * out).sum(-1), and lse = torch.where(lse == float(\"-inf\"), float(\"inf\"), lse) "
          "so that rows that saw no key get p = 0. Per tile: s = q_blk @ k_tile.transpose(-2, -1) * scale "
          "(causal pairs -inf), p = torch.exp(s - lse_blk[..., None]), dv_j += p.transpose(-2, -1) @ do_blk, "
          "dp = do_blk @ v_tile.transpose(-2, -1), ds = p * (dp - delta_blk[..., None]), "
          "dq[..., q0:q1, :] += ds @ k_tile * scale, dk_j += ds.transpose(-2, -1) @ q_blk * scale."), loop=True),
    Lab("attn_fwd_inner", "06_fused_forward", "The kernel's loop over key tiles",
         "attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end, qk_scale, "
         "SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_K, CAUSAL, INPUT_PRECISION) -> (m_i, l_i, acc)",
         "Write, as a `@triton.jit` function, the loop of the forward kernel over the key/value tiles before "
         "`k_end`: load each tile, score it in base-2 units (`qk_scale` already holds `scale · log2 e`), mask "
         "it, and fold it into `m_i`, `l_i`, `acc`. The checker launches it inside a copy of the course's forward "
         "kernel (`_attn_fwd_block`, printed under \"The kernel around its loop\", with your loop in place of "
         "`_attn_fwd_inner`); on a CPU, through "
         "Triton's interpreter, it also watches every address the loop loads and every `tl.dot`. Write the loop "
         "in full, with `tl.load`, `tl.dot`, `tl.where` and `tl.math.exp2`, rather than calling the kernel's "
         "helpers.",
         ("uneven lengths", "causal rows that see no key", "head dims that are not powers of two",
          "scores in the hundreds", "float16 inputs", "loads outside K and V", "the precision of every tl.dot"),
         ("masked_loads_missing", "store_outside", "nothing_done", "nan_empty_rows", "top_left_causal",
          "strict_diagonal", "causal_mask_missing", "dropped_last_tile", "padded_keys", "last_tile_only",
          "unscaled_scores", "natural_exp_base2", "no_rescale", "inverted_rescale", "dot_shapes", "missing_cast",
          "no_input_precision", "bare_inf", "wrong_stride", "causal_tiles_not_skipped"),
         ("One trip of the loop is one step of notebook 03's inner loop, with three differences: the tiles come "
          "from pointers, so the last one reaches past SEQ_K and its load must be masked; the scores are in "
          "base 2, so every exponential is a power of 2; and a tile has a fixed size, so pairs that may not "
          "attend are masked to -inf rather than cut off.",
          "The loads are notebook 05's masked loads, of a (BLOCK_K, HEAD_DIM_PAD) tile: rows "
          "offs_k = k0 + tl.arange(0, BLOCK_K), columns offs_d. The update is this notebook's \"The idea: one "
          "multiplier, base 2\" (alpha = 2^(m_old - m_new)); _attn_fwd_block shows what comes in and "
          "what _finish expects back. Pairs that may not attend: keys past SEQ_K and, if CAUSAL, keys past "
          "the bottom-right diagonal.",
          "for k0 in range(0, k_end, BLOCK_K): load k_tile and v_tile with mask=(offs_k[:, None] < SEQ_K) & "
          "(offs_d[None, :] < HEAD_DIM), other=0.0; s = tl.dot(q_blk, tl.trans(k_tile), "
          "input_precision=INPUT_PRECISION) * qk_scale; s = tl.where(visible, s, float(\"-inf\")); "
          "m_new = tl.maximum(m_i, tl.max(s, 1)); shift = tl.where(m_new == float(\"-inf\"), 0.0, m_new); "
          "alpha = tl.math.exp2(m_i - shift); p = tl.math.exp2(s - shift[:, None]); l_i = alpha * l_i + "
          "tl.sum(p, 1); acc = alpha[:, None] * acc + tl.dot(p.to(v_tile.dtype), v_tile, "
          "input_precision=INPUT_PRECISION); m_i = m_new."),
         triton=True, reveal=("flashlib.kernels.forward:_online_update", "flashlib.kernels.forward:_attn_fwd_inner"),
         loop=True),
    Lab("attn_bwd_dkdv_inner", "07_backward_kernels", "The dK/dV kernel's loop over query blocks",
         "attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_k, offs_d, "
         "q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_Q, CAUSAL, INPUT_PRECISION) -> (dk, dv)",
         "Write, as a `@triton.jit` function, the loop of the dK/dV kernel over the query blocks from "
         "`q_start` on: load each block of q and dO with its rows of `Lse` (natural log) and `Delta`, recompute "
         "the transposed probabilities in base 2, and accumulate `dv` and `dk` for this program's key tile (the "
         "kernel multiplies dk by the scale after the loop). The checker launches it inside a copy of the "
         "course's dK/dV kernel (`_attn_bwd_dkdv_block`, printed under \"The idea: two loops, each owning what it "
         "writes\", with your loop in place of `_attn_bwd_dkdv_inner`); "
         "on a CPU, through Triton's interpreter, it also watches every address the loop loads and every "
         "`tl.dot`. "
         "`flashlib.labs.LOG2E` is log2 e as a Triton constant.",
         ("uneven lengths", "causal rows that see no key", "head dims that are not powers of two",
          "scores in the hundreds", "float16 inputs", "loads outside Q, dO, Lse and Delta",
          "the precision of every tl.dot"),
         ("masked_loads_missing", "store_outside", "nothing_done", "natural_exp_base2", "no_delta", "tile_delta",
          "scaled_twice", "top_left_causal", "strict_diagonal", "causal_mask_missing", "dropped_last_tile",
          "swapped_outputs", "dot_shapes", "missing_cast", "no_input_precision", "wrong_stride",
          "causal_tiles_not_skipped", "transposed_broadcast"),
         ("This program owns one key tile: it keeps the tile and its dk and dv in registers while query blocks "
          "stream past, and each block brings its rows of q, dO, lse and delta and adds its share. Work with "
          "transposed tiles, keys as rows, so that each sum over queries is one product with the query block.",
          "The arithmetic is notebook 04's tiled backward without dq (the other kernel's job), transposed. "
          "This notebook's \"The idea\" gives P from the stored lse in base 2: lse is natural, so multiply it by "
          "LOG2E, and rows that saw no key (lse = -inf) or lie past SEQ_Q need +inf so that their P is 0. "
          "_attn_bwd_dkdv_block multiplies dk by the scale after the loop.",
          "for q0 in range(q_start, SEQ_Q, BLOCK_Q): offs_q = q0 + tl.arange(0, BLOCK_Q); load q_blk, do_blk "
          "(mask rows < SEQ_Q and columns < HEAD_DIM), lse (other=float(\"inf\")) and delta (other=0.0); "
          "lse2 = tl.where(lse == float(\"-inf\"), float(\"inf\"), lse * LOG2E); "
          "s_t = tl.dot(k_tile, tl.trans(q_blk), input_precision=INPUT_PRECISION) * qk_scale; "
          "p_t = tl.math.exp2(s_t - lse2[None, :]), 0 where the pair may not attend; dv += tl.dot(p_t.to("
          "do_blk.dtype), do_blk, ...); dp_t = tl.dot(v_tile, tl.trans(do_blk), ...); ds_t = p_t * (dp_t - "
          "delta[None, :]); dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, ...). Return dk, dv."),
         triton=True, reveal=("flashlib.kernels.backward:_attn_bwd_dkdv_inner",
                              "flashlib.kernels.backward:_attn_bwd_dq_inner"), loop=True),
    Lab("split_kv", "10_inference", "Split-KV for one query",
         "split_kv(q, k, v, num_splits) -> out",
         "`q` has shape `(d,)`, `k` and `v` `(L, d)`, float64. Cut the L keys into splits of "
         "⌈L / num_splits⌉ (the last may be shorter); for each, compute the scores `s = k_split q / sqrt(d)`, "
         "the partial output `softmax(s) v_split` and its log-sum-exp; merge the splits and return the output, "
         "shape `(d,)`. Compute each split from its own keys alone, as one GPU program would. In one case the "
         "scores are large enough that `e^(lse_s)` overflows. Try it without `merge_partials`.",
         ("one split, and as many splits as keys", "splits of uneven length",
          "scores past 1000, where e^lse overflows", "every product within one split's keys"),
         ("averaged_partials", "summed_partials", "unnormalised_weights", "last_split_only", "overflow",
          "unscaled_scores", "dropped_last_tile", "exp2_for_exp", "no_split"),
         ("A split's output is normalised over its own keys alone, so the outputs of different splits cannot "
          "simply be added or averaged. What each split brings to the whole softmax is its denominator, and its "
          "log-sum-exp holds it.",
          "This notebook's \"Split-KV: work for every multiprocessor\" gives the merge: lse = log Σ e^(lse_s), "
          "and split s weighs e^(lse_s - lse), its share of the denominator. Notebook 02's merge is the same "
          "step for two states; subtracting lse before the exponential keeps scores past 1000 finite.",
          "size = -(-L // num_splits); for each start in range(0, L, size): s = k[start:start + size] @ q / "
          "math.sqrt(d), keep torch.softmax(s, 0) @ v[start:start + size] and torch.logsumexp(s, 0); then "
          "weights = torch.exp(lses - torch.logsumexp(lses, 0)) over the stacked lse_s, and the output is the "
          "weighted sum of the stacked partial outputs."), loop=True),
    Lab("sink_grad", "12_real_models", "The sink's gradient",
         "sink_grad(sinks, lse, delta) -> dsinks",
         "`sinks` has shape `(heads,)`; `lse` (the log-sum-exp, the sink in it) and `delta = rowsum(dO ∘ O)` "
         "have shape `(batch, heads, rows)`; all float64. Return the gradient of the loss with respect to each "
         "sink, shape `(heads,)`, from these alone. A row that sees no key, in a head whose sink is -inf, has "
         "lse = -inf.",
         ("causal rows in two sequences", "rows that see no key", "a head whose sink is -inf"),
         ("sink_sign", "no_delta", "sink_not_normalised", "exp2_for_exp", "flipped_exponent", "sum_axes",
          "nan_empty_rows"),
         ("A sink is one more score in each row's softmax, with no value vector. Ask what softmax's gradient "
          "gives a score whose value is zero, and how many rows share one head's sink.",
          "This notebook's \"The sink's gradient\" applies notebook 04's dS = P ∘ (dP - delta) to the sink: its "
          "dP is dO · 0 = 0, and its probability, like every P the backward pass recomputes, comes from the lse: "
          "exp(sink - lse). Every row of a head, in every sequence, shares that head's sink.",
          "p = torch.exp(sinks[:, None] - lse), shape (batch, heads, rows), with torch.where(lse == "
          "float(\"-inf\"), 0.0, p) for rows that see nothing; then -(p * delta), summed over the batch "
          "(dim 0) and the rows (dim 2)."),
         reveal=("flashlib.rules:sink_grad",)),
)}
