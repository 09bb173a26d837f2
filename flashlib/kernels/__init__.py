"""Triton kernels: the primer's small kernels and the fused FlashAttention forward/backward.

Importing this package is cheap and needs no Triton: :func:`kernel_status` says whether
the kernels can run here (compiled on a CUDA GPU, in Triton's CPU interpreter, or not at
all because Triton is missing, with what to do). The kernels themselves are imported on
first use; without Triton that import raises an ImportError saying how to run them.
"""
from ._mode import KernelStatus, kernel_status, preselect_without_cuda_build, triton_installed

preselect_without_cuda_build()  # cheap: reads torch.version only, never a GPU driver

_LAZY = {
    "flash_attention": "op", "flash_forward": "op", "FlashAttentionFunction": "op",
    "FlashConfig": "config", "default_config": "config", "head_dim_pad": "config",
}

__all__ = ["KernelStatus", "kernel_status", "triton_installed", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        if _LAZY[name] == "op":
            from ._mode import require_triton

            require_triton()
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'flashlib.kernels' has no attribute {name!r}")
