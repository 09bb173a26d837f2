# A worked solution of the lab split_kv (notebook 10): attention over chunks of the keys, then the merge.
import math

import torch


def split_kv(q, k, v, num_splits):
    """Attention of one query q (d,) over keys and values k, v (L, d), chunk by chunk, merged exactly."""
    size = -(-k.shape[0] // num_splits)  # ceil(L / num_splits); the last chunk may be shorter
    outs, lses = [], []
    for start in range(0, k.shape[0], size):
        s = k[start:start + size] @ q / math.sqrt(q.shape[0])  # (chunk,)
        outs.append(torch.softmax(s, dim=0) @ v[start:start + size])  # normalised over this chunk alone
        lses.append(torch.logsumexp(s, dim=0))  # what the chunk brings to the whole denominator
    lses = torch.stack(lses)  # (chunks,)
    # chunk s weighs e^(lse_s - lse), its share of the denominator: subtracting lse first keeps it finite
    shares = torch.exp(lses - torch.logsumexp(lses, dim=0))
    return (shares[:, None] * torch.stack(outs)).sum(dim=0)
