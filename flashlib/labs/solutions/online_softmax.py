# A worked solution of the lab online_softmax (notebook 02): one pass, two numbers per row.
import torch


def online_softmax(blocks):
    """Each row's max m and l = sum(exp(x - m)), reading the (rows, b_j) blocks once, left to right."""
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)  # nothing seen yet; both become (rows,)
    for block in blocks:  # (rows, b_j)
        m_new = torch.maximum(m, block.amax(dim=-1))
        shift = torch.where(m_new == float("-inf"), 0.0, m_new)  # only -inf so far: exp(-inf - 0) = 0, not NaN
        # the old sum was taken under the old max: rescale it by exp(m - m_new) before adding the block's
        l = l * torch.exp(m - shift) + torch.exp(block - shift[:, None]).sum(dim=-1)
        m = m_new
    return m, l
