# A worked solution of the lab sink_grad (notebook 12): a score with no value, from the lse and delta.
import torch


def sink_grad(sinks, lse, delta):
    """One gradient per head (heads,) from sinks (heads,) and lse, delta (batch, heads, rows)."""
    p_sink = torch.exp(sinks[:, None] - lse)  # (batch, heads, rows): the sink's share of each row
    # a row that sees no key under a sink of -inf has lse = -inf: exp(-inf + inf) is NaN, its share is 0
    p_sink = torch.where(lse == float("-inf"), 0.0, p_sink)
    # dS = P (dP - delta) with dP = dO . 0 = 0; every row of a head, in every sequence, shares its sink
    return -(p_sink * delta).sum(dim=(0, 2))
