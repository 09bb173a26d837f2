"""Exercise checkers of notebook 13: a score function's gradient contribution (ALiBi's slopes),
checked against autograd of the score function itself; each wrong try gets a diagnosis and the
next hint (the idea, the structure, then code); ``solution("alibi_grad")`` prints an answer at once."""
from __future__ import annotations

import torch

from .. import scores
from .exercises import HintSteps, print_solution, _call, _failed, _passed, _unanswered

ALIBI = dict(batch=2, heads=3, n=7)
ALIBI_HINTS = HintSteps(
    "ALiBi adds slopes[h] * (kv_idx - q_idx) to each score of head h, so a change of slopes[h] moves every score "
    "of that head by its distance (kv_idx - q_idx): the slope's gradient adds up dS times that distance",
    "make a (n, n) tensor of distances kv_idx - q_idx (torch.arange(n) as a row minus the same as a column), "
    "multiply ds (batch, heads, n, n) by it, and sum over every dim but the heads': (batch, query, key)",
    answer="alibi_grad")
SOLUTIONS = {"alibi_grad": ALIBI_HINTS}


def solution(name: str) -> None:
    """Print an answer to exercise ``name`` at once (the checker gives it only after repeated tries)."""
    print_solution(SOLUTIONS, name)


def alibi_case(seed: int = 0):
    """(ds, slopes): a gradient of the modified scores, (batch, heads, n, n) float64, and the slopes."""
    batch, heads, n = ALIBI.values()
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, n, generator=g, dtype=torch.float64), scores.alibi_slopes(heads).double()


def expected_alibi_grad(ds: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """d loss / d slopes by autograd through the score function itself, given ds = d loss / d s'."""
    slopes = slopes.detach().clone().requires_grad_()
    batch, heads, n, _ = ds.shape
    s = torch.zeros_like(ds)
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    modified = scores.alibi(slopes)(s, b, h, torch.arange(n)[:, None], torch.arange(n)[None, :])
    (grad,) = torch.autograd.grad(modified, slopes, grad_outputs=ds)
    return grad


def check_alibi_grad(alibi_grad) -> bool:
    """``alibi_grad(ds) -> (heads,)``: the gradient of ALiBi's slopes from ds = d loss / d s' of shape
    (batch, heads, n, n), against autograd; named mistakes: the distance's sign, no distance, the
    batch or the heads summed the wrong way, the rows' mean."""
    unanswered = _unanswered(alibi_grad, "a function alibi_grad(ds) -> a (heads,) tensor")
    if unanswered is not None:
        return unanswered
    ds, slopes = alibi_case()
    got, error = _call(alibi_grad, "alibi_grad", ds.clone())
    if error:
        return _failed(error, ALIBI_HINTS)
    want = expected_alibi_grad(ds, slopes)
    heads = want.shape[0]
    if not isinstance(got, torch.Tensor):
        return _failed(f"alibi_grad should return a torch.Tensor of shape ({heads},), one number per head; got "
                       f"{type(got).__name__}", ALIBI_HINTS)
    got = got.double()
    if got.shape == ds.shape[:2]:
        return _failed(f"alibi_grad returned shape {tuple(got.shape)}, one number per (batch row, head): the slopes "
                       "are shared by the batch, so their gradient sums over it too", ALIBI_HINTS)
    if got.numel() == 1:
        return _failed("alibi_grad returned one number: each head has its own slope, so sum over everything but "
                       "the heads", ALIBI_HINTS)
    if tuple(got.shape) != (heads,):
        return _failed(f"alibi_grad returned shape {tuple(got.shape)}; expected ({heads},), one per head",
                       ALIBI_HINTS)
    if torch.allclose(got, want, rtol=1e-9, atol=1e-9):
        ALIBI_HINTS.reset()
        return _passed("the slopes' gradient equals autograd's, for every head.")
    n = ds.shape[-1]
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).double()
    mistakes = [(-want, "every head has the wrong sign: the distance is kv_idx - q_idx (negative for past keys), "
                        "not q_idx - kv_idx"),
                (ds.sum(dim=(0, 2, 3)), "that is the gradient of a per-head bias added to every score: ALiBi's "
                                        "slope multiplies the distance, so each dS counts times its distance"),
                ((ds * distance.abs()).sum(dim=(0, 2, 3)), "|kv_idx - q_idx| drops the sign of the distance: keys "
                                                           "after the query have positive distances here"),
                ((ds * distance).mean(dim=(0, 2, 3)), "a mean, not a sum: every score of the head adds its whole "
                                                       "share to the slope's gradient"),
                ((ds * distance).sum(dim=(0, 2, 3)) / ds.shape[0], "divided by the batch: the slopes are shared, "
                                                                    "so every batch row adds its share in full")]
    for wrong, advice in mistakes:
        if torch.allclose(got, wrong, rtol=1e-9, atol=1e-9):
            return _failed(f"not yet: {advice}.", ALIBI_HINTS)
    worst = int((got - want).abs().argmax())
    return _failed(f"head {worst}: yours {got[worst].item():.6g}, autograd's {want[worst].item():.6g}; the others are "
                   f"off by up to {(got - want).abs().max().item():.3g}.", ALIBI_HINTS)
