"""The folders are the architecture: dependencies point one way, plan-making touches no tensor,
and everything imports cairn through its one namespace."""

import ast
import re
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cairn"
ROOMS = ("cluster", "workers", "cache_service", "kernels", "configs")  # cairn's subpackages
PLAN_MAKING = sorted({p.relative_to(ROOT).as_posix() for p in (PKG / "workers" / "cache").glob("*.py")}
                     - {"cairn/workers/cache/device_budget.py"}) + \
    ["cairn/workers/scheduler.py", "cairn/workers/checkpoint_planning.py", "cairn/workers/shared_prefill.py",
     "cairn/workers/speculative/verify_slots.py", "cairn/workers/plan.py", "cairn/workers/slot.py", "cairn/workers/sequence.py",
     "cairn/workers/sequence_cache.py", "cairn/workers/sampling_params.py", "cairn/workers/engine_options.py",
     "cairn/workers/spec.py", "cairn/workers/tenant_queue.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, absolute (`from cairn import kernels` is cairn.kernels)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            if node.module == "cairn":
                modules |= {f"cairn.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom):  # relative: resolved against the file's own package
            package = path.relative_to(ROOT).with_suffix("").parts[:-node.level]
            modules.add(".".join(package + ((node.module,) if node.module else ())))
    return modules


def module_name(path: Path) -> str:
    """The dotted name `path` (a file under cairn/) is imported as: a package by its folder."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cairn_modules() -> dict[str, Path]:
    """Every module of cairn by its dotted name (a package's is its __init__.py)."""
    return {module_name(path): path for path in sorted(PKG.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of cairn it imports, at module level or inside a function alike.
    `from cairn.x import y` imports the module cairn.x.y where there is one, else (a name defined
    in, or handed on by, cairn/x/__init__.py) the package cairn.x; a dotted name that is no module
    of cairn is its nearest enclosing one."""
    modules = cairn_modules()

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {nearest(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the file's own package
                    package = path.relative_to(ROOT).with_suffix("").parts[:-node.level]
                    base = ".".join(package + ((base,) if base else ()))
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else nearest(base))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one node (Tarjan's, without
    recursion), each sorted: the groups of nodes that reach each other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def imported_roots(path: Path) -> set[str]:
    """The top-level names `path` imports, with cairn's rooms by their room name (`cairn.workers.x`
    is "workers")."""
    roots = set()
    for module in imported_modules(path):
        parts = module.split(".")
        roots.add(parts[1] if parts[0] == "cairn" and len(parts) > 1 else parts[0])
    return roots


def test_plan_making_code_imports_no_torch():
    for rel in PLAN_MAKING:
        assert "torch" not in imported_roots(ROOT / rel), rel


def test_dependencies_point_one_way():
    allowed = {"kernels": set(), "cache_service": {"cache_service"}, "workers": {"workers", "kernels", "cache_service"}}
    ours = {"cluster", "workers", "cache_service", "kernels"}
    for package, may_import in allowed.items():
        for path in (PKG / package).rglob("*.py"):
            bad = (imported_roots(path) & ours) - may_import - {package}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def described(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    return "\n".join(f"circle of {len(c)}: " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
                     for c in found)


def test_no_module_of_cairn_imports_itself_through_others():
    """No circle of imports: not at module level, nor through an import inside a function (a
    lazy import hides a circle from Python at load time, not from whoever reads the code)."""
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + described(found, graph)


def test_in_every_folder_imports_run_one_way_between_its_rooms():
    """In each folder of cairn, each file and each folder directly in it is a room (a folder
    with all it holds): no room reaches another that reaches it back, so they stand on floors,
    every import pointing down (what `farm-studio look cairn/workers` draws, for one, with no
    arrow running back up)."""
    graph = import_graph()
    found = []
    for folder in sorted({m.rpartition(".")[0] for m in graph} - {""}):
        inside = f"{folder}."
        rooms: dict[str, set[str]] = {}
        for module, imported in graph.items():
            if module.startswith(inside):
                room = module.removeprefix(inside).split(".")[0]
                rooms.setdefault(room, set()).update(
                    m.removeprefix(inside).split(".")[0] for m in imported if m.startswith(inside))
        rooms = {room: imported - {room} for room, imported in rooms.items()}
        found += [f"{folder}: " + described([c], rooms) for c in circles(rooms)]
    assert not found, "rooms of a folder that import each other:\n" + "\n".join(found)


def test_the_circle_finder_finds_circles_and_only_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_import_graph_reads_submodules_packages_and_lazy_imports():
    graph = import_graph()
    assert "cairn.workers.execution.tp_runner" in graph["cairn.workers.loading"]
    assert "cairn.workers.model" in graph["cairn.workers.loading"]  # a name the package hands on
    assert "cairn.workers.model.qwen3_5_config" in graph["cairn.workers.model.model_types"]  # a submodule by name
    assert "cairn.kernels.common.triton_helpers" in graph["cairn.kernels.common.dispatch"]  # inside a function


def test_only_the_index_actor_imports_ray_below_cluster():
    for package in ("workers", "cache_service", "kernels"):
        for path in (PKG / package).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "cairn/cache_service/actor.py":
                continue
            assert "ray" not in imported_roots(path), path.relative_to(ROOT)


def test_the_http_api_runs_without_ray_or_the_serve_layer():
    for path in (PKG / "cluster" / "api").rglob("*.py"):
        modules = imported_modules(path)
        bad = {m for m in modules if m.split(".")[0] == "ray" or
               (f"{m}.".startswith("cairn.cluster.") and not m.startswith("cairn.cluster.api"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


KERNELS = PKG / "kernels"
OP_ROOMS = ("attention", "conv", "delta_rule", "norms", "moe", "sample", "state")


def test_kernels_are_a_room_an_op_and_each_imports_only_itself_and_the_shared_room():
    rooms = {p.name for p in KERNELS.iterdir() if (p / "__init__.py").exists()}
    assert rooms == {*OP_ROOMS, "common"}
    assert [p.name for p in KERNELS.glob("*.py")] == ["__init__.py"], "nothing beside the rooms but the entry"
    for room in (*OP_ROOMS, "common"):
        for path in (KERNELS / room).glob("*.py"):
            reached = {m.split(".")[2] if m.count(".") >= 2 else "the package root" for m in imported_modules(path)
                       if m == "cairn.kernels" or m.startswith("cairn.kernels.")}
            assert reached <= {room, "common"}, f"{path.relative_to(ROOT)} imports kernels' {reached - {room, 'common'}}"


def test_each_op_room_declares_its_implementations_inside_itself_with_its_reference_as_the_fallback():
    import importlib

    for room in OP_ROOMS:
        package = importlib.import_module(f"cairn.kernels.{room}")
        assert package.OPS.fallback == f"cairn.kernels.{room}.reference"
        assert all(m.startswith(f"cairn.kernels.{room}.") for m in package.OPS.cuda + package.OPS.cpu), package.OPS
        assert (KERNELS / room / "reference.py").exists(), room
        assert any((KERNELS / room).glob("triton*.py")) or room == "sample", room  # CUDA samples with torch ops
        assert set(package.__all__) <= set(importlib.import_module("cairn.kernels").__all__), room


def test_no_production_module_imports_a_reference():
    """The references are the ops' oracles: the tests import them, production reaches one only as
    the named fallback of `cairn.kernels.common.dispatch` (by its module's name, when it must)."""
    for path in PKG.rglob("*.py"):
        if path.name == "reference.py" and path.parent.parent == KERNELS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            found = [n for n in names + [module] if n.split(".")[-1].startswith("reference")]
            assert not found, f"{path.relative_to(ROOT)} imports {found}"


def test_no_module_name_repeats_across_packages():
    """One name per noun: outside the kernels' op folders (whose files are roles: triton_ops,
    cpu_ops, reference, ...), a module's file name says what it holds, and no other has it."""
    from collections import Counter

    names = Counter(p.name for p in PKG.rglob("*.py") if p.name != "__init__.py" and KERNELS not in p.parents)
    assert [name for name, n in names.items() if n > 1] == []


ROUTING_DECISIONS = ["cairn/cluster/routing/cost.py", "cairn/cluster/routing/predicted.py", "cairn/cluster/routing/ranker.py",
                     "cairn/cluster/routing/router_registry.py"]


def test_the_routing_decisions_and_the_event_publisher_run_without_ray():
    for rel in ROUTING_DECISIONS:
        assert "ray" not in imported_roots(ROOT / rel), rel
    modules = [rel.removesuffix(".py").replace("/", ".") for rel in ROUTING_DECISIONS] + ["cairn.cache_service.publisher"]
    probe = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", f"importing {modules} loads {out.stdout.strip()}"


def test_routing_imports_nothing_of_the_cluster_around_it():
    """cairn.cluster.app, the deployments and the CLI use routing, never the other way round."""
    for path in (PKG / "cluster" / "routing").rglob("*.py"):
        modules = imported_modules(path)
        bad = {m for m in modules if m.startswith("cairn.cluster") and not m.startswith("cairn.cluster.routing")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_routing_and_plan_making_load_no_torch():
    """`cairn.workers` is lazy: the routing package, the scoring it shares with the index, the
    request and the spec, and the engine's plain modules load without torch (a router replica, and
    the deploy step reading a checkpoint's config, never pay for it)."""
    modules = [f"cairn.cluster.routing.{p.stem}" for p in sorted((PKG / "cluster" / "routing").glob("*.py"))
               if p.stem != "__init__"] + ["cairn.cache_service.scoring", "cairn.workers.sampling_params", "cairn.workers.sequence",
                                           "cairn.workers.scheduler", "cairn.workers.cache.checkpoint_policy", "cairn.workers"]
    probe = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", f"importing {modules} loads torch"


BARE = "|".join(ROOMS)
# a bare room named where Python resolves it: an import line (also inside code written for a
# subprocess), a `-m` command line, a Serve config's import_path or a router class path
BARE_REFERENCE = re.compile(rf"(?:^|[\s;\"'(\\n])(?:from\s+(?:{BARE})[\s.]|(?<!cairn )import\s+(?:[\w.]+\s*,\s*)*(?:{BARE})\b"
                            rf"|-m\s+(?:{BARE})\.|import_path:\s*(?:{BARE})\.|[\"'](?:{BARE})(?:\.\w+)+:\w)",
                            re.MULTILINE)
TEXT_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml", ".md", ".json", ".cfg", ".txt", ""}


def tree_files():
    skip = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", ".venv", ".whl", "out"}
    for path in sorted(ROOT.rglob("*")):
        parts = set(path.relative_to(ROOT).parts)
        if path.is_file() and not parts & skip and not any(p.endswith(".egg-info") for p in parts) \
                and path.suffix in TEXT_SUFFIXES and path != Path(__file__).resolve():
            yield path


def test_everything_imports_cairn_through_its_namespace():
    """Issue 37: a bare `kernels` found Hugging Face's package first. No module of cairn, its tests
    or its benchmarks imports a room by its bare name (relative imports resolve under cairn)."""
    for folder in ("cairn", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            bare = {m for m in imported_modules(path) if m.split(".")[0] in ROOMS}
            assert not bare, f"{path.relative_to(ROOT)} imports {bare}: import cairn.{sorted(bare)[0]}"


def test_nothing_in_the_tree_names_a_bare_room_where_python_resolves_it():
    """Code written for a subprocess, `-m` command lines, configs' import paths, router class
    paths, the docs' examples: every one names `cairn.<room>`."""
    found = []
    for path in tree_files():
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group().strip()}"
                  for m in BARE_REFERENCE.finditer(text)]
    assert not found, "bare room names where Python resolves them:\n" + "\n".join(found)


def test_the_bare_reference_reader_finds_what_it_is_for():
    for text in ("import kernels", "from workers.engine import Engine", "x = 1; import cluster",
                 '"import warnings, kernels, torch\\n"',
                 "python3 -m cluster.cli serve", "import_path: cluster.app:app_builder",
                 '"cluster.routing.router:CacheAffinityRouter"', 'code = "from configs import x"'):
        assert BARE_REFERENCE.search(text), text
    for text in ("from cairn import kernels", "import cairn.workers", "from cairn.workers import Engine",
                 "python3 -m cairn.cluster.cli", "import_path: cairn.cluster.app:app_builder",
                 "the workers import nothing", "ray.get(actor.workers.remote())"):
        assert not BARE_REFERENCE.search(text), text
