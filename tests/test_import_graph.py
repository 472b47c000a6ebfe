"""The house's import graph (DESIGN): no import loop between modules, and no import
running back up the floors written down in ``FLOORS`` (the one place they are).

A room is a top-level module or a sub-package of ``exactstep``; a family's folder
(``families/<name>/``) stands on two floors: its compiler, config section and
reference in the room ``families/<name>``, below ``config`` (which reads the section),
its glue (``family.py``) and its window program (``UPPER``) in ``families``, above
``generation``, which knows no family. A room may import rooms on lower floors only
(inside one room, modules import each other freely, but never in a loop).
Function-local imports count like any other, except in the rooms that load lazily on
purpose (``LAZY``: the command line, benchmarks, the audit).
The graph is read from the source with ``ast``, never by importing it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "exactstep"

#: Floor of each room, from the ground up: data flows upward through them.
FLOORS = {
    "errors": 1, "lazy": 1,
    "ranges": 2,
    "state": 3,
    "data": 4,
    "rows": 5,
    "objective": 6, "families/<name>": 6,
    "update": 7,
    "tracking": 8, "parallel": 8, "model": 8, "generation": 8,
    "config": 9,
    "eval": 10,
    "families": 11,
    "run": 12, "audit": 12,
    "artifacts": 13,
    "bench": 14, "smoke": 15,
    "commands": 16,
    "cli": 17,
    "__main__": 18,
}
#: The package's face (``exactstep/__init__.py``) hands names on lazily and is no room.
FACE = "__init__"
#: Rooms whose function-local imports are there to keep start-up light.
LAZY = {"cli", "bench", "smoke", "audit"}
#: A family folder's glue and its window program (the ``WindowProgram`` over the
#: sampler: policy's rollouts, clipped epochs and learned baseline; Professor Forcing's
#: two paths), on the ``families`` floor; the rest of the folder is the room
#: ``families/<name>`` (rows-floor code only that family uses).
UPPER = {"family", "rollouts", "clipped", "regressor", "forcing"}
FAMILY_FOLDERS = {p.parent.name for p in (PACKAGE / "families").glob("*/__init__.py")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return FACE
    if parts[1:2] == ["families"] and len(parts) > 2 and parts[2] in FAMILY_FOLDERS:
        return "families" if len(parts) == 4 and parts[3] in UPPER else "families/<name>"
    return parts[1]


def imports_of(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(module imported, line, at top level)`` for each ``exactstep`` import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "exactstep":
                names = [f"exactstep.{a.name}" for a in node.names]
                names = [n if n in known else "exactstep" for n in names]
            elif node.module.startswith("exactstep."):
                names = [node.module]
                names += [f"{node.module}.{a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in known]
            else:
                continue
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "exactstep"]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def the_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> modules it imports (every import outside the lazy rooms), and every
    import that runs back up (``file:line room -> room``)."""
    files = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(files)
    edges: dict[str, set[str]] = {m: set() for m in files}
    upward = []
    for module, path in files.items():
        source = room_of(module)
        for target, line, top in imports_of(path, known):
            if not top and source in LAZY:
                continue
            edges[module].add(target)
            if runs_up(module, target):
                dest = room_of(target)
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} "
                              f"{source} (floor {FLOORS[source]}) -> {dest} "
                              f"(floor {FLOORS[dest]})")
    return edges, upward


def runs_up(module: str, target: str) -> bool:
    """Whether ``module`` importing ``target`` leaves its room for one not below it."""
    source, dest = room_of(module), room_of(target)
    if source in (dest, FACE) or dest == FACE:
        return False
    return FLOORS[dest] >= FLOORS[source]


def loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
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

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_room_has_a_floor():
    rooms = {room_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {FACE}
    assert rooms == set(FLOORS), (rooms - set(FLOORS), set(FLOORS) - rooms)


def test_no_import_runs_back_up():
    _, upward = the_graph()
    assert upward == []


def test_a_function_local_import_says_why():
    """Outside the lazy rooms a function-local ``exactstep`` import is the exception: it
    carries ``# lazy: <reason>`` on its line (a plug-in chosen by configuration), never
    a way around a loop."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if room_of(module_name(path)) not in LAZY:
            unexplained += [f"{path.relative_to(PACKAGE.parent)}:{line}"
                            for line in unexplained_local_imports(path)]
    assert unexplained == []


def unexplained_local_imports(path: Path) -> list[int]:
    """Lines of function-local ``exactstep`` imports without a ``# lazy:`` reason."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return sorted({line for _, line, top in imports_of(path, set())
                   if not top and "# lazy:" not in lines[line - 1]})


def test_an_unexplained_local_import_is_found(tmp_path):
    """Negative control of the rule above."""
    module = tmp_path / "planted.py"
    module.write_text("import os\n\n\ndef f():\n    from exactstep.rows import batch\n"
                      "    from exactstep.data import chat  # lazy: a plug-in\n")
    assert unexplained_local_imports(module) == [5]


def test_no_import_loop():
    edges, _ = the_graph()
    # a parent package's __init__ imports its modules and they import it back only for
    # names; a loop through a package's face is still a loop of modules
    assert loops(edges) == []


def test_the_checks_can_fail():
    """Negative controls: a loop and an upward import planted in a copy of the graph
    are found."""
    edges, _ = the_graph()
    planted = {m: set(t) for m, t in edges.items()}
    planted["exactstep.state.durable"].add("exactstep.state.manifest")  # manifest imports durable
    assert any({"exactstep.state.durable", "exactstep.state.manifest"} <= set(c)
               for c in loops(planted))
    assert runs_up("exactstep.families.mlm.compiler", "exactstep.families.registry")
    assert runs_up("exactstep.model.encdec", "exactstep.model.attention") is False
    assert runs_up("exactstep.families.mlm.family", "exactstep.families.mlm.compiler") is False
    # the generation stage knows no family: a family's window program stands above it
    assert runs_up("exactstep.generation.sampler", "exactstep.families.policy.rollouts")
    assert runs_up("exactstep.families.policy.config", "exactstep.families.policy.rollouts")
    assert runs_up("exactstep.families.professor.forcing", "exactstep.generation.prompts") is False
    assert runs_up("exactstep.families.span.config", "exactstep.config")
    assert runs_up("exactstep.config", "exactstep.families.span.config") is False
    assert runs_up("exactstep.audit.engine", "exactstep.run.runner")  # one floor: not below
    assert runs_up("exactstep.data.prepared", "exactstep.state.durable") is False
    assert runs_up("exactstep.state.manifest", "exactstep.data.prepared")
    assert runs_up("exactstep.run.finished_run", "exactstep.artifacts.export")


def test_importing_the_configuration_does_not_load_torch():
    code = "import sys, exactstep.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_the_readme_map_lists_every_room():
    """The map of the house (docs/concepts/house.md, linked from the README) names each
    room of ``FLOORS`` (a file as ``name.py``, a package as ``name/``), and no room that
    does not exist."""
    text = (PACKAGE.parents[1] / "docs" / "concepts" / "house.md").read_text(encoding="utf-8")
    block = text.split("The house, in data-flow order")[1].split("```")[1]
    named = {word.rstrip("/").removesuffix(".py") for line in block.splitlines()
             for word in line.split()[:3] if word.endswith((".py", "/"))}
    assert named == set(FLOORS)
