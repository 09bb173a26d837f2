"""The launch model: how many programs of a compiled kernel a GPU keeps resident, and how many waves a
launch takes.

A streaming multiprocessor (SM) runs a program (a CUDA block) only when it has the registers, shared memory,
warp slots and block slots for it, so a kernel's registers per thread and shared memory per program, read from
its compiled code (:mod:`flashlib.kernels.compile`, ``tests/decode_compile.py``), say how many of its programs
an SM holds at once: its *residency*. A launch of P programs on S SMs then runs in P / (residency x S) *waves*;
a last wave part-filled leaves SMs idle (as long as a full one when the programs are alike), and a launch well
under one wave leaves the GPU partly idle: for a memory-bound kernel, bytes not in flight. CUDA's occupancy
calculator's rules for compute capability 9.0:

    registers   allocated per warp in units of 256 (registers per thread x 32, rounded up); an SM's
                65,536 give whole warps, in groups of 4, and the warps whole programs
    shared      a program's shared memory plus 1 KiB the runtime reserves, rounded up to 128 bytes,
                from the SM's 228 KiB
    slots       at most 64 warps and 32 programs per SM
"""
from __future__ import annotations

from typing import NamedTuple


class GPU(NamedTuple):
    """What bounds residency on one GPU model."""

    name: str
    sms: int                         # streaming multiprocessors
    registers: int = 65536           # 32-bit registers per SM
    shared: int = 228 * 1024         # shared memory per SM, bytes
    reserved: int = 1024             # shared memory the runtime keeps per program
    max_warps: int = 64              # warps per SM
    max_programs: int = 32           # programs (blocks) per SM
    register_unit: int = 256         # registers are allocated per warp in units of this many
    warp_granularity: int = 4        # and warps in groups of this many
    shared_unit: int = 128           # shared memory is allocated in units of this many bytes


H200 = GPU("NVIDIA H200", sms=132)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def residency(registers: int, shared: int, num_warps: int, gpu: GPU = H200) -> dict:
    """Programs of a kernel (``registers`` per thread, ``shared`` bytes and ``num_warps`` warps per program) an SM
    holds at once, and what limits them: {"programs", "by_registers", "by_shared", "by_warps", "by_slots", "limit"}."""
    per_warp = _round_up(registers * 32, gpu.register_unit)
    warps = gpu.registers // per_warp // gpu.warp_granularity * gpu.warp_granularity
    bounds = dict(by_registers=warps // num_warps,
                  by_shared=gpu.shared // _round_up(shared + gpu.reserved, gpu.shared_unit),
                  by_warps=gpu.max_warps // num_warps, by_slots=gpu.max_programs)
    programs = min(bounds.values())
    return dict(programs=programs, limit=min(bounds, key=bounds.get).removeprefix("by_"), **bounds)


def waves(programs: int, resident: int, gpu: GPU = H200) -> float:
    """A launch's waves: its programs over the programs all SMs hold at once."""
    return programs / (resident * gpu.sms)


def launch_model(programs: int, registers: int, shared: int, num_warps: int, gpu: GPU = H200) -> dict:
    """One launch on ``gpu``: its residency (:func:`residency`), its waves, and ``fill``, the share of the
    SMs' program slots its programs use over the whole waves it takes (1.0: no SM idle in any wave)."""
    held = residency(registers, shared, num_warps, gpu)
    n = waves(programs, held["programs"], gpu)
    whole = max(1, -(-programs // (held["programs"] * gpu.sms)))
    return dict(programs=programs, registers=registers, shared=shared, num_warps=num_warps,
                resident=held["programs"], limit=held["limit"], waves=n, fill=n / whole)
