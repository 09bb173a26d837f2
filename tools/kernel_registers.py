"""Registers and spills of every kernel the compile tests compile, both Triton releases, as JSON on stdout.

    python tools/kernel_registers.py [variants|plain|decode|mla|ladder ...] > after.json

Run it on two checkouts (each from its own root, with FLASHLIB_TRITON36's Triton 3.6.0 at .venv/triton-3.6.0)
and compare the files: a change that must leave the compiled kernels as they were (data/bench/LOG.md,
2026-12-06) shows every kernel whose registers or spills moved. Nothing runs on a GPU; a few minutes on 2 cores.
"""
import json
import os
import sys

os.environ.setdefault("FLASHLIB_TRITON36", os.path.abspath(".venv/triton-3.6.0"))
sys.path.insert(0, os.getcwd())

import tests.test_kernel_compile as tkc  # noqa: E402
import tests.test_ladder as tl  # noqa: E402
import tests.test_ladder_backward as tlb  # noqa: E402
import tests.test_launch_model as tlm  # noqa: E402
import tests.test_mla_decode as tmd  # noqa: E402
from tests.decode_compile import compile_decode  # noqa: E402
from tests.triton_versions import side_by_side  # noqa: E402

FIELDS = ("spec", "kernel", "capability", "registers", "spill_stores", "spill_loads")


def main(only) -> list:
    out = []
    for label, fn, specs in (("variants", tkc.compile_variants, tkc.VARIANT_SPECS),
                             ("plain", tkc.compile_kernels, tkc.SPECS)):
        if only and label not in only:
            continue
        for version, reports in side_by_side(fn, specs).items():
            # a plain spec compiles one kernel (a report per spec); a variant's, several (each names its spec)
            pairs = zip(specs, reports) if label == "plain" else ((None, r) for r in reports)
            for s, r in pairs:
                row = r if isinstance(r, dict) else vars(r)
                row = {k: row.get(k) for k in FIELDS}
                if s is not None:
                    row["spec"] = tkc._id(s)
                out.append(dict(row, group=label, version=version))
    for label, specs in (("decode", tlm.SPECS), ("mla", tmd.MLA_SPECS)):
        if only and label not in only:
            continue
        found = side_by_side(lambda sp, triton_path: compile_decode(sp, triton_path=triton_path), specs)
        for version, result in found.items():
            for s, r in zip(specs, result["reports"]):
                out.append(dict(group=label, version=version, spec=json.dumps(s, sort_keys=True), kernel=s["kernel"],
                                **{k: r.get(k) for k in ("registers", "spill_stores", "spill_loads")}))
    if not only or "ladder" in only:  # the ladder's forward rungs and backward kernels, as their tests compile them
        from flashlib.ladder.compile import compile_rungs

        specs = tl._rung_specs() + tlb._candidate_specs()
        for version, reports in side_by_side(compile_rungs, specs).items():
            for s, r in zip(specs, reports):
                out.append(dict(group="ladder", version=version, spec=json.dumps(s, sort_keys=True), kernel=s["rung"],
                                capability=list(s["capability"]),
                                **{k: getattr(r, k) for k in ("registers", "spill_stores", "spill_loads")}))
    return out


if __name__ == "__main__":
    json.dump(main(sys.argv[1:]), sys.stdout, indent=0)
