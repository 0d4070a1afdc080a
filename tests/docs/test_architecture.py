"""The core's layers, read from the source: each imports only the layers below it, no module
imports itself back through others, and no module reads another object's private attributes.

Layers, bottom up: ``ns/`` (matrix maps, kernels, planner, engine, device facts);
``distributed/``; ``step/`` (prepared programs, the elementwise halves, non-finite handling);
``rules/`` (one update rule per module); ``optim/`` (the optimizer classes); then what is built on
them (``groups``, ``ultralytics``, the command line, ``bench/`` and ``train/``).
"""

from __future__ import annotations

import ast
import pathlib

from test_public_api_use import PACKAGE, imported_module, module_name, private_uses

LAYERS = {"ns": 1, "distributed": 2, "step": 3, "rules": 4, "optim": 5}
CORE = tuple(LAYERS)


def core_files() -> list[pathlib.Path]:
    files = []
    for part in CORE:
        path = PACKAGE / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    assert len(files) > 30, files
    return files


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "fastmuon" else None


def fastmuon_imports(path: pathlib.Path) -> set[str]:
    """Every fastmuon module the file imports, anywhere in it (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = imported_module(path, node)
            if module.startswith("fastmuon"):
                for a in node.names:
                    sub = f"{module}.{a.name}"
                    out.add(
                        sub
                        if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                        else module
                    )
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fastmuon")}
    return out - {module_name(path)}


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in core_files():
        here = layer_of(module_name(path))
        for dep in sorted(fastmuon_imports(path)):
            there = layer_of(dep)
            if there is None or there > here:
                wrong.append(f"{module_name(path)} imports {dep}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycle_in_the_core():
    graph = {module_name(f): fastmuon_imports(f) for f in core_files()}
    cycles, done = [], set()

    def visit(module: str, trail: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep in trail:
                cycles.append(" -> ".join(trail[trail.index(dep) :] + [dep]))
            elif dep not in done:
                visit(dep, trail + [dep])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


#: Private names of torch's the core needs, each with why (file, name as written).
TORCH_PRIVATE = {
    ("distributed/inflight.py", "t._use_count"):
        "the count of references torch's process-group threads hold on a tensor: the one sign "
        "that a collective is done with it",
}  # fmt: skip


def test_no_core_module_reads_another_objects_private_attributes():
    """``torch._foreach_*`` and torch's fused optimizer kernels are torch's own op namespace
    (``torch.optim`` calls them the same way), and ``super()`` is the class's own; anything else
    private is another object's."""
    offences, used = [], set()
    for path in core_files():
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in private_uses(path):
            if (name.startswith("torch._") and name.count(".") == 1) or name.startswith("super()."):
                continue
            if (rel, name) in TORCH_PRIVATE:
                used.add((rel, name))
                continue
            offences.append(f"{path.relative_to(PACKAGE).as_posix()}:{line}: {name}")
    assert not offences, "private names read across objects:\n" + "\n".join(offences)
    assert used == set(TORCH_PRIVATE), f"exceptions no longer needed: {set(TORCH_PRIVATE) - used}"


#: The longest a class of the core may be: past it, a class holds more than one idea.
MAX_CLASS_LINES = 400


def test_no_core_class_is_longer_than_a_few_hundred_lines():
    long = []
    for path in core_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                lines = node.end_lineno - node.lineno + 1
                long.append(f"{path.relative_to(PACKAGE).as_posix()}: {node.name} ({lines} lines)")
    assert not long, "classes over the limit:\n" + "\n".join(long)
