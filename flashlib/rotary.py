"""Rotary position embedding (RoPE), as decoding applies it to the new tokens' queries and keys.

A head vector x of dimension d is rotated in pairs of its first ``rotary_dim`` coordinates (the rest
pass unchanged): pair k turns by the angle θ_k(p) of the token's position p, so that the dot product
of a rotated query and key depends on the two positions only through their difference::

    (x_a, x_b) -> (x_a cos θ - x_b sin θ,  x_a sin θ + x_b cos θ)

``cos`` and ``sin`` are tables (positions, rotary_dim / 2) of cos θ_k(p) and sin θ_k(p). Which
coordinates pair up is a convention: GPT-NeoX's halves (x_k with x_{k + rotary_dim/2}: Llama, and
transformers' ``rotate_half``) or GPT-J's neighbours (x_{2k} with x_{2k+1}: ``interleaved``),
as flash-attn's ``rotary_interleaved`` says.
"""
from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                 interleaved: bool = False) -> torch.Tensor:
    """x (..., n, d) rotated at ``positions`` (broadcasting to (..., n), integers into the tables'
    rows); cos, sin (positions, rotary_dim / 2). Computed in float32 at least, returned in x's dtype."""
    half = cos.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)
    c, s = cos.to(work)[positions.long()], sin.to(work)[positions.long()]  # (..., n, rotary_dim / 2)
    rot, rest = x[..., :2 * half].to(work), x[..., 2 * half:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., :half], rot[..., half:]
    turned_a, turned_b = a * c - b * s, a * s + b * c
    if interleaved:
        turned = torch.stack((turned_a, turned_b), dim=-1).flatten(-2)
    else:
        turned = torch.cat((turned_a, turned_b), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)
