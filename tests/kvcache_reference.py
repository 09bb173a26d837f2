"""flash-attn's own reference for ``flash_attn_with_kvcache``, rewritten for flashlib's layout.

What its ``test_flash_attn_kvcache`` asks, spelled out without flashlib's rules: the cache after the
new keys and values are written (rotated keys, pool rows picked by ``cache_batch_idx``), a key
padding mask (positions below the lengths, from the left padding on), and its ``attention_ref``
with ``construct_local_mask``: query i of seq_q sits at i + sk - sq in the coordinates of the
sequence without its left padding (sk its valid keys there), with a window (left, right) around it
and the causal rule as window (-1, 0). Rotary embeddings come from transformers' own functions.
"""
from __future__ import annotations

import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary


def rotate(x, cos, sin, positions, interleaved):
    """x (batch, heads, n, d) rotated by transformers: Llama's rotate_half or GPT-J's rotate_every_two
    on the first 2 * cos.shape[1] dims; positions (batch, n)."""
    half = cos.shape[1]
    if half == 0:
        return x
    c, s = cos[positions], sin[positions]  # (batch, n, half)
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:  # GPT-J: (batch, seq, heads, dim) with (batch, seq, dim / 2) tables
        turned = gptj_rotary(rot.transpose(1, 2), s, c).transpose(1, 2)
    else:
        turned, _ = llama_rotary(rot, rot, torch.cat((c, c), -1), torch.cat((s, s), -1))
    return torch.cat((turned, rest), dim=-1)


def kvcache_reference(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, rotary=None,
                      interleaved=False, cache_batch_idx=None, cache_leftpad=None, causal=True, window=(-1, -1),
                      bias=None, scale=None, dtype=torch.float64):
    """Attention of q (batch, heads, seq_q, d) over contiguous caches as flash-attn's test computes it,
    in ``dtype`` (float64: the reference; float32: PyTorch's own error, the rule's baseline); bias(b,
    h, i, j) an additive bias on relative positions (flash-attn's ALiBi), or None. Returns (out, the
    caches as the call must leave them)."""
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    batch, heads, seq_q, d = q.shape
    if cache_batch_idx is not None:
        k_seq, v_seq = k_cache[cache_batch_idx.long()], v_cache[cache_batch_idx.long()]
    else:
        k_seq, v_seq = k_cache.clone(), v_cache.clone()
    seqlens = cache_seqlens.long()
    seqlen_k = k_seq.shape[2]
    arange = torch.arange(seqlen_k)[None, :]
    n_new = 0 if k_new is None else k_new.shape[2]
    if k_new is not None:
        k_new, v_new = k_new.to(dtype), v_new.to(dtype)
        if rotary is not None:
            cos, sin = (t.to(dtype) for t in rotary)
            k_new = rotate(k_new, cos, sin, seqlens[:, None] + torch.arange(n_new)[None, :], interleaved)
            moving = causal or window != (-1, -1)
            q_pos = seqlens[:, None] + (torch.arange(seq_q)[None, :] if moving else torch.zeros(1, seq_q, dtype=torch.long))
            q = rotate(q, cos, sin, q_pos, interleaved)
        update = (seqlens[:, None] <= arange) & (arange < seqlens[:, None] + n_new)  # (batch, seqlen_k)
        for b in range(batch):
            k_seq[b][:, update[b]] = k_new[b]
            v_seq[b][:, update[b]] = v_new[b]
    key_mask = arange < seqlens[:, None] + n_new
    leftpad = torch.zeros(batch, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long()
    key_mask &= arange >= leftpad[:, None]
    group = heads // k_seq.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (k_seq, v_seq))
    s = (q / d ** 0.5 if scale is None else q * scale) @ k.transpose(-1, -2)  # (batch, heads, seq_q, seqlen_k)
    # construct_local_mask, in the unpadded coordinates
    row = torch.arange(seq_q)[None, None, :, None]
    col = torch.arange(seqlen_k)[None, None, None, :] - leftpad[:, None, None, None]
    sk = key_mask.sum(-1)[:, None, None, None]
    diag = row + sk - seq_q
    left, right = (-1, 0) if causal and window == (-1, -1) else window
    if causal:
        right = 0
    hidden = torch.zeros_like(s, dtype=torch.bool)
    if right >= 0:
        hidden |= col > torch.minimum(diag + right, sk)
    if left >= 0:
        hidden |= col < diag - left
    hidden |= ~key_mask[:, None, None, :]
    if bias is not None:
        s = s + bias(torch.arange(batch)[:, None, None, None], torch.arange(heads)[None, :, None, None], diag,
                     col).to(dtype)
    s = s.masked_fill(hidden, float("-inf"))
    empty = hidden.all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return p @ v, (k_seq, v_seq)
