"""The machinery behind the ops: what a reader of the course need not open.

    refusals   how a function the kernels cannot compile is refused (the one module the rules import)
    trace      the translator that calls a mask or score function on stand-ins and records what it does
               (what the kernels compile; :mod:`flashlib.kernels.maskfn`, :mod:`flashlib.kernels.scorefn`)
    captures   the walk over what a function reads: its closure, defaults and globals
    checks     the checks of every op's inputs, each error naming the argument
    decode_checks  the checks of a decoding call (q and the caches, lengths, block tables)
    options    one call's options, checked once into :class:`~flashlib.machinery.options.Options`
    autograd   what the autograd Functions save: tensors only

It builds on the rules the course teaches (:mod:`flashlib.rules`, :mod:`flashlib.scores`) and nothing
else of the top level; the references and the public ops build on it.
"""
