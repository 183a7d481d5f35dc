"""The folders show the algorithm: hsgd's packages in the course's order, and imports that only run down.

Every import of every module of hsgd is read with `ast` (those inside functions too) and resolved to the module it
names. Three rules, each a test:
  * no import circle between modules (Tarjan's strongly connected components of the import graph);
  * no import that runs back up: a module imports only from its own package or from packages below it in LAYERS;
  * every package says in its __init__.py docstring what it holds and which chapter teaches it, and hsgd/__init__.py
    names every package (the map).
The tests print the graph's size and its floors (the longest chain of imports), the figures the README quotes.
"""
import ast
import os
import re

HSGD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hsgd")

# bottom to top: a part may import the parts before it, never one after it
LAYERS = ["errors", "files", "readers", "cli", "model", "grid", "fp8", "tp", "cp", "ep", "pp", "dp", "step",
          "accounting", "checkpoint", "run", "check", "plan", "crosscheck", "commands"]
COMMANDS = ("train", "verify", "sample", "schedule")          # the commands at the top, which import no other command


def modules():
    """{dotted name: path} of every module of hsgd."""
    out = {}
    for folder, _, files in os.walk(HSGD):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = "hsgd." + os.path.relpath(path, HSGD)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def imports(name, path, known):
    """The modules of hsgd that module `name` imports (a package's __init__ counts for `from pkg import mod`)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def graph():
    known = modules()
    return known, {name: imports(name, path, known) for name, path in known.items()}


def part(name):
    """The part of LAYERS a module belongs to: its package under hsgd, its own name (errors, files), or "commands"."""
    parts = name.split(".")
    return "hsgd" if len(parts) == 1 else "commands" if parts[1] in COMMANDS else parts[1]


def circles(edges):
    """The strongly connected components of more than one module (Tarjan 1972), iteratively."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def floors(edges):
    """{module: its floor}: 0 for a module that imports nothing of hsgd, else 1 + the highest floor it imports."""
    memo = {}

    def floor(v):
        if v not in memo:
            memo[v] = 1 + max((floor(w) for w in edges[v]), default=-1)
        return memo[v]
    return {v: floor(v) for v in edges}


def test_no_import_circle():
    known, edges = graph()
    found = circles(edges)
    levels = floors(edges) if not found else {}
    print(f"{len(known)} modules, {sum(len(e) for e in edges.values())} import arrows, "
          f"{max(levels.values()) + 1 if levels else '?'} floors, {len(found)} circles")
    assert not found, f"import circles: {found}"


def test_no_import_runs_back_up():
    known, edges = graph()
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = []
    for v, targets in edges.items():
        if v == "hsgd":
            continue                                          # the map imports model.threads first (OpenBLAS)
        for w in targets:
            a, b = part(v), part(w)
            assert a in rank and b in rank, f"{v} or {w} is in no part of LAYERS: add its package there"
            if (a != b and rank[b] > rank[a]) or (a == b == "commands" and v != w):
                upward.append(f"{v} -> {w}")
    print(f"parts bottom to top: {' < '.join(LAYERS)}; upward imports: {len(upward)}")
    assert not upward, "imports that run back up:\n  " + "\n  ".join(upward)


def test_every_part_is_on_the_map():
    packages = sorted(d for d in os.listdir(HSGD) if os.path.exists(os.path.join(HSGD, d, "__init__.py")))
    singles = sorted(f[:-3] for f in os.listdir(HSGD) if f.endswith(".py") and f != "__init__.py")
    assert set(packages) | set(singles) == set(LAYERS) - {"commands"} | set(COMMANDS), (packages, singles)
    the_map = ast.get_docstring(ast.parse(open(os.path.join(HSGD, "__init__.py")).read()))
    for p in packages:
        doc = ast.get_docstring(ast.parse(open(os.path.join(HSGD, p, "__init__.py")).read())) or ""
        assert re.search(r"\b(chapters?|appendix)\b", doc, re.I), f"hsgd/{p}/__init__.py: which chapter teaches it?"
        assert f"hsgd.{p}" in the_map, f"hsgd/__init__.py does not name the package hsgd.{p}"
        for f in os.listdir(os.path.join(HSGD, p)):
            if f.endswith(".py") and not f.startswith("__"):
                assert f[:-3] in doc, f"hsgd/{p}/__init__.py does not name its module {f}"
    for c in COMMANDS:
        assert f"hsgd.{c}" in the_map, f"hsgd/__init__.py does not name the command hsgd.{c}"
