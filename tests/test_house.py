"""The house rules of the package, read from its source (no imports of flashlib needed).

- no import cycles between flashlib's modules, counting imports inside functions too;
- no function longer than 70 lines;
- no call (a kernel launch, a jit call) that passes more than 20 arguments by position: past that a
  reader cannot check which value lands in which slot, so the rest go by name;
- no Triton kernel or helper that selects its code path with more than four compile-time
  switches: ``tl.constexpr`` parameters and parameters that default to None (a bundle of arguments
  that a launch may leave out, ``mask`` or ``score``, an optional pointer), other than sizes
  (BLOCK_*, HEAD_DIM*, PAGE_SIZE);
- no Triton kernel or helper with more than 32 parameters: past that its arguments travel in
  bundles, as the strides (one tuple a tensor) and the mask and score sides do;
- the rooms stay in their order (LAYERS): the machinery's leaf (how a function is refused), the rules the
  course teaches, the machinery (trace, captures, checks, options), the references, the kernels, the
  ladder, the public ops, the course's support; nothing but the command line imports bench or labs
  (notebooks and tests import labs).

``python tests/test_house.py`` prints the facts (cycles, longest functions, most switches,
lines per room) that these tests hold to.
"""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "flashlib"
SIZE_CONSTEXPRS = ("BLOCK", "HEAD_DIM", "PAGE_SIZE")
MAX_FUNCTION_LINES = 70
MAX_SWITCHES = 4
MAX_POSITIONAL = 20
MAX_TRITON_PARAMETERS = 32
ROOMS = ("machinery", "course", "labs", "kernels", "ladder", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the rules below (none of them changes it)."""
    return ast.parse(path.read_text())


def imports(name: str, path: Path, known) -> set[str]:
    """flashlib modules that ``name`` imports anywhere in its source (functions included)."""
    tree = parsed(path)
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flashlib"))
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                package = base
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                target = package + ("." + node.module if node.module else "")
            if target.startswith("flashlib"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, mods) for m, p in mods.items()}


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def functions():
    """(lines, 'path:line name', node) of every function in the package."""
    out = []
    for path in modules().values():
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                out.append((node.end_lineno - node.lineno + 1, where, node))
    return out


def none_defaulted(fn: ast.FunctionDef) -> list[str]:
    """The parameters of a function that default to None."""
    positional = fn.args.posonlyargs + fn.args.args
    pairs = list(zip(positional[len(positional) - len(fn.args.defaults):], fn.args.defaults))
    pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]
    return [a.arg for a, d in pairs if isinstance(d, ast.Constant) and d.value is None]


def switches(fn: ast.FunctionDef) -> list[str]:
    """What selects a Triton function's code path, sizes aside: its compile-time parameters, and its
    parameters that default to None (whether a launch gives them is decided when compiling)."""
    optional = set(none_defaulted(fn))
    names = []
    for arg in fn.args.args + fn.args.kwonlyargs:
        compile_time = arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)
        if (compile_time or arg.arg in optional) and not arg.arg.startswith(SIZE_CONSTEXPRS):
            names.append(arg.arg)
    return names


def parameters(fn: ast.FunctionDef) -> int:
    return len(fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs)


def is_triton(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


# the top level holds what a student reads and the public ops; the machinery has a room of its own
RULES = {"flashlib.rules", "flashlib.scores", "flashlib.softmax", "flashlib.iomodel", "flashlib.roofline",
         "flashlib.rotary"}  # the rules the course teaches, written once: they build on nothing of the package
REFERENCES = {"flashlib.dense", "flashlib.tiled", "flashlib.backward", "flashlib.masks", "flashlib.varlen",
              "flashlib.splitkv", "flashlib.kvcache"}  # the reference algorithms, in plain PyTorch
MACHINERY_LEAF = "flashlib.machinery.refusals"  # how a function is refused: the rules' references refuse alike


def room(module: str) -> str:
    parts = module.split(".")
    if module == "flashlib.__main__":
        return "command line"  # the entry point: it may start anything
    if module == MACHINERY_LEAF:
        return "machinery leaf"
    if module in RULES:
        return "rules"
    if module in REFERENCES:
        return "references"
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "public ops"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_function_longer_than_70_lines():
    long = [(n, where) for n, where, _ in functions() if n > MAX_FUNCTION_LINES]
    assert long == []


def long_calls() -> list[tuple[str, int, str, int]]:
    """(module, line, callee, count) of every call passing more than MAX_POSITIONAL arguments by position."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL:
                found.append((name, node.lineno, ast.unparse(node.func)[:40], len(node.args)))
    return found


def test_no_call_passes_more_than_20_arguments_by_position():
    assert long_calls() == []


def test_no_kernel_selects_its_code_path_with_more_than_four_switches():
    many = [(where, switches(node)) for _, where, node in functions()
            if is_triton(node) and len(switches(node)) > MAX_SWITCHES]
    assert many == []


def test_parameters_that_default_to_none_count_as_switches():
    """A kernel whose bundles a launch may leave out selects its path by them, as by a constexpr."""
    found = {where.rsplit(" ", 1)[1]: switches(node) for _, where, node in functions() if is_triton(node)}
    assert found["_attn_fwd"] == ["CAUSAL", "INPUT_PRECISION", "mask", "score"]
    assert "HEAD_DIM_V" not in found["_attn_fwd_inner"]  # a size, None or not


def test_no_triton_function_takes_more_than_32_parameters():
    many = [(where, parameters(node)) for _, where, node in functions()
            if is_triton(node) and parameters(node) > MAX_TRITON_PARAMETERS]
    assert many == []


# which rooms a room may import from: each builds only on the ones before it, in this order
LAYERS = ("machinery leaf", "rules", "machinery", "references", "kernels", "ladder", "public ops", "course")
ALLOWED = {room: set(LAYERS[:i + 1]) for i, room in enumerate(LAYERS)}
ALLOWED["labs"] = set(LAYERS) | {"labs"}  # course support: only notebooks and tests import it
ALLOWED["bench"] = set(LAYERS) | {"bench"}  # measurement: only the command line imports it
ALLOWED["command line"] = set(ALLOWED) | {"labs", "bench"}


def test_rooms_import_only_the_rooms_they_build_on():
    graph = import_graph()
    wrong = [(m, i) for m, deps in graph.items() for i in deps if room(i) not in ALLOWED[room(m)]]
    assert wrong == []


def test_the_rooms_are_those_the_layers_name():
    """Every module lies in a room of the layers (a new top-level module is a public op unless listed), and
    the student's rooms exist as listed (a module renamed away from RULES or REFERENCES is noticed)."""
    mods = modules()
    assert {room(m) for m in mods} == set(ALLOWED)
    assert RULES | REFERENCES | {MACHINERY_LEAF} <= set(mods)


def test_the_rules_and_references_import_no_machinery_but_what_the_layers_allow():
    """What a student reads imports neither the kernels nor a public op; the rules import nothing of the
    machinery but its leaf (the refusal), so that the machinery may build on the rules."""
    graph = import_graph()
    assert {room(i) for m in RULES for i in graph[m]} <= {"rules", "machinery leaf"}
    assert {room(i) for m in REFERENCES for i in graph[m]} <= {"rules", "machinery leaf", "machinery", "references"}
    assert not graph[MACHINERY_LEAF]


# every option of flashlib.machinery.options.Options (and the op's old spellings of the window)
VARIANT_OPTIONS = {"causal", "scale", "window", "window_left", "window_right", "softcap", "mask_mod", "block_mask",
                   "score_mod", "sinks", "attention_chunk"}


def launchers_and_autograd_functions():
    """('path:line name', parameter names) of every kernel launcher (a function named _launch*) and
    every autograd Function's forward and backward in the package."""
    found = []
    for path in modules().values():
        for node in ast.walk(parsed(path)):
            methods = []
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_launch"):
                methods = [node]
            elif isinstance(node, ast.ClassDef) and any("Function" in ast.unparse(b) for b in node.bases):
                methods = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in ("forward", "backward")]
            for fn in methods:
                params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
                where = f"{path.relative_to(ROOT)}:{fn.lineno} {getattr(node, 'name', '')}.{fn.name}"
                found.append((where, params))
    return found


