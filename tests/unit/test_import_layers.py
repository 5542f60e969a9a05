"""The package's import graph is one-way: every module imports only its own layer and the layers
below it (imports inside functions count), and no modules import each other in a cycle.

The layers, lowest first, are listed in ``LAYERS`` (and drawn in docs/architecture.md). Layers
that share a rank (model and cache) are siblings: neither imports the other.

One exception, and only this one (``lazy_exception``): the Session facade (``qwen_npu/session*.py``)
and the display methods of any object (functions named ``__repr__`` or ``_repr_html_``) may import
the inspect and research layers inside a function, at the time they are called. Such an import is
not an edge of the graph the cycle check reads (it runs after every module has loaded). Any other
upward import, lazy or not, still fails.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (layer, rank, module prefixes); a module belongs to the layer with its longest matching prefix
LAYERS = [
    ("base", 0, ["qwen_npu.errors", "qwen_npu.device.npu_runtime", "qwen_npu.text", "qwen_npu.testing"]),
    ("config", 1, ["qwen_npu.config"]),
    ("kernels", 2, ["qwen_npu.kernels"]),
    ("device", 3, ["qwen_npu.device"]),
    ("model", 4, ["qwen_npu.model"]),
    ("cache", 4, ["qwen_npu.cache"]),
    ("engine", 5, ["qwen_npu.engine", "qwen_npu.dump"]),
    ("parallel", 6, ["qwen_npu.parallel"]),
    ("session", 7, ["qwen_npu.session"]),
    ("inspect", 8, ["qwen_npu.inspect"]),
    ("research", 9, ["qwen_npu.research"]),
    ("integrations", 10, ["qwen_npu.integrations"]),
    ("tools", 11, ["qwen_npu.__main__", "qwen_npu.tools", "qwen_npu.train",
                  "qwen_npu.research.capture_bench"]),    # a benchmark script: it loads a Session
]
TOP = "qwen_npu"          # the package's __init__: it assembles every layer, nothing imports it back


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "qwen_npu").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").parts
        parts = (["qwen_npu", "kernels"] + list(rel[1:])) if rel[0] == "kernels" else list(rel)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


DISPLAY_METHODS = ("__repr__", "_repr_html_")
LAZY_UPWARD = ("inspect", "research")      # the layers the exception lets a lower module import


def import_edges(name: str, tree: ast.Module, modules, *, is_package: bool = False) -> set[tuple[str, str]]:
    """(module, where) for every qwen_npu module ``name`` imports. ``where`` is "top" (module
    level), "display" (the nearest enclosing function is a display method) or "function"."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[tuple[str, str]] = set()

    def targets(node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names if a.name.split(".")[0] == "qwen_npu"}
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.split(".")[0] != "qwen_npu":
            return set()
        return {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}

    def visit(node, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, "display" if child.name in DISPLAY_METHODS else "function")
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update((t, where) for t in targets(child) if t != name)
            visit(child, where)

    visit(tree, "top")
    return found


def parse_edges(name: str, path: Path, modules) -> set[tuple[str, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return import_edges(name, tree, modules, is_package=path.name == "__init__.py")


def imports_of(name: str, path: Path, modules) -> set[str]:
    """Every qwen_npu module ``name`` imports, at the top or inside a function."""
    return {target for target, _ in parse_edges(name, path, modules)}


def layer_of(name: str):
    best = None
    for layer, rank, prefixes in LAYERS:
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[2])):
                best = (layer, rank, p)
    return best


FACADE = {"qwen_npu.session", "qwen_npu.session.session", "qwen_npu.session.steps", "qwen_npu.session.state",
          "qwen_npu.session.fork", "qwen_npu.session.close", "qwen_npu.session.generate"}


def is_facade(name: str) -> bool:
    """A module of the Session facade: the Session class and its parts in ``qwen_npu/session/``
    (not the session layer's helpers: loading, memory, scoring, streaming, options, progress)."""
    return name in FACADE


def lazy_exception(src: str, dst: str, where: str) -> bool:
    """Is ``src`` importing ``dst`` the one permitted upward import? Only an import inside a
    function, of the inspect or research layer, by the Session facade or in a display method."""
    if where == "top" or dst == TOP or layer_of(dst)[0] not in LAZY_UPWARD:
        return False
    return where == "display" or is_facade(src)


def upward_imports(edges: dict[str, set[tuple[str, str]]]) -> list[str]:
    """Every import of ``edges`` against the layering (the exception aside), as "src -> dst"."""
    bad = []
    for src, found in sorted(edges.items()):
        if src == TOP:
            continue
        s_layer, s_rank, _ = layer_of(src)
        for dst, where in sorted(found):
            if dst == TOP:
                bad.append(f"{src} imports the package root")
                continue
            d_layer, d_rank, _ = layer_of(dst)
            if d_layer != s_layer and d_rank >= s_rank and not lazy_exception(src, dst, where):
                bad.append(f"{src} ({s_layer}) -> {dst} ({d_layer}, {where})")
    return bad


@pytest.fixture(scope="module")
def edges():
    modules = module_files()
    return {name: parse_edges(name, path, modules) for name, path in modules.items()}


@pytest.fixture(scope="module")
def graph(edges):
    """The import graph without the exception's imports (they run once every module has loaded)."""
    return {src: {dst for dst, where in found if not lazy_exception(src, dst, where)}
            for src, found in edges.items()}


