"""The package's shape: files a newcomer can read in one sitting, imports that run one way (no circle, deferred
and type-only imports included; no layer importing one above it), the output's kind asked only by its store, and
`batchgen plan` that loads nothing of the benchmark."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "batchgen"
MAX_LINES = 400
# Lowest first: a module may import its own layer and those below it, never one above.
LAYERS = ("batchgen.machine", "batchgen.user_files", "batchgen.object_store", "batchgen.models", "batchgen.engine",
          "batchgen.job", "batchgen.bench", "batchgen.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def runtime_nodes(tree: ast.AST):
    """Every node of the file, inside functions too, except under `if TYPE_CHECKING:` (annotations only: never
    imported when the program runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (inner for branch in node.orelse for inner in [branch, *runtime_nodes(branch)])
            continue
        yield node
        yield from runtime_nodes(node)


def imports_of(name: str, path: Path, known: set[str], type_only: bool = False) -> set[str]:
    """The batchgen modules `name` imports anywhere in its file (inside functions too; `type_only`: under
    `if TYPE_CHECKING:` too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if type_only else runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from x import y`: y is a module of x, or a name in x
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known}


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found), type_only) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def layer(module: str) -> int | None:
    for rank, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return None


def test_no_file_is_longer_than_a_sitting():
    long = {str(path.relative_to(ROOT)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_graph_sees_deferred_imports():
    graph = import_graph()
    assert "batchgen.job.executors.base" in graph["batchgen.job.executors.local"]
    assert "batchgen.job.input.source" in graph["batchgen.job.executors.ray"]  # imported inside a method
    assert "batchgen.engine.engine_plan" in graph["batchgen.job.prepare"]  # imported inside a function
    assert "batchgen.job.prepare" not in graph["batchgen.job.executors.base"]  # under TYPE_CHECKING only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_no_import_circle_through_type_only_imports_either():
    """An annotation is a dependency too: two modules that name each other's types are one module in two files."""
    assert "batchgen.job.prepare" in import_graph(type_only=True)["batchgen.job.executors.base"]
    assert cycles(import_graph(type_only=True)) == []


# The output-store implementations: the only modules that may ask which kind an output is (output/store.py).
OUTPUT_KINDS = ("OutputDir", "ObjectOutput", "OutputStore")
OUTPUT_STORES = ("batchgen.job.output.output_dir", "batchgen.job.output.object_output")


def test_the_output_kind_is_asked_only_of_its_store():
    asked = sorted(f"{name}:{node.lineno}" for name, path in modules().items() if name not in OUTPUT_STORES
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                   and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                   and any(isinstance(inner, (ast.Name, ast.Attribute))
                           and (inner.id if isinstance(inner, ast.Name) else inner.attr) in OUTPUT_KINDS
                           for inner in ast.walk(node.args[1])))
    assert asked == []


def test_no_layer_imports_one_above_it():
    upward = sorted(f"{source} -> {target}" for source, targets in import_graph().items() for target in targets
                    if layer(source) is not None and layer(target) is not None and layer(target) > layer(source))
    assert upward == []


def test_plan_loads_nothing_of_the_benchmark():
    script = ("import sys\nfrom batchgen.cli import main\nsys.argv = ['batchgen', 'plan', 'jobs/sample.yaml']\n"
              "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
              "loaded = sorted(m for m in sys.modules if m.startswith('batchgen.bench'))\n"
              "print('exit', code, 'bench modules', loaded, file=sys.stderr)\n"
              "sys.exit(3 if loaded else code)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bench modules []" in done.stderr
