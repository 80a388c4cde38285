"""The package's import graph: imports point down the layers (and down the pipeline's floors), no module imports
itself back, only the CLI prints."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stagewise"

ALLOWED: Mapping[str, frozenset[str]] = {
    "errors": frozenset(),
    "schedule": frozenset({"errors"}),
    "units": frozenset(),
    "comm": frozenset({"units", "errors"}),
    "models": frozenset({"units", "errors"}),
    "partition": frozenset({"schedule", "units", "errors"}),
    "pipeline": frozenset({"schedule", "partition", "comm", "units", "errors"}),
    "checkpoint": frozenset({"pipeline", "comm", "units", "errors"}),
    "plan": frozenset({"pipeline", "partition", "schedule", "comm", "models", "units", "errors"}),
    "run": frozenset({"plan", "pipeline", "partition", "schedule", "comm", "models", "checkpoint", "units", "errors"}),
    "cli": frozenset(
        {"run", "plan", "pipeline", "partition", "schedule", "comm", "models", "checkpoint", "units", "errors"}
    ),
    "__main__": frozenset({"cli"}),
}
"""Which parts of stagewise each part may import (its own modules aside): the layers of DESIGN.md, downwards only."""

PIPELINE_FLOORS: tuple[str, ...] = ("config", "backward", "loss", "stage", "parallel", "execution", "interop", "front")
"""The floors of the pipeline layer, lowest first: each a folder of stagewise/pipeline, but ``config`` (its
config.py: every option type, which every floor may read) and ``front`` (the other modules at its root: the
Pipeline, its assembly, the loader, pretrained weights). A floor imports only its own modules and the floors below
it; the package's ``__init__`` is the facade, which no module of the pipeline imports."""

PRINTERS = frozenset({"cli"})
"""The only parts that may call print()."""


