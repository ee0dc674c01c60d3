"""Imports go one way (bench -> server -> engine -> attention; server reaches bench only lazily, inside the
CLI's dispatch), and the scheduling core imports no torch.

Read with `ast`, so that a violation is found even in a module nobody imports in the tests."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("attention", "engine", "server", "bench")
# Which of our packages each package must not import, anywhere in it.
FORBIDDEN = {"attention": {"engine", "server", "bench"}, "engine": {"server", "bench"}, "server": set(),
             "bench": set()}
# ... and which it must not import when it is imported (a function body may: `kvserve bench` loads it lazily).
FORBIDDEN_AT_IMPORT = {"server": {"bench"}}
TORCH_FREE = ("engine/request.py", "engine/block_pool.py", "engine/kv_manager.py", "engine/scheduler.py",
              "engine/config.py", "engine/admission.py", "engine/step_clock.py",
              "server/metrics.py")  # the last two: the front ends' /metrics (a front end loads no torch)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path) -> str:
    """The package a relative import in `path` is relative to."""
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_modules(node: ast.AST, path: Path) -> list[str]:
    """Absolute names of the modules one import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package_of(path).split(".")
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    # `from engine import scheduler` may name a submodule: count both.
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def all_imports(tree: ast.AST, path: Path) -> list[str]:
    return [m for node in ast.walk(tree) for m in imported_modules(node, path)]


def import_time_imports(tree: ast.Module, path: Path) -> list[str]:
    """Imports executed when the module is imported: not those in function bodies or `if TYPE_CHECKING`."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        found.extend(imported_modules(node, path))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def layer_violations(path: Path, source: str) -> list[str]:
    package = module_name(path).split(".")[0]
    tree = ast.parse(source)
    forbidden, eager = FORBIDDEN.get(package, set()), FORBIDDEN_AT_IMPORT.get(package, set())
    return sorted({m for m in all_imports(tree, path) if m.split(".")[0] in forbidden}
                  | {m for m in import_time_imports(tree, path) if m.split(".")[0] in eager})


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def project_file(module: str) -> Path | None:
    rel = Path(*module.split("."))
    for candidate in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def torch_reached(start: Path) -> list[str]:
    """The chains of project modules through which importing `start` would import torch."""
    chains, seen, stack = [], set(), [(start, [module_name(start)])]
    while stack:
        path, chain = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        for mod in import_time_imports(ast.parse(path.read_text()), path):
            if mod.split(".")[0] == "torch":
                chains.append(" -> ".join(chain + [mod]))
            # Importing a.b.c runs a/__init__.py and a/b/__init__.py too.
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                target = project_file(".".join(parts[:i]))
                if target is not None:
                    stack.append((target, chain + [module_name(target)]))
    return chains


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_one_way(path):
    assert layer_violations(path, path.read_text()) == []


@pytest.mark.parametrize("rel", TORCH_FREE)
def test_scheduling_core_imports_no_torch(rel):
    assert torch_reached(ROOT / rel) == []


def test_scheduling_core_imports_no_torch_at_run_time():
    mods = ", ".join(module_name(ROOT / rel) for rel in TORCH_FREE)
    code = f"import sys; import {mods}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ---- the checker itself finds what it must ---------------------------------------------------------
@pytest.mark.parametrize("file, source", [
    ("attention/x.py", "from engine.request import Request"),
    ("attention/x.py", "def f():\n    import server.app"),
    ("attention/sub/x.py", "from ...engine import scheduler"),
    ("engine/x.py", "from ..server import protocol"),
    ("engine/x.py", "import server"),
    ("engine/x.py", "def f():\n    from bench.models import build_random_model"),
    ("server/x.py", "from bench import serve"),
])
def test_checker_flags_wrong_way_imports(file, source):
    assert layer_violations(ROOT / file, source)


@pytest.mark.parametrize("file, source", [
    ("engine/x.py", "from attention import get_backend\nfrom . import request"),
    ("server/x.py", "from engine.request import Request\nimport attention"),
    ("attention/x.py", "from .base import AttentionBackend\nimport torch"),
    ("server/x.py", "def dispatch():\n    import bench.serve"),
    ("bench/x.py", "from engine.llm import LLM\nfrom server.settings import Option"),
])
def test_checker_accepts_the_right_way(file, source):
    assert layer_violations(ROOT / file, source) == []


def test_torch_found_through_a_chain(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("from engine.b import x\n")
    (tmp_path / "engine" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n"
                                              "def f():\n    import torch\nimport torch.nn\n")
    (tmp_path / "engine" / "c.py").write_text("def f():\n    import torch\n")
    assert torch_reached(tmp_path / "engine" / "a.py") == ["engine.a -> engine.b -> torch.nn"]
    assert torch_reached(tmp_path / "engine" / "c.py") == []
