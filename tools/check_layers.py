"""Check the layer rule from the code's imports: no module imports from a layer above it, no import circles.

    python tools/check_layers.py                 # exit 0: only the known exceptions occur; 1: listing of what's wrong
    python tools/check_layers.py --list          # every current violation, in the exceptions file's format

Layers, bottom to top (a module may import its own layer and the layers below it, never above; the
three middle peers may not import each other):

    base         graph/, errors.py, fileio.py, compat.py, allocator.py, messages.py
    models       models/ (the zoo: small torch models; imports base at most)
    profiler | optimizer | codegen     (peers)
    runtime | search   (peers; search = optimizer/search/, the opt-in search layers: above the optimizer's
                 core, which never imports them; only the command line opts in: FORBIDDEN below)
                 (the runtime never imports the profiler either: FORBIDDEN below)
                 runtime/ and its subpackages (step/, wire/, checkpoint/, build/, observe/, data/) are one
                 layer: they may import each other, and their circles are reported like any other
    coordinator
    api          api/: the one job builder and the `PipelineTrainer` facade, which wire the layers together
    cli          cli/, the package facade (model_parallel/__init__.py) and the seed's entry-point scripts

A few downward imports are forbidden as well (FORBIDDEN): the runtime runs the stages it is given and
never traces a model itself (the job builder in api/ calls the profiler).

Every import counts, wherever it is written: module level, inside a function (an import hidden in a
function body is still a dependency, only a later one), under `if TYPE_CHECKING:`, and
`importlib.import_module("literal")`. An import circle is a set of modules that reach each other
through imports (a strongly connected component of the module graph, Tarjan's algorithm); each edge
inside one is reported.

Known violations live in tools/layer_exceptions.txt, one `importer -> imported  # reason` per line.
The check fails on a violation that is not listed *and* on a listed one that no longer occurs, so the
list only shrinks. A new module outside every layer is an error too: add it to LAYERS below.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PACKAGE = "model_parallel"
REPO = Path(__file__).resolve().parents[1]
EXCEPTIONS = REPO / "tools" / "layer_exceptions.txt"

# (layer, rank, module prefixes relative to the package). Same rank + different layer = peers.
LAYERS: list[tuple[str, int, tuple[str, ...]]] = [
    ("base", 0, ("graph", "errors", "fileio", "compat", "allocator", "messages", "jsonbound", "ratelog", "userfile")),
    ("models", 1, ("models",)),
    ("profiler", 2, ("profiler",)),
    ("optimizer", 2, ("optimizer",)),
    ("codegen", 2, ("codegen",)),
    ("runtime", 3, ("runtime",)),
    ("search", 3, ("optimizer.search",)),
    ("coordinator", 4, ("coordinator",)),
    ("api", 5, ("api",)),
    ("cli", 6, ("cli", "")),  # "" is the package facade, model_parallel/__init__.py
]
CLI = next((name, rank) for name, rank, _ in LAYERS if name == "cli")
# (importer layer, imported layer) pairs that are forbidden although the import points down.
FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("runtime", "profiler"),
    ("coordinator", "search"),
    ("api", "search"),
)
# Thin command-line entry points that live beside the code they start; they count as the cli layer.
ENTRY_POINTS = (
    "profiler.image_classification.main",
    "optimizer.optimizer_graph_hierarchical",
    "optimizer.convert_graph_to_model",
    "test_socket",  # model_parallel/test_socket.py: the seed runs step 4 from model_parallel/
    "test_parallel_0",
)
ROOT_SCRIPTS = ("test_socket.py", "test_parallel_0.py")  # the seed's scripts at the repository root


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int


@dataclass(frozen=True)
class Violation:
    importer: str
    imported: str
    kind: str  # "upward" | "peer" | "forbidden" | "cycle" | "unlayered"
    detail: str
    where: tuple[str, ...]  # "file:line" of every import making the edge

    @property
    def key(self) -> tuple[str, str]:
        return self.importer, self.imported


def layer_of(module: str, package: str = PACKAGE) -> Optional[tuple[str, int]]:
    """(layer, rank) of a module of the package (or a root script), None when no layer claims it."""
    if module in {Path(s).stem for s in ROOT_SCRIPTS}:
        return CLI
    if module != package and not module.startswith(package + "."):
        return None
    rel = module[len(package) + 1:]
    if any(rel == e or rel.startswith(e + ".") for e in ENTRY_POINTS):
        return CLI
    best: Optional[tuple[str, int, int]] = None
    for name, rank, prefixes in LAYERS:
        for prefix in prefixes:
            if rel == prefix or (prefix and rel.startswith(prefix + ".")):
                if best is None or len(prefix) > best[2]:
                    best = (name, rank, len(prefix))
    return None if best is None else best[:2]


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every .py of the package under `root` and the root scripts present."""
    files: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    for script in ROOT_SCRIPTS:
        if (root / script).is_file():
            files[Path(script).stem] = root / script
    return files


