"""Independent float64 references for the variants: the visibility rule pair by pair, and attention
with an explicit mask, grouped heads repeated by hand. No flashlib code."""
import math

import torch


def rule(i, j, seq_q, seq_k, causal=False, window=(-1, -1), mask_mod=None, b=0, h=0):
    """The visibility rule of flash_attention's docstring, for one pair."""
    o = seq_k - seq_q
    left, right = window if window is not None else (-1, -1)
    return ((not causal or j <= i + o) and (left < 0 or j >= i + o - left) and (right < 0 or j <= i + o + right)
            and (mask_mod is None or bool(mask_mod(b, h, i, j))))


def pairwise(seq_q, seq_k, **kw):
    """(seq_q, seq_k) boolean mask from :func:`rule`."""
    return torch.tensor([[rule(i, j, seq_q, seq_k, **kw) for j in range(seq_k)] for i in range(seq_q)],
                        dtype=torch.bool).reshape(seq_q, seq_k)


def explicit_attention(q, k, v, *, causal=False, window=None, softcap=None, mask_mod=None, scale=None):
    """(out, lse) in float64 for (batch, heads, seq, d) q and (batch, kv_heads, seq, d) k, v:
    query head h reads kv head h // (heads // kv_heads); differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, seq_q, d = q.shape
    group = heads // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    outs, lses = [], []
    for b in range(batch):
        for h in range(heads):
            s = q[b, h] @ k[b, h // group].T * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            visible = pairwise(seq_q, k.shape[2], causal=causal, window=window,
                               mask_mod=None if mask_mod is None else (lambda _b, _h, i, j: mask_mod(b, h, i, j)))
            s = s.masked_fill(~visible, -math.inf)
            lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
            p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[:, None])
            outs.append(p @ v[b, h // group])
            lses.append(lse)
    out = torch.stack(outs).reshape(batch, heads, seq_q, v.shape[-1]) if outs else q.new_zeros(q.shape)
    lse = torch.stack(lses).reshape(batch, heads, seq_q) if lses else q.new_zeros(q.shape[:-1])
    return out, lse


def loss(out, lse):
    """A loss through out and through lse (rows that see no key: lse -inf, no gradient)."""
    weights = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)
    return (out * weights).square().sum() + 0.3 * torch.where(torch.isfinite(lse), lse, 0.0).sum()


def outputs_and_grads(fn, q, k, v):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) under :func:`loss`."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss(out, lse).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def assert_matches(got, want, atol=3e-5, rtol=1e-4):
    """Kernel results against float64 ones: the same rows without keys (lse -inf), the rest close."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        if name == "lse":
            assert torch.equal(torch.isinf(g), torch.isinf(w)), "rows without keys must have lse = -inf"
            g, w = g[torch.isfinite(w)], w[torch.isfinite(w)]
        torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=rtol, msg=name)
