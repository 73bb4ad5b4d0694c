"""The layout of ``ops/`` keeps its rules: imports run one way, with no cycles.

The layers, from the top (a module imports only from its own layer or the ones below):

    api        ops (the package), ssd_combined, mixer, torch_op, context_parallel
    pipeline   forward, backward, varlen_states, inputs, core/ (the small teaching kernels)
    kernels    kernels/ (forward) and kernels/backward/
    tuning     tuning/ (configs, the tuner, the compute chunk)
    runtime    runtime/, interpreter/, checks
    tools      tools/, results/, examples: they may import anything, and nothing imports them

Within ``kernels/``, a kernel module imports no other kernel module: what two kernels share
lives in ``kernels/common.py``. An import inside a function is only for an optional dependency:
the imported module needs one (``OPTIONAL``) that the importing module can load without. cuda.tile
is one: ``import ops`` and the reference backend run where it is not installed (no wheels for
macOS, say), so the API reaches the kernels inside functions. So are cuda.tile's private
modules, which only the interpreter loads: a launch on a GPU loads none
(``tests/interpreter/test_cutile_internals.py``), so the runtime reaches the interpreter inside
functions. The cycle check counts imports inside functions too. Everything is checked on the sources, without importing them.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"

LAYERS = ["tools", "api", "pipeline", "kernels", "tuning", "runtime"]   # top to bottom
# Dependencies a module may need only inside a function: the ones the reference path, the
# result readers or the benchmarks run without.
OPTIONAL = ("cuda.tile", "matplotlib", "IPython", "triton", "mamba_ssm", "tilegym")


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module):
    parts = module.split(".")
    if module in ("ops", "ops.ssd_combined", "ops.mixer", "ops.torch_op", "ops.context_parallel"):
        return "api"
    if parts[1] in ("forward", "backward", "varlen_states", "inputs", "core"):
        return "pipeline"
    if parts[1] in ("kernels", "tuning", "runtime"):
        return parts[1]
    if parts[1] in ("interpreter", "checks"):
        return "runtime"
    if parts[1] in ("tools", "results", "examples"):
        return "tools"
    raise AssertionError(f"{module}: no layer; add it to test_layout.layer")


MODULES = {module_name(p): p for p in sorted(OPS.rglob("*.py"))}


def imports(module):
    """[(imported ops module, inside a function?)] of ``module``'s source."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    found.append((full if full in MODULES else base, inner))
            visit(child, inner)

    visit(tree, False)
    return found


GRAPH = {m: sorted({t for t, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_cycles():
    # Tarjan's strongly connected components over every import, top-level or not.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                connect(w)
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
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            connect(v)
    assert cycles == []


def test_imports_run_down_the_layers():
    wrong = []
    for module, targets in GRAPH.items():
        for target in targets:
            if target == "ops" or module.startswith(target + "."):
                continue          # a package's own __init__ (its docstring and API)
            here, there = LAYERS.index(layer(module)), LAYERS.index(layer(target))
            if layer(target) == "tools" and layer(module) != "tools" or (
                    layer(module) != "tools" and there < here):
                wrong.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    assert wrong == []


def test_no_kernel_module_imports_another():
    kernels = {m for m in MODULES if layer(m) == "kernels" and not m.endswith("common")
               and not MODULES[m].name == "__init__.py"}
    wrong = [(m, t) for m in kernels for t in GRAPH[m] if t in kernels]
    assert wrong == []


def optional_needs(module, seen=None):
    """The ``OPTIONAL`` dependencies loading ``module`` imports (through top-level imports)."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    needs = set()
    for target, inside in imports(module):
        if inside:
            continue
        needs.update(o for o in OPTIONAL if target == o or target.startswith(o + "."))
        if target in MODULES:
            needs |= optional_needs(target, seen)
    return needs


def test_imports_inside_functions_are_for_optional_dependencies():
    wrong = []
    for module in MODULES:
        own = optional_needs(module)
        for target, inside in imports(module):
            if not inside:
                continue
            if target in MODULES:
                needs = optional_needs(target)
            else:
                needs = {o for o in OPTIONAL if target == o or target.startswith(o + ".")}
            if module == "ops.runtime.cutile_internals" and target.startswith("cuda.tile._"):
                continue    # private modules, imported on first use after its version check
            if module.startswith("ops.runtime.") and target == "ops.interpreter":
                continue    # loads cuda.tile's private modules: CPU launches only
            if not needs - own:
                wrong.append(f"{module} imports {target} inside a function")
    assert wrong == []


def test_the_reference_path_needs_no_cuda_tile():
    assert "cuda.tile" not in optional_needs("ops")


@pytest.mark.parametrize("name", ["mamba_chunk_scan_combined", "Mamba2Mixer",
                                  "context_parallel_chunk_scan"])
def test_public_names(name):
    import ops
    assert name in ops.__all__ and callable(getattr(ops, name))
