"""The package layers hold: imports run one way, and engine knowledge stays in backends/."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("loadtests", "gateway", "backends", "routing")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    main = "import sys; from importlinter.cli import lint_imports_command; " \
        "sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", main, "--no-cache"],
                          cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""},
                          capture_output=True, text=True, timeout=120)


def copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.jsonl", "*.csv"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_layer_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("backends/pool.py", "from gateway.config import PoolConfig",
     "backends.pool -> gateway.config"),
    ("routing/router.py", "import backends.pool", "routing.router -> backends.pool"),
])
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, line: str,
                                              broken: str) -> None:
    tree = copy_tree(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert broken in result.stdout


# Paths and metric names only an engine adapter (or a simulated engine) may know.
ENGINE_STRINGS = ("/tokenize", "/health_generate", "/reset_prefix_cache",
                  "/prometheus/metrics", "vllm:", "trtllm_", "num_requests_waiting")


def string_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings = _docstring_ids(tree)  # one walk for them, not one per constant
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings]


def _docstring_ids(tree: ast.Module) -> set[int]:
    """The string constants that open a body (docstrings, and bare strings placed as one)."""
    ids = set()
    for parent in ast.walk(tree):
        body = getattr(parent, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            ids.add(id(body[0].value))
    return ids


def test_engine_paths_and_metric_names_live_only_in_backends() -> None:
    offenders = []
    for package in ("gateway", "routing"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for value in string_literals(path):
                hits = [s for s in ENGINE_STRINGS if s in value]
                if hits:
                    offenders.append(f"{path.relative_to(ROOT)}: {value!r}")
    assert offenders == []