@dataclass(frozen=True)
class Import:
    """One import statement of a stagewise module, resolved to the module it loads."""

    source: str
    """The importing module, e.g. ``stagewise.pipeline.pipe``."""
    target: str
    """The imported stagewise module (a submodule when ``from package import submodule``)."""
    line: int


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The layer a module belongs to: its subpackage, or its own name at the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, modules: frozenset[str], root: Path = PACKAGE) -> Iterator[Import]:
    """Every stagewise import in ``path``, at any depth (in functions, under TYPE_CHECKING) and relative ones."""
    source = module_name(path, root)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "stagewise":
                    yield Import(source, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "stagewise":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield Import(source, sub if sub in modules else base, node.lineno)


def graph(root: Path = PACKAGE) -> list[Import]:
    files = sorted(root.rglob("*.py"))
    modules = frozenset(module_name(f, root) for f in files)
    return [imp for f in files for imp in imports_of(f, modules, root)]


def layer_violations(edges: list[Import]) -> list[str]:
    """Imports that point up or sideways: a part importing a part it may not (the package root is the facade)."""
    bad = []
    for edge in edges:
        source, target = part_of(edge.source), part_of(edge.target)
        if source in ("__init__", target):
            continue
        if target not in ALLOWED.get(source, frozenset()):
            bad.append(f"{edge.source} (line {edge.line}) imports {edge.target}: {source} may not import {target}")
    return bad


def pipeline_floor(module: str) -> str | None:
    """The floor of :data:`PIPELINE_FLOORS` a module of the pipeline is on (``__init__`` for the package itself,
    the name of an unknown folder for a module of one); None outside the pipeline."""
    parts = module.split(".")
    if parts[:2] != ["stagewise", "pipeline"]:
        return None
    if len(parts) == 2:
        return "__init__"
    if parts[2] == "config" or len(parts) > 3 or parts[2] in PIPELINE_FLOORS:
        return parts[2]
    return "front"


def floor_violations(edges: list[Import]) -> list[str]:
    """Imports within the pipeline that point up its floors, reach its facade, or come from a folder on no floor."""
    bad = []
    for edge in edges:
        source, target = pipeline_floor(edge.source), pipeline_floor(edge.target)
        if source is None or target is None or source == "__init__":
            continue
        where = f"{edge.source} (line {edge.line}) imports {edge.target}"
        if source not in PIPELINE_FLOORS:
            bad.append(f"{where}: {source} is on no floor of PIPELINE_FLOORS")
        elif target == "__init__":
            bad.append(f"{where}: the package's facade, which imports every floor; import the module itself")
        elif target not in PIPELINE_FLOORS or PIPELINE_FLOORS.index(target) > PIPELINE_FLOORS.index(source):
            bad.append(f"{where}: {source} may not import {target}, which is above it")
    return bad


def cycles(edges: list[Import]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (Tarjan's strongly connected sets)."""
    succ: dict[str, set[str]] = {}
    for edge in edges:
        if edge.source != edge.target:
            succ.setdefault(edge.source, set()).add(edge.target)
            succ.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(succ[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(succ):
        if node not in index:
            visit(node)
    return found


def printers(root: Path = PACKAGE) -> list[str]:
    """Calls of print() outside the parts allowed to print."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if part_of(module) in PRINTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                out.append(f"{module} line {node.lineno}")
    return out


def test_every_part_of_the_package_is_in_the_layer_table() -> None:
    parts = {part_of(module_name(f)) for f in PACKAGE.rglob("*.py")} - {"__init__"}
    assert parts <= set(ALLOWED), f"parts with no rule in ALLOWED: {sorted(parts - set(ALLOWED))}"


def test_imports_point_down_the_layers() -> None:
    assert layer_violations(graph()) == []


def test_every_folder_of_the_pipeline_is_a_floor() -> None:
    folders = {p.parent.name for p in (PACKAGE / "pipeline").glob("*/__init__.py")}
    assert folders <= set(PIPELINE_FLOORS), f"folders on no floor: {sorted(folders - set(PIPELINE_FLOORS))}"
    assert {"config", "front"} | folders == set(PIPELINE_FLOORS), "a floor with no folder"


def test_imports_point_down_the_pipelines_floors() -> None:
    assert floor_violations(graph()) == []


def test_no_module_imports_itself_back() -> None:
    assert cycles(graph()) == []


def test_only_the_cli_prints() -> None:
    assert printers() == []


def test_the_schedule_layer_imports_no_torch() -> None:
    code = "import sys, stagewise.schedule; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def _fake_package(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "stagewise"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"partition/__init__.py": "", "partition/cost.py": "from stagewise.pipeline.pipe import Pipeline\n"},
            "partition may not import pipeline",
            id="an upward import",
        ),
        pytest.param(
            {"comm/__init__.py": "", "comm/mesh.py": "def f():\n    from stagewise.partition import balance\n"},
            "comm may not import partition",
            id="a sideways import inside a function",
        ),
        pytest.param(
            {"schedule/__init__.py": "", "schedule/x.py": "from ..pipeline import stage\n"},
            "schedule may not import pipeline",
            id="a relative import",
        ),
    ],
)
def test_a_bad_import_is_caught(tmp_path: Path, files: Mapping[str, str], expected: str) -> None:
    root = _fake_package(tmp_path, {"__init__.py": "", **files})
    violations = layer_violations(graph(root))
    assert len(violations) == 1 and expected in violations[0]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"pipeline/backward/fusion.py": "from stagewise.pipeline.stage.module import StageModule\n"},
            "backward may not import stage, which is above it",
            id="a folder importing one above it",
        ),
        pytest.param(
            {"pipeline/config.py": "def f():\n    from stagewise.pipeline.pipe import Pipeline\n"},
            "config may not import front, which is above it",
            id="config importing the front, inside a function",
        ),
        pytest.param(
            {"pipeline/stage/module.py": "from stagewise.pipeline import Pipeline\n"},
            "the package's facade",
            id="a module importing the facade",
        ),
        pytest.param(
            {"pipeline/misc/__init__.py": "", "pipeline/misc/x.py": "from ..config import PipelineOptions\n"},
            "misc is on no floor",
            id="a folder on no floor",
        ),
    ],
)
def test_a_bad_import_between_the_pipelines_floors_is_caught(
    tmp_path: Path, files: Mapping[str, str], expected: str
) -> None:
    floors = {"pipeline/__init__.py": "", "pipeline/backward/__init__.py": "", "pipeline/stage/__init__.py": ""}
    root = _fake_package(tmp_path, {"__init__.py": "", **floors, "pipeline/stage/module.py": "", **files})
    violations = floor_violations(graph(root))
    assert len(violations) == 1 and expected in violations[0], violations


def test_a_cycle_is_caught(tmp_path: Path) -> None:
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "comm/__init__.py": "",
            "comm/p2p.py": "from stagewise.comm.receiving import Receiving\n",
            "comm/receiving.py": "from stagewise.comm import p2p\n",
        },
    )
    assert cycles(graph(root)) == [["stagewise.comm.p2p", "stagewise.comm.receiving"]]


def test_a_print_outside_the_cli_is_caught(tmp_path: Path) -> None:
    root = _fake_package(tmp_path, {"__init__.py": "", "pipeline/__init__.py": "", "pipeline/pipe.py": "print(1)\n"})
    assert printers(root) == ["stagewise.pipeline.pipe line 1"]