def _resolve(name: str, modules: Iterable[str]) -> Optional[str]:
    """The longest known module that `name` (a dotted import target) is or lies in."""
    known = set(modules)
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path], package: str = PACKAGE) -> list[Import]:
    """Every import of a package module written in `path`, at any depth of the syntax tree."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def add(target: str, line: int) -> None:
        if target == package or target.startswith(package + "."):
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.append(Import(module, resolved, path, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x` in a/b.py (or a/__init__.py) means a.x
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import sub` imports the submodule pkg.sub when there is one, else a name of pkg.
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source, node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                add(node.args[0].value, node.lineno)
    return found


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit on long chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _cycle_through(edge: tuple[str, str], graph: Mapping[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path back from edge[1] to edge[0] inside the component: the circle the edge closes."""
    start, goal = edge[1], edge[0]
    previous: dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier and goal not in previous:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child in component and child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    path, node = [], goal
    while node is not None:
        path.append(node)
        node = previous[node]
    return [edge[0]] + path[::-1]


def check(root: Path, package: str = PACKAGE) -> tuple[list[Violation], int, int]:
    """All violations of the package under `root`, with the number of modules and of import edges."""
    modules = module_files(root, package)
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for name, path in modules.items():
        for imp in imports_of(name, path, modules, package):
            edges[(imp.importer, imp.imported)].append(imp)
    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported in edges:
        graph[importer].add(imported)

    def where(key: tuple[str, str]) -> tuple[str, ...]:
        return tuple(f"{i.path.relative_to(root)}:{i.line}" for i in edges[key])

    violations: list[Violation] = []
    for name in sorted(modules):
        if layer_of(name, package) is None:
            violations.append(Violation(name, name, "unlayered", "no layer claims this module: add it to LAYERS in "
                                        "tools/check_layers.py", (str(modules[name].relative_to(root)),)))
    for key in sorted(edges):
        low, high = layer_of(key[0], package), layer_of(key[1], package)
        if low is None or high is None:
            continue
        if high[1] > low[1]:
            violations.append(Violation(*key, "upward", f"{low[0]} -> {high[0]}", where(key)))
        elif high[1] == low[1] and high[0] != low[0]:
            violations.append(Violation(*key, "peer", f"{low[0]} -> {high[0]} (peers may not import each other)",
                                        where(key)))
        elif (low[0], high[0]) in FORBIDDEN:
            violations.append(Violation(*key, "forbidden", f"{low[0]} -> {high[0]} (forbidden: see FORBIDDEN)",
                                        where(key)))
    for component in strongly_connected(graph):
        members = set(component)
        if len(members) < 2:
            continue
        for key in sorted(k for k in edges if k[0] in members and k[1] in members):
            circle = " -> ".join(m.rpartition(".")[2] for m in _cycle_through(key, graph, members))
            violations.append(Violation(*key, "cycle", f"import circle {circle}", where(key)))
    return violations, len(modules), len(edges)


def read_exceptions(path: Path) -> dict[tuple[str, str], int]:
    """`importer -> imported  # reason` lines -> their line numbers; blank lines and comments skipped."""
    found: dict[tuple[str, str], int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text, _, reason = raw.partition("#")
        if not text.strip():
            continue
        parts = [p.strip() for p in text.split("->")]
        if len(parts) != 2 or not all(parts) or any(" " in p for p in parts):
            raise ValueError(f"{path}:{number}: expected 'importer -> imported  # reason', got {raw.strip()!r}")
        if not reason.strip():
            raise ValueError(f"{path}:{number}: {text.strip()} has no '# reason': say why it is still allowed")
        found[(parts[0], parts[1])] = number
    return found


def report(violations: list[Violation], exceptions: Mapping[tuple[str, str], int], exceptions_path: Path) -> list[str]:
    """Lines describing what is wrong (empty when the tree matches the exceptions file exactly)."""
    lines: list[str] = []
    new = [v for v in violations if v.key not in exceptions]
    occurring = {v.key for v in violations}
    stale = sorted((line, key) for key, line in exceptions.items() if key not in occurring)
    if new:
        lines.append(f"{len(new)} import(s) break the layer rule (fix the import, or if it must stay for now, "
                     f"add the line shown to {exceptions_path.name} with a reason):")
        for v in new:
            for w in v.where:
                lines.append(f"  {w}: {v.kind}: {v.detail}")
            lines.append(f"      {v.importer} -> {v.imported}  # ...")
    if stale:
        lines.append(f"{len(stale)} listed exception(s) no longer occur: delete these lines from {exceptions_path}:")
        lines.extend(f"  {exceptions_path.name}:{line}: {key[0]} -> {key[1]}" for line, key in stale)
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="repository root holding the package (default: this repo)")
    parser.add_argument("--exceptions", type=Path, default=None, help="known violations (default tools/layer_exceptions.txt)")
    parser.add_argument("--list", action="store_true", help="print every current violation in the exceptions format")
    args = parser.parse_args(argv)
    exceptions_path = args.exceptions or args.root / "tools" / "layer_exceptions.txt"
    if not (args.root / PACKAGE).is_dir():
        print(f"error: no {PACKAGE}/ under {args.root}: pass --root REPO", file=sys.stderr)
        return 2
    violations, num_modules, num_edges = check(args.root)
    if args.list:
        for key in sorted({v.key for v in violations}):
            kinds = sorted({f"{v.kind}: {v.detail}" for v in violations if v.key == key})
            print(f"{key[0]} -> {key[1]}  # {'; '.join(kinds)}")
        return 0
    try:
        exceptions = read_exceptions(exceptions_path) if exceptions_path.exists() else {}
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    problems = report(violations, exceptions, exceptions_path)
    if problems:
        print("\n".join(problems))
        return 1
    print(f"layer rule holds: {num_modules} modules, {num_edges} imports between them, "
          f"{len(exceptions)} known exception(s) in {exceptions_path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
