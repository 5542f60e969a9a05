"""Imports made inside a function run only when it is called: the Session's inspection and research
methods and the display methods of lower objects import what implements them that way (see
docs/architecture.md). These tests resolve every such import now, so a moved or renamed function
fails here instead of in a notebook cell."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import qwen_npu
from qwen_npu.cache.slot_check import check_slot_mapping

ROOT = Path(qwen_npu.__file__).resolve().parent


def function_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every ``from qwen_npu... import name`` inside a function."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] == "qwen_npu":
                    out += [(str(path.relative_to(ROOT.parent)), node.lineno, target, a.name) for a in node.names]
    return out


def test_every_import_inside_a_function_resolves():
    found = function_imports()
    targets = {(m, n) for _, _, m, n in found}
    assert ("qwen_npu.inspect.check", "check_session") in targets          # Session.check
    assert ("qwen_npu.inspect.snapshot", "take_step") in targets           # StepResult.__repr__
    assert len(found) > 40
    broken = []
    for where, line, module, name in found:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and not e.name.startswith("qwen_npu"):
                continue                    # an optional dependency this machine lacks
            broken.append(f"{where}:{line}: no module {module}")
            continue
        if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
            broken.append(f"{where}:{line}: {module} has no {name!r}")
    assert broken == []


def test_a_lower_object_renders_through_the_inspect_renderer():
    from qwen_npu.inspect.report_views import slot_report_html

    report = check_slot_mapping([4, 4], [[1], [1]], 4)
    assert not report.ok
    assert report._repr_html_() == slot_report_html(report)
    assert "slot 4" in report._repr_html_()


def test_the_old_fork_module_still_works_and_says_where_it_moved():
    import sys

    import pytest

    sys.modules.pop("qwen_npu.research.fork", None)
    with pytest.warns(DeprecationWarning, match="qwen_npu.research.fork moved to qwen_npu.session.fork"):
        old = importlib.import_module("qwen_npu.research.fork")
    from qwen_npu.session import fork as session_fork
    assert old.fork_session is session_fork.fork_session and old.Branches is session_fork.Branches
