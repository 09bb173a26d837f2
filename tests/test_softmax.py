import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashlib import merge_states, naive_softmax, online_softmax, online_softmax_steps, safe_softmax, softmax_state


def test_naive_overflows_safe_does_not():
    x = torch.tensor([1000.0, 999.0, 0.0])
    assert torch.isnan(naive_softmax(x)).any()
    ref = torch.softmax(x.double(), 0).float()
    torch.testing.assert_close(safe_softmax(x), ref)
    torch.testing.assert_close(online_softmax(x), ref)


@given(rows=st.integers(1, 4), cols=st.integers(1, 40), block=st.integers(1, 50),
       spread=st.sampled_from([1.0, 30.0, 1e4]), seed=st.integers(0, 2**16))
def test_online_softmax_matches_torch(rows, cols, block, spread, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread
    torch.testing.assert_close(online_softmax(x, block=block), torch.softmax(x, -1))
    torch.testing.assert_close(online_softmax(x.T, dim=0, block=block), torch.softmax(x.T, 0))


def test_steps_record_rescale():
    x = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    steps = online_softmax_steps(x)
    assert [(s.start, s.stop) for s in steps[1:]] == [(0, 1), (1, 2), (2, 3)]
    # the max grows at element 1, so the old denominator is scaled by exp(1 - 3)
    assert steps[2].rescale.item() == pytest.approx(torch.exp(torch.tensor(-2.0)).item())
    assert steps[3].rescale.item() == 1.0
    assert steps[-1].state.l.item() == pytest.approx(torch.exp(x - 3).sum().item())


@given(sizes=st.lists(st.integers(0, 6), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_merge_is_exact_commutative_associative(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(2, n, generator=g, dtype=torch.float64) * 20 for n in sizes]
    a, b, c = (softmax_state(p) for p in parts)
    whole = softmax_state(torch.cat(parts, -1))
    left = merge_states(merge_states(a, b), c)
    right = merge_states(a, merge_states(b, c))
    swapped = merge_states(c, merge_states(b, a))
    for s in (left, right, swapped):
        torch.testing.assert_close(s.m, whole.m)
        torch.testing.assert_close(s.l, whole.l)


def test_online_block_must_be_positive():
    with pytest.raises(ValueError, match="'block'"):
        online_softmax(torch.ones(3), block=0)


@given(split=st.integers(0, 12), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_merge_partials_of_two_key_sets_is_attention_over_both(split, causal, seed):
    from flashlib import dense_attention, merge_partials

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(5, 4, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(12, 4, generator=g, dtype=torch.float64) * 3 for _ in range(2))

    def part(keys):
        # attention over the chosen keys only, written out in float64: rows that see none give (0, -inf)
        visible = torch.zeros(5, 12, dtype=torch.bool)
        visible[:, keys] = True
        if causal:
            visible &= torch.arange(12)[None, :] <= torch.arange(5)[:, None] + 7
        s = ((q @ k.T) * 0.5).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse)[:, None])
        return p @ v, lse

    out, lse = merge_partials(*part(list(range(split))), *part(list(range(split, 12))))
    full_out, full_lse = part(list(range(12)))
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(lse, full_lse)
    torch.testing.assert_close(out, dense_attention(q, k, v, causal=causal, scale=0.5))


def test_merge_partials_of_two_empty_parts_stays_empty():
    from flashlib import merge_partials

    out, lse = merge_partials(torch.zeros(3, 2), torch.full((3,), float("-inf")),
                              torch.zeros(3, 2), torch.full((3,), float("-inf")))
    assert torch.equal(out, torch.zeros(3, 2)) and torch.isneginf(lse).all()
