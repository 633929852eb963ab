"""Import layering of the tree, read from the source (an AST walk: nothing is imported).

Rules, for every .py file under fullstack_fp4/, megatron/training/, scripts/, benchmarks/
(measurement output under ``results/`` excluded) and pretrain_gpt.py, counting imports at
module level and inside functions alike:

(a) no module under fullstack_fp4/ imports megatron.training (recipes are usable without the
    training layer);
(b) no ``from X import _name`` where X is one of our modules in another package folder than
    the importing file (package folder: the directory holding the file, so
    fullstack_fp4/optim/q_adamw and fullstack_fp4/nvfp4 differ, and benchmarks/ and
    benchmarks/studies/ are folders of their own); ``X._name`` through an imported module is
    not checked;
(c) the module import graph of fullstack_fp4 + megatron.training has no cycle.

``python tests/test_layering.py --graph`` prints the package-level import graph (edges between
package folders of fullstack_fp4 and megatron/training, with the number of module imports).
"""
from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("fullstack_fp4", os.path.join("megatron", "training"), "scripts", "benchmarks",
           "pretrain_gpt.py")
SKIP_DIRS = {"__pycache__", "results"}
# where a bare ``import name`` of a script resolves when the script put the folder on sys.path
SCRIPT_PATH = ("benchmarks", os.path.join("benchmarks", "studies"),
               os.path.join("benchmarks", "profile"), "scripts", "tests", "")
GRAPH_PACKAGES = ("fullstack_fp4", "megatron.training")


def _files(root: str = ROOT) -> list[str]:
    out = []
    for top in SCANNED:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            out.append(top)
            continue
        for d, dirs, names in os.walk(path):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
            out += [os.path.relpath(os.path.join(d, n), root) for n in sorted(names)
                    if n.endswith(".py")]
    return out


def _module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _module_file(name: str, root: str) -> str | None:
    """The repository file (relative path) of dotted module ``name``, or None (not ours)."""
    base = os.path.join(*name.split("."))
    for rel in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(os.path.join(root, rel)):
            return rel
    return None