def test_every_module_has_a_layer(graph):
    assert [m for m in graph if m != TOP and layer_of(m) is None] == []


def test_no_module_imports_upward(edges):
    bad = upward_imports(edges)
    assert bad == [], "imports against the layering:\n" + "\n".join(bad)


# inside inspect: records (plain frozen dataclasses and the functions that take them) import a
# renderer only in their display methods (``__repr__``, ``_repr_html_``), when those are called
INSPECT_RECORDS = ["snapshot", "blocks", "kv", "check", "audit", "digest", "slot_detail", "topk"]
INSPECT_RENDERERS = ["html", "grid", "views", "step_view", "report_views", "record_views", "explorer",
                     "explorer_html", "plots"]


def record_imports_of_renderers(edges) -> list[str]:
    return [f"{rec} -> {dst} ({where})" for rec in INSPECT_RECORDS
            for dst, where in sorted(edges.get(f"qwen_npu.inspect.{rec}", ()))
            if dst.startswith("qwen_npu.inspect.") and dst.rpartition(".")[2] in INSPECT_RENDERERS
            and where != "display"]


def test_inspect_records_do_not_import_renderers(edges):
    inspect_modules = {m.rpartition(".")[2] for m in edges if m.startswith("qwen_npu.inspect.")}
    assert inspect_modules == set(INSPECT_RECORDS) | set(INSPECT_RENDERERS)
    assert record_imports_of_renderers(edges) == []


def strongly_connected(graph) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles(graph):
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert cycles == []


def synthetic(name: str, source: str, modules=()) -> dict[str, set[tuple[str, str]]]:
    return {name: import_edges(name, ast.parse(source), set(modules))}


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    # a relative import inside a function of an engine module, naming a higher layer, is found
    fake = tmp_path / "a.py"
    fake.write_text("def f():\n    from ..inspect.b import x\n    import qwen_npu.research.c\n")
    modules = {"qwen_npu.engine.a", "qwen_npu.inspect.b", "qwen_npu.research.c"}
    assert imports_of("qwen_npu.engine.a", fake, modules) == {"qwen_npu.inspect.b", "qwen_npu.research.c"}
    assert layer_of("qwen_npu.engine.a")[:2] == ("engine", 5)
    assert layer_of("qwen_npu.device.npu_runtime")[0] == "base"      # longest prefix wins
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"], ["c"]]


def test_a_lazy_upward_import_is_caught_outside_the_exception():
    # an engine module: allowed only inside __repr__ / _repr_html_ (nearest function), and only
    # of inspect or research; a helper function, a nested function or the module level is caught
    source = (
        "from ..inspect.views import at_top\n"
        "class Step:\n"
        "    def __repr__(self):\n"
        "        from ..inspect.snapshot import take_step\n"
        "        return repr(take_step(self))\n"
        "    def _repr_html_(self):\n"
        "        from ..tools.bench import figures\n"
        "        def later():\n"
        "            from ..research.capture import Capture\n"
        "        return ''\n"
        "    def render(self):\n"
        "        from ..inspect.step_view import step_html\n"
    )
    modules = {"qwen_npu.inspect.snapshot", "qwen_npu.inspect.views", "qwen_npu.inspect.step_view",
               "qwen_npu.research.capture", "qwen_npu.tools.bench"}
    found = synthetic("qwen_npu.engine.plan", source, modules)
    assert ("qwen_npu.inspect.snapshot", "display") in found["qwen_npu.engine.plan"]
    assert upward_imports(found) == [
        "qwen_npu.engine.plan (engine) -> qwen_npu.inspect.step_view (inspect, function)",
        "qwen_npu.engine.plan (engine) -> qwen_npu.inspect.views (inspect, top)",
        "qwen_npu.engine.plan (engine) -> qwen_npu.research.capture (research, function)",
        "qwen_npu.engine.plan (engine) -> qwen_npu.tools.bench (tools, display)",
    ]


def test_the_session_facade_may_import_inspect_and_research_only_inside_functions():
    source = (
        "from ..inspect.check import CheckReport\n"
        "def check(sess):\n"
        "    from ..inspect.check import check_session\n"
        "    from ..research.capture import Capture\n"
        "    from ..integrations.step_guard import StepGuard\n"
        "    import qwen_npu\n"
    )
    modules = {"qwen_npu.inspect.check", "qwen_npu.research.capture", "qwen_npu.integrations.step_guard"}
    assert upward_imports(synthetic("qwen_npu.session.steps", source, modules)) == [
        "qwen_npu.session.steps imports the package root",
        "qwen_npu.session.steps (session) -> qwen_npu.inspect.check (inspect, top)",
        "qwen_npu.session.steps (session) -> qwen_npu.integrations.step_guard (integrations, function)",
    ]
    # the same function in a session-layer module outside the facade is caught
    assert "qwen_npu.session.memory (session) -> qwen_npu.research.capture (research, function)" in upward_imports(
        synthetic("qwen_npu.session.memory", source, modules))


def test_a_record_imports_a_renderer_only_in_its_display_methods():
    source = ("def __repr__(self):\n    from .views import request_text\n"
              "def take(x):\n    from .views import request_html\n")
    found = synthetic("qwen_npu.inspect.snapshot", source, {"qwen_npu.inspect.views"})
    assert record_imports_of_renderers(found) == ["snapshot -> qwen_npu.inspect.views (function)"]
