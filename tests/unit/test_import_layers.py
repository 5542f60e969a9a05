"""The package's import graph is one-way: every module imports only its own layer and the layers
below it (imports inside functions count), and no modules import each other in a cycle.

The layers, lowest first, are listed in ``LAYERS`` (and drawn in docs/architecture.md). Layers
that share a rank (model and cache) are siblings: neither imports the other.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (layer, rank, module prefixes); a module belongs to the layer with its longest matching prefix
LAYERS = [
    ("base", 0, ["qwen_npu.errors", "qwen_npu.extensions", "qwen_npu.npu_runtime", "qwen_npu.progress",
                 "qwen_npu.workloads", "qwen_npu.chat", "qwen_npu.tokenizer", "qwen_npu.testing"]),
    ("config", 1, ["qwen_npu.config"]),
    ("kernels", 2, ["qwen_npu.kernels"]),
    ("device", 3, ["qwen_npu.device"]),
    ("model", 4, ["qwen_npu.model"]),
    ("cache", 4, ["qwen_npu.cache"]),
    ("engine", 5, ["qwen_npu.engine", "qwen_npu.dump"]),
    ("session", 6, ["qwen_npu.session", "qwen_npu.session_steps", "qwen_npu.session_state",
                    "qwen_npu.session_fork", "qwen_npu.session_close", "qwen_npu.loading", "qwen_npu.memory", "qwen_npu.scoring",
                    "qwen_npu.streaming"]),
    ("inspect", 7, ["qwen_npu.inspect"]),
    ("research", 8, ["qwen_npu.research"]),
    ("integrations", 9, ["qwen_npu.integrations"]),
    ("tools", 10, ["qwen_npu.bench", "qwen_npu.bench_floors", "qwen_npu.bench_hf", "qwen_npu.demo",
                  "qwen_npu.cli", "qwen_npu.env", "qwen_npu.kernel_build", "qwen_npu.train",
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


def imports_of(name: str, path: Path, modules) -> set[str]:
    """Every qwen_npu module ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "qwen_npu"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "qwen_npu":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    found.discard(name)
    return found


def layer_of(name: str):
    best = None
    for layer, rank, prefixes in LAYERS:
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[2])):
                best = (layer, rank, p)
    return best


@pytest.fixture(scope="module")
def graph():
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    assert [m for m in graph if m != TOP and layer_of(m) is None] == []


def test_no_module_imports_upward(graph):
    bad = []
    for src, targets in graph.items():
        if src == TOP:
            continue
        s_layer, s_rank, _ = layer_of(src)
        for dst in sorted(targets):
            if dst == TOP:
                bad.append(f"{src} imports the package root")
                continue
            d_layer, d_rank, _ = layer_of(dst)
            if d_layer != s_layer and d_rank >= s_rank:
                bad.append(f"{src} ({s_layer}) -> {dst} ({d_layer})")
    assert bad == [], "imports against the layering:\n" + "\n".join(bad)


# inside inspect: records (plain frozen dataclasses and the functions that take them) never import
# a renderer; they render themselves through qwen_npu.extensions
INSPECT_RECORDS = ["snapshot", "blocks", "kv", "check", "audit", "digest", "slot_detail", "topk"]
INSPECT_RENDERERS = ["html", "grid", "views", "step_view", "report_views", "record_views", "explorer",
                     "explorer_html", "plots"]


def test_inspect_records_do_not_import_renderers(graph):
    inspect_modules = {m.rpartition(".")[2] for m in graph if m.startswith("qwen_npu.inspect.")}
    assert inspect_modules == set(INSPECT_RECORDS) | set(INSPECT_RENDERERS)
    bad = [f"{rec} -> {dst}" for rec in INSPECT_RECORDS
           for dst in sorted(graph[f"qwen_npu.inspect.{rec}"])
           if dst.rpartition(".")[2] in INSPECT_RENDERERS and dst.startswith("qwen_npu.inspect.")]
    assert bad == []


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


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    # a relative import inside a function of an engine module, naming a higher layer, is found
    fake = tmp_path / "a.py"
    fake.write_text("def f():\n    from ..inspect.b import x\n    import qwen_npu.research.c\n")
    modules = {"qwen_npu.engine.a", "qwen_npu.inspect.b", "qwen_npu.research.c"}
    assert imports_of("qwen_npu.engine.a", fake, modules) == {"qwen_npu.inspect.b", "qwen_npu.research.c"}
    assert layer_of("qwen_npu.engine.a")[:2] == ("engine", 5)
    assert layer_of("qwen_npu.session_steps")[0] == "session"      # longest prefix wins
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"], ["c"]]