class _Imports(ast.NodeVisitor):
    """(target module, imported name or None, line) of every import statement of one file."""

    def __init__(self, rel: str, root: str):
        self.rel, self.root, self.found = rel, root, []
        self.package = _module_name(rel) if rel.endswith("__init__.py") else \
            _module_name(rel).rpartition(".")[0]

    def _resolve(self, name: str, line: int) -> str:
        """Dotted name of an absolute import; a bare name a script imports from its own folder
        or a folder it put on sys.path becomes that file's module name."""
        if _module_file(name, self.root) is not None or "." in name:
            return name
        here = os.path.dirname(self.rel)
        for d in (here,) + SCRIPT_PATH:
            rel = os.path.join(d, name + ".py") if d else name + ".py"
            if os.path.isfile(os.path.join(self.root, rel)):
                return _module_name(rel)
        return name

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.found.append((self._resolve(a.name, node.lineno), None, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            mod = f"{base}.{node.module}" if node.module else base
        else:
            mod = self._resolve(node.module, node.lineno)
        for a in node.names:
            sub = f"{mod}.{a.name}"
            if a.name != "*" and _module_file(sub, self.root) is not None:
                self.found.append((sub, None, node.lineno))      # a submodule
            else:
                self.found.append((mod, a.name, node.lineno))


def collect(root: str = ROOT) -> dict[str, list]:
    """``{file: [(target module, name or None, line)]}`` for every scanned file."""
    out = {}
    for rel in _files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        v = _Imports(rel, root)
        v.visit(tree)
        out[rel] = v.found
    return out


def _in_graph(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in GRAPH_PACKAGES)


def module_graph(imports: dict, root: str = ROOT) -> dict[str, set]:
    """Edges between our modules of fullstack_fp4 and megatron.training."""
    graph = defaultdict(set)
    for rel, found in imports.items():
        src = _module_name(rel)
        if not _in_graph(src):
            continue
        graph[src]
        for target, _, _ in found:
            if _in_graph(target) and target != src and _module_file(target, root) is not None:
                graph[src].add(target)
    return graph


def find_cycles(graph: dict[str, set]) -> list[list[str]]:
    """One cycle (module list, first module repeated at the end) per strongly connected
    component of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(set(comp))
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph: dict, comp: set) -> list[str]:
    """A shortest cycle through the smallest module of a strongly connected component."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def violations(root: str = ROOT) -> dict[str, list[str]]:
    imports = collect(root)
    back, private = [], []
    for rel, found in imports.items():
        for target, name, line in found:
            where = f"{rel}:{line}"
            if rel.startswith("fullstack_fp4" + os.sep) and \
                    (target == "megatron.training" or target.startswith("megatron.training.")):
                back.append(f"{where} imports {target}")
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            target_file = _module_file(target, root)
            if target_file is not None and \
                    os.path.dirname(target_file) != os.path.dirname(rel):
                private.append(f"{where} imports {name} from {target}")
    cycles = [" -> ".join(c) for c in find_cycles(module_graph(imports, root))]
    return {"back_imports": back, "private_names": private, "cycles": cycles}


_CACHE: dict = {}


def _violations() -> dict:
    if not _CACHE:
        _CACHE.update(violations())
    return _CACHE


def test_recipes_never_import_the_training_layer():
    found = _violations()["back_imports"]
    assert not found, "fullstack_fp4/ imports megatron.training:\n" + "\n".join(found)


def test_no_private_name_across_package_folders():
    found = _violations()["private_names"]
    assert not found, "private names imported across package folders:\n" + "\n".join(found)


def test_no_import_cycle():
    found = _violations()["cycles"]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_checker_sees_each_kind_of_violation(tmp_path):
    """The walk itself, on a hand-made tree: one violation of each rule, and the lazy import
    inside a function closes the cycle."""
    files = {
        "fullstack_fp4/__init__.py": "",
        "fullstack_fp4/a/__init__.py": "",
        "fullstack_fp4/a/x.py": "from fullstack_fp4.b.y import _hidden, shown\n",
        "fullstack_fp4/a/z.py": "def f():\n    from megatron.training import errors\n",
        "fullstack_fp4/b/__init__.py": "",
        "fullstack_fp4/b/y.py": "from . import w\n_hidden = shown = 1\n",
        "fullstack_fp4/b/w.py": "from ._p import _ok\ndef g():\n    import fullstack_fp4.b.y\n",
        "fullstack_fp4/b/_p.py": "_ok = 1\n",
        "megatron/training/errors.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = violations(str(tmp_path))
    sep = os.sep
    assert found["back_imports"] == [f"fullstack_fp4{sep}a{sep}z.py:2 imports megatron.training.errors"]
    assert found["private_names"] == [
        f"fullstack_fp4{sep}a{sep}x.py:1 imports _hidden from fullstack_fp4.b.y"]
    assert found["cycles"] == ["fullstack_fp4.b.w -> fullstack_fp4.b.y -> fullstack_fp4.b.w"]


def package_graph(root: str = ROOT) -> dict[tuple[str, str], int]:
    """``{(package, package): number of module imports}`` between the package folders of
    fullstack_fp4 and megatron.training."""
    def package(module: str) -> str:
        rel = _module_file(module, root)
        return os.path.dirname(rel).replace(os.sep, ".")

    count = defaultdict(int)
    for src, targets in module_graph(collect(root), root).items():
        for t in targets:
            a, b = package(src), package(t)
            if a != b:
                count[(a, b)] += 1
    return dict(count)


if __name__ == "__main__":
    if sys.argv[1:] == ["--graph"]:
        edges = package_graph()
        for (a, b), n in sorted(edges.items()):
            print(f"{a} -> {b}  ({n})")
    else:
        sys.exit("usage: python tests/test_layering.py --graph   (the checks run under pytest)")
