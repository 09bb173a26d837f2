# A worked solution of the lab split_kv (notebook 10): attention over splits of the keys, then the merge.
import math

import torch


def split_kv(q, k, v, num_splits):
    """Attention of one query q (d,) over keys and values k, v (L, d), split by split, merged exactly."""
    size = -(-k.shape[0] // num_splits)  # ceil(L / num_splits); the last split may be shorter
    outs, lses = [], []
    for start in range(0, k.shape[0], size):
        s = k[start:start + size] @ q / math.sqrt(q.shape[0])  # (split,)
        outs.append(torch.softmax(s, dim=0) @ v[start:start + size])  # normalised over this split alone
        lses.append(torch.logsumexp(s, dim=0))  # what the split brings to the whole denominator
    lses = torch.stack(lses)  # (splits,)
    # split s weighs e^(lse_s - lse), its share of the denominator: subtracting lse first keeps it finite
    shares = torch.exp(lses - torch.logsumexp(lses, dim=0))
    return (shares[:, None] * torch.stack(outs)).sum(dim=0)
