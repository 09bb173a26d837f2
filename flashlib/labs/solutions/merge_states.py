# A worked solution of the lab merge_states (notebook 02): the state of two chunks side by side.
import torch


def merge_states(m_a, l_a, m_b, l_b):
    """(m, l) of the concatenation of two chunks, from each chunk's running max m and sum l."""
    m = torch.maximum(m_a, m_b)
    shift = torch.where(m == float("-inf"), 0.0, m)  # both chunks empty: exp(-inf - 0) = 0, not NaN
    # each sum was taken under its own max: rescale both to the merged max (exponents <= 0, no overflow)
    return m, l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)
