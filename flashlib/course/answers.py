"""The exercises' worked answers (the last step of their hints), by exercise: the student edition leaves
this file out, as it leaves out the labs' solutions (tools/student_edition.py)."""

ANSWERS = {
    "alibi_grad": (
        "def alibi_grad(ds):\n"
        "    n = ds.shape[-1]\n"
        "    distance = torch.arange(n)[None, :] - torch.arange(n)[:, None]  # kv_idx - q_idx\n"
        "    return (ds * distance).sum(dim=(0, 2, 3))"
    ),
    "cascade_merge": (
        "def merge(out_p, lse_p, out_s, lse_s):\n"
        "    lse = torch.logaddexp(lse_p, lse_s)\n"
        "    safe = torch.where(torch.isneginf(lse), 0.0, lse)  # a row that saw no key in either part\n"
        "    out = torch.exp(lse_p - safe)[..., None] * out_p + torch.exp(lse_s - safe)[..., None] * out_s\n"
        "    return out, lse"
    ),
    "sink_window": (
        "def sink_window(b, h, q_idx, kv_idx):\n"
        "    return (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 128))"
    ),
}
