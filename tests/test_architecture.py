"""The folders are the architecture: dependencies point one way, plan-making touches no tensor."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN_MAKING = sorted({p.relative_to(ROOT).as_posix() for p in (ROOT / "workers" / "cache").glob("*.py")}
                     - {"workers/cache/device_budget.py"}) + \
    ["workers/scheduler.py", "workers/plan.py", "workers/slot.py", "workers/sequence.py", "workers/sequence_cache.py",
     "workers/sampling_params.py",
     "workers/options.py", "workers/spec.py", "workers/tenant_queue.py"]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_plan_making_code_imports_no_torch():
    for rel in PLAN_MAKING:
        assert "torch" not in imported_roots(ROOT / rel), rel


def test_dependencies_point_one_way():
    allowed = {"kernels": set(), "cache_service": {"cache_service"}, "workers": {"workers", "kernels", "cache_service"}}
    ours = {"cluster", "workers", "cache_service", "kernels"}
    for package, may_import in allowed.items():
        for path in (ROOT / package).rglob("*.py"):
            bad = (imported_roots(path) & ours) - may_import - {package}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_the_index_actor_imports_ray_below_cluster():
    for package in ("workers", "cache_service", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "cache_service/actor.py":
                continue
            assert "ray" not in imported_roots(path), path.relative_to(ROOT)


def test_the_http_api_runs_without_ray_or_the_serve_layer():
    for path in (ROOT / "cluster" / "api").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        bad = {m for m in modules if m.split(".")[0] == "ray" or
               (m.startswith("cluster.") and not m.startswith("cluster.api"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


ROUTING_DECISIONS = ["cluster/routing/cost.py", "cluster/routing/predicted.py", "cluster/routing/ranker.py",
                     "cluster/routing/registry.py"]


def test_the_routing_decisions_and_the_event_publisher_run_without_ray():
    for rel in ROUTING_DECISIONS:
        assert "ray" not in imported_roots(ROOT / rel), rel
    modules = [rel.removesuffix(".py").replace("/", ".") for rel in ROUTING_DECISIONS] + ["cache_service.publisher"]
    probe = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", f"importing {modules} loads {out.stdout.strip()}"


def test_routing_imports_nothing_of_the_cluster_around_it():
    """cluster.app, the deployments and the CLI use routing, never the other way round."""
    for path in (ROOT / "cluster" / "routing").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        bad = {m for m in modules if m.split(".")[0] == "cluster" and not m.startswith("cluster.routing")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_routing_and_plan_making_load_no_torch():
    """`workers/__init__` is lazy: the routing package, the scoring it shares with the index, the
    request and the spec, and the engine's plain modules load without torch (a router replica, and
    the deploy step reading a checkpoint's config, never pay for it)."""
    modules = [f"cluster.routing.{p.stem}" for p in sorted((ROOT / "cluster" / "routing").glob("*.py"))
               if p.stem != "__init__"] + ["cache_service.scoring", "workers.sampling_params", "workers.sequence",
                                           "workers.scheduler", "workers.cache.checkpoint_policy", "workers"]
    probe = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", f"importing {modules} loads torch"