def test_no_launcher_or_autograd_function_names_an_individual_option():
    """A new option is one field of flashlib.machinery.options.Options: no launcher or autograd Function takes one by name."""
    found = launchers_and_autograd_functions()
    assert len(found) >= 10  # the launchers and Functions are found at all
    named = [(where, sorted(set(params) & VARIANT_OPTIONS)) for where, params in found
             if set(params) & VARIANT_OPTIONS]
    assert named == []


def test_the_kernels_take_the_rule_as_one_tuple():
    """Which keys a query sees reaches the kernels as one tuple (kernels/rules.py): no kernel function takes a
    window side or a chunk but the two helpers that bound them, and the public teaching op, which takes them
    as its keywords (ladder/autotune's `w` is a warp count)."""
    taking = []
    for path in sorted((ROOT / "flashlib" / "kernels").glob("*.py")) + sorted((ROOT / "flashlib" / "ladder").glob("*.py")):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.FunctionDef):
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if any("window" in p or "chunk" in p for p in params) or "w" in params:
                    taking.append(f"{path.stem}.{node.name}")
    assert sorted(taking) == ["autotune._config", "function.attention", "rules._chunk_of", "rules._side"]


def test_a_window_or_chunk_takes_the_mask_path_in_one_place():
    """The rule that a window or chunk alone needs the mask function _no_mask is stated once, where the mask
    bundles are made (kernels/rules.py: mask_bundle): no launcher or kernel names _no_mask."""
    naming = []
    for path in sorted((ROOT / "flashlib").rglob("*.py")):
        tree = parsed(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if "_no_mask" in names:
                    naming.append(f"{path.stem}.{node.name}")
    assert naming == ["rules.mask_bundle"]


MAX_FUNCTIONS_NAMING_THE_CHUNK = 30


def functions_naming(word: str) -> list[str]:
    """'path:line name' of every function whose own text (its nested functions' left out) names ``word``."""
    found = []
    for path in modules().values():
        source = path.read_text()
        if word not in source:  # nor in any function of it
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_source_segment(source, node) or ""
                if word not in text:  # taking out nested functions cannot add it
                    continue
                for inner in ast.walk(node):
                    if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        text = text.replace(ast.get_source_segment(source, inner) or "", "")
                if word in text:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_few_functions_name_the_chunk():
    """The chunk travels inside the options (Options.visibility): the ops that take it by name, its check and
    the few places that read it name attention_chunk, no more than 30 functions."""
    naming = functions_naming("attention_chunk")
    assert len(naming) >= 15  # the ops that take it as a keyword are found at all
    assert len(naming) <= MAX_FUNCTIONS_NAMING_THE_CHUNK, naming


def facts() -> str:
    lines = [f"import cycles: {len(cycles(import_graph()))}"]
    funcs = sorted(functions(), key=lambda f: -f[0])
    lines.append("longest functions: " + "; ".join(f"{n} lines {where}" for n, where, _ in funcs[:3]))
    kernels = sorted(((len(switches(node)), where, switches(node)) for _, where, node in funcs if is_triton(node)),
                     key=lambda k: -k[0])
    lines.append("most code-path switches: " + "; ".join(f"{n} {where} {names}" for n, where, names in kernels[:3]))
    widest = sorted(((parameters(node), where) for _, where, node in funcs if is_triton(node)), reverse=True)
    lines.append("most parameters of a Triton function: " + "; ".join(f"{n} {where}" for n, where in widest[:3]))
    per_room: dict[str, int] = {}
    for m, path in modules().items():
        per_room[room(m)] = per_room.get(room(m), 0) + len(path.read_text().splitlines())
    lines.append(f"functions naming attention_chunk: {len(functions_naming('attention_chunk'))}")
    lines.append("lines per room: " + ", ".join(f"{r} {n}" for r, n in sorted(per_room.items())))
    return "\n".join(lines)


if __name__ == "__main__":
    print(facts())
    sys.exit(0)
