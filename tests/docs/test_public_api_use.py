"""bench/, train/ and the Transformers factories stand outside the core: public names and attributes only, no import cycle.

Read from the source with :mod:`ast`, so a private name reached in a branch no test runs is
caught as well as one every test runs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import fastmuon

PACKAGE = pathlib.Path(fastmuon.__file__).resolve().parent
OUTSIDE = ("bench", "scale", "train")  # the tools built on the core's public API
OUTSIDE_FILES = ("integrations/transformers.py",)  # integrations held to the same rule

#: Private names of torch's own that the tools need, each with why (file, name as written).
#: Nothing of fastmuon's core may be listed here: the core offers accessors instead.
TORCH_PRIVATE = {
    ("bench/counter.py", "torch.utils._python_dispatch"):
        "TorchDispatchMode, the only hook that sees every ATen op a step dispatches",
    ("bench/memory.py", "torch.utils._python_dispatch"):
        "TorchDispatchMode, to see every tensor a step allocates",
    ("bench/memory.py", "torch.utils._pytree"):
        "tree_leaves, to find the tensors among a dispatched op's outputs",
    ("bench/counter.py", "torch._ops"):
        "OpOverload, the type of the op a dispatch mode receives (annotation only)",
    ("bench/contenders.py", "storage._cdata"):
        "a storage's identity, to count each storage once: fake tensors' data pointers are all 0",
    ("bench/fake_cuda.py", "torch._subclasses.fake_tensor"):
        "FakeTensorMode, tensors with a cuda device and no data, to trace the CUDA step without a GPU",
    ("bench/trace.py", "torch._subclasses.fake_tensor"):
        "FakeTensorMode and FakeTensor, the same",
    ("bench/trace.py", "torch.utils._python_dispatch"):
        "TorchDispatchMode, the only hook that sees every ATen op a step dispatches",
    ("bench/trace.py", "aten._local_scalar_dense"):
        "the op every host read of a device value reaches (item, bool, tolist): a host sync",
    ("bench/trace.py", "aten._to_copy"):
        "the op a copy between host and device dispatches: a blocking one is a host sync",
    ("bench/fake_cuda.py", "torch._ops"):
        "OpOverload, the type of the op a dispatch mode receives (annotation only)",
    ("bench/fake_cuda.py", "aten._unsafe_view"):
        "an op that relabels memory without being marked a view: named to count it as no kernel",
    ("bench/fake_cuda.py", "aten._reshape_alias"):
        "the same",
    ("bench/gpu_cost.py", "func._schema"):
        "an op's schema: which arguments it writes and which its results alias, to count the "
        "bytes it reads and writes",
    ("bench/gpu_cost.py", "torch._ops"):
        "OpOverload, the type of the op a dispatch mode receives (annotation only)",
    ("bench/gpu_cost.py", "storage._cdata"):
        "a storage's identity, to follow each new storage of a step to its release once",
    ("bench/gpu_cost.py", "t.untyped_storage()._cdata"):
        "the same, for an op's arguments",
    ("bench/contenders.py", "module._zeropower_via_newtonschulz"):
        "torch.optim.Muon's NS function, swapped for the same iteration in fp32 for the "
        "equal-precision row and restored after each step",
}  # fmt: skip

ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def sources() -> list[pathlib.Path]:
    files = sorted(f for part in OUTSIDE for f in (PACKAGE / part).rglob("*.py"))
    files += [PACKAGE / name for name in OUTSIDE_FILES]
    assert len(files) > 10, files  # the walk found the tools
    return files


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_module(path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from … import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own(node: ast.expr) -> bool:
    """Is ``node`` the object's own ``self``/``cls`` (whose private attributes are its own)?"""
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def named_attribute(node: ast.AST) -> tuple[ast.expr, str] | None:
    """``(obj, name)`` of ``getattr(obj, "name", …)`` and the like, with a literal name."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.func.id not in ATTRIBUTE_CALLS or len(node.args) < 2:
        return None
    name = node.args[1]
    return (
        (node.args[0], name.value) if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
    )


def private_uses(path: pathlib.Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, name as written) of every private name the file (or ``text``, read as if it were
    at ``path``) imports, or attribute it touches on anything but ``self``/``cls``."""
    found: list[tuple[int, str]] = []
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom):
            module = imported_module(path, node)
            if module == "__future__":
                continue
            if any(private(part) for part in module.split(".")):
                found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names if private(a.name)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if any(map(private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute):
            if private(node.attr) and not own(node.value):
                found.append((node.lineno, ast.unparse(node)))
        elif (named := named_attribute(node)) is not None:
            obj, name = named
            if private(name) and not own(obj):
                found.append((node.lineno, f"{ast.unparse(obj)}.{name}"))
    return found


def test_tools_read_no_private_name():
    offences, used = [], set()
    for path in sources():
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in private_uses(path):
            if (rel, name) in TORCH_PRIVATE:
                used.add((rel, name))
            else:
                offences.append(f"{rel}:{line}: {name}")
    assert not offences, "private names read by the tools:\n" + "\n".join(offences)
    assert used == set(TORCH_PRIVATE), f"exceptions no longer needed: {set(TORCH_PRIVATE) - used}"


@pytest.mark.parametrize(
    "code, expected",
    [
        ("from ..ns.device import _flags", ["fastmuon.ns.device._flags"]),
        ("from fastmuon.optim._base import X", ["fastmuon.optim._base"]),
        ("import fastmuon._version", ["fastmuon._version"]),
        ("n = len(opt._plans)", ["opt._plans"]),
        ("opt._orthogonalize = timed", ["opt._orthogonalize"]),
        ("x = getattr(opt, '_plans', {})", ["opt._plans"]),
        ("x = self._mine; y = cls._theirs; z = t.__class__", []),
        ("from .. import __version__", []),
        ("from __future__ import annotations", []),
    ],
)
def test_the_check_sees(code, expected):
    path = PACKAGE / "bench" / "example.py"  # read as if it were in bench/; never written
    assert [name for _, name in private_uses(path, code)] == expected


def local_imports(path: pathlib.Path) -> set[str]:
    """The modules of bench/ or train/ the file imports (anywhere in it, functions included)."""
    names = {module_name(f) for f in sources()}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = imported_module(path, node)
            for a in node.names:
                if f"{module}.{a.name}" in names:
                    out.add(f"{module}.{a.name}")  # a submodule imported from its package
                elif module in names:
                    out.add(module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in names}
    return out - {module_name(path)}


def test_no_import_cycle_in_the_tools():
    graph = {module_name(f): local_imports(f) for f in sources()}
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep in trail:
                cycles.append(" -> ".join(trail[trail.index(dep) :] + [dep]))
            elif dep not in done:
                visit(dep, trail + [dep])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
