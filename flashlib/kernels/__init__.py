"""Triton kernels of notebooks 05-07, 09 and 10: the primer's small kernels, the teaching
forward/backward with notebook 09's options (grouped-query heads, windows, soft-capping, mask
functions), the same over packed sequences (varlen), and decoding's split and merge kernels.

Importing this package is cheap and needs no Triton: :func:`kernel_status` says whether
the kernels can run here (compiled on a CUDA GPU, in Triton's CPU interpreter, or not at
all because Triton is missing, with what to do). The kernels themselves are imported on
first use; without Triton that import raises an ImportError saying how to run them.

    attention(q, k, v, *, causal, scale, window, softcap,      notebook 06's forward and
              mask_mod, config, return_lse)                    notebook 07's backward
    FlashConfig, default_config                                their tiles, warps and stages
"""
from ._mode import KernelStatus, gpu_plan, half_dtype, kernel_status, preselect_without_cuda_build, triton_installed

preselect_without_cuda_build()  # cheap: reads torch.version only, never a GPU driver

__all__ = ["KernelStatus", "kernel_status", "gpu_plan", "half_dtype", "triton_installed", "attention", "AttentionFunction",
           "FlashConfig", "default_config", "head_dim_pad"]


def __getattr__(name):
    if name in ("attention", "AttentionFunction"):
        from ._mode import require_triton

        require_triton()  # says how to get Triton where it is missing
        from . import function

        return getattr(function, name)
    if name in ("FlashConfig", "default_config", "head_dim_pad"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'flashlib.kernels' has no attribute {name!r}")
