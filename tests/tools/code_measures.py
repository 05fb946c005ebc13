"""Measures of the package code (tests and bench excluded): density, long lines, conditional
expressions, wide assignments, the longest functions, and cycles between packages.

Run: `python -m tests.tools.code_measures` (from the repository root)."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def packages(root: Path = ROOT) -> dict[str, Path]:
    """The `dserve` packages by short name, as pyproject.toml's package-dir maps them."""
    found, inside = {}, False
    for line in (root / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            inside = line.strip() == "[tool.setuptools.package-dir]"
        elif inside and "=" in line:
            name, folder = (part.strip().strip('"') for part in line.split("="))
            found[name.removeprefix("dserve.")] = root / folder
    return found


@dataclass
class Measures:
    """What `measure` finds over a set of files."""

    lines: int = 0
    nonblank: int = 0
    chars: int = 0
    columns: int = 0
    over_100: int = 0
    conditionals: int = 0
    nested_conditionals: int = 0
    wide_assignments: int = 0
    functions: list[tuple[int, str]] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)

    @property
    def chars_per_line(self) -> float:
        return self.chars / max(self.nonblank, 1)

    @property
    def columns_per_line(self) -> float:
        return self.columns / max(self.nonblank, 1)

    @property
    def share_over_100(self) -> float:
        return self.over_100 / max(self.nonblank, 1)

    @property
    def conditionals_per_1000(self) -> float:
        return 1000 * self.conditionals / max(self.nonblank, 1)


def _targets(node: ast.AST) -> int:
    """How many names an assignment binds at once (`a, b, c = ...` or `a = b = c = ...`)."""
    if not isinstance(node, ast.Assign):
        return 0
    count = 0
    for target in node.targets:
        if isinstance(target, (ast.Tuple, ast.List)):
            count += len(target.elts)
        else:
            count += 1
    return count


def _nested(node: ast.IfExp) -> bool:
    parts = (node.test, node.body, node.orelse)
    return any(isinstance(n, ast.IfExp) for p in parts for n in ast.walk(p))


def _measure_file(path: Path, name: str, into: Measures) -> None:
    text = path.read_text()
    for line in text.splitlines():
        into.lines += 1
        if line.strip():
            into.nonblank += 1
            into.chars += len(line.strip())
            into.columns += len(line)
            into.over_100 += len(line) > 100
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp):
            into.conditionals += 1
            into.nested_conditionals += _nested(node)
        into.wide_assignments += _targets(node) >= 3
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            into.functions.append((length, f"{name}:{node.lineno} {node.name}"))


def _imports(path: Path) -> set[str]:
    """The `dserve` packages a module imports (anywhere in it, functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for module in names:
            parts = module.split(".")
            if parts[0] == "dserve" and len(parts) > 1:
                found.add(parts[1])
    return found


def package_graph(pkgs: dict[str, Path]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    graph = {}
    for name, folder in pkgs.items():
        edges = set()
        for path in folder.rglob("*.py"):
            edges |= _imports(path)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def measure(root: Path = ROOT) -> Measures:
    """The measures over every package folder."""
    pkgs = packages(root)
    result = Measures()
    for folder in pkgs.values():
        for path in sorted(folder.rglob("*.py")):
            _measure_file(path, str(path.relative_to(root)), result)
    result.functions.sort(reverse=True)
    result.cycles = cycles(package_graph(pkgs))
    return result


def report(m: Measures) -> str:
    lines = [
        f"non-blank lines                 {m.nonblank}",
        f"characters per non-blank line   {m.chars_per_line:.1f}"
        f" ({m.columns_per_line:.1f} with indentation)",
        f"lines over 100 columns          {m.over_100} ({100 * m.share_over_100:.2f}%)",
        f"conditional expressions / 1000  {m.conditionals_per_1000:.1f}"
        f" ({m.conditionals}, nested {m.nested_conditionals})",
        f"assignments of 3+ targets       {m.wide_assignments}",
        f"cycles between packages         {m.cycles or 'none'}",
        "longest functions:",
    ]
    for length, where in m.functions[:10]:
        lines.append(f"  {length:4d}  {where}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(measure(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)))
