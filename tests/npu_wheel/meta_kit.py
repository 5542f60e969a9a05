"""Run the wheel's own meta (shape) registrations on the CPU, in isolation.

``_meta_registrations.py`` computes each custom op's output shapes and dtypes in plain Python.
It cannot be imported without torch_npu, so ``MetaFunctions`` lifts ONE registered function out
of its source with ``ast``, together with the module-level helpers and constants it reaches,
drops the registering decorator, and runs it with meta tensors. The few names the module takes
from torch_npu (error-code helpers) get small stand-ins; anything else it needs from torch_npu
fails with the name.
"""
from __future__ import annotations

import ast
import builtins
import copy
import math
import os
import warnings

import torch


class _ErrCode:
    def __getattr__(self, name):
        return name


def _missing(name):
    def fail(*_, **__):
        raise NameError(f"the meta registration needs {name} from torch_npu, which is not available here")
    return fail


SHIMS = {"torch": torch, "math": math, "os": os, "warnings": warnings, "ErrCode": _ErrCode(),
         "ops_error": lambda code: f" [{code}]"}


def _walk(node: ast.AST):
    """ast.walk without the decorators (they register the function with torch_npu)."""
    if isinstance(node, ast.FunctionDef):
        node = copy.copy(node)
        node.decorator_list = []
    return ast.walk(node)


class MetaFunctions:
    def __init__(self, source: str, library_var: str = "m"):
        self.tree = ast.parse(source)
        self.library_var = library_var
        self.top: dict[str, ast.stmt] = {}
        self.order: dict[str, int] = {}
        self.registered: dict[str, str] = {}          # op name -> function name
        for i, node in enumerate(self.tree.body):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.top.setdefault(node.name, node)
                self.order.setdefault(node.name, i)
                for dec in getattr(node, "decorator_list", []):
                    op = self._registered_op(dec)
                    if op is not None:
                        self.registered.setdefault(op, node.name)
            elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
                for t in node.targets:
                    self.top.setdefault(t.id, node)
                    self.order.setdefault(t.id, i)
        self._compiled: dict[str, object] = {}

    def _registered_op(self, dec: ast.expr) -> str | None:
        """'op' for ``@impl(m, "op")`` on the module's npu Meta library."""
        if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id == "impl"
                and len(dec.args) == 2 and isinstance(dec.args[0], ast.Name)
                and dec.args[0].id == self.library_var and isinstance(dec.args[1], ast.Constant)):
            return dec.args[1].value
        return None

    def _closure(self, name: str) -> list[str]:
        seen, todo = set(), [name]
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            for node in _walk(self.top[cur]):
                if isinstance(node, ast.Name) and node.id in self.top and node.id not in seen:
                    todo.append(node.id)
        return sorted(seen, key=self.order.__getitem__)

    def function(self, op: str):
        """The wheel's meta function for ``op`` as a plain callable (KeyError if it has none)."""
        if op not in self.registered:
            raise KeyError(f"the wheel registers no meta function for {op}")
        if op not in self._compiled:
            fname = self.registered[op]
            namespace: dict[str, object] = dict(SHIMS)
            for name in self._closure(fname):
                node = self.top[name]
                if isinstance(node, ast.FunctionDef):
                    node = copy.copy(node)
                    node.decorator_list = []          # the registering @impl(...) needs torch_npu
                module = ast.Module(body=[node], type_ignores=[])
                code = compile(ast.fix_missing_locations(module), f"<wheel meta {name}>", "exec")
                exec(code, namespace)  # noqa: S102 -- the wheel's own shape code, the point of the check
            for name in self._free_names(fname, namespace):
                namespace[name] = _missing(name)
            self._compiled[op] = namespace[fname]
        return self._compiled[op]

    def _free_names(self, fname: str, namespace: dict) -> set[str]:
        names = {n.id for name in self._closure(fname) for n in _walk(self.top[name])
                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        return {n for n in names if n not in namespace and not hasattr(builtins, n)
                and not self._is_local(n, fname)}

    def _is_local(self, name: str, fname: str) -> bool:
        for node in ast.walk(self.top[fname]):
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
                return True
            if isinstance(node, ast.arg) and node.arg == name:
                return True
        return False

    def run(self, op: str, /, *args, **kwargs):
        """Outputs of the meta function for real (cpu) arguments: tensors go in as meta tensors,
        outputs come back as empty tensors of the inferred shape and dtype on the device of the
        first tensor argument."""
        def to_meta(v):
            if isinstance(v, torch.Tensor):
                return torch.empty(v.shape, dtype=v.dtype, device="meta")
            if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
                return type(v)(to_meta(x) for x in v)
            return v

        device = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), "cpu")
        out = self.function(op)(*(to_meta(a) for a in args), **{k: to_meta(v) for k, v in kwargs.items()})

        def back(v):
            if isinstance(v, torch.Tensor):
                return torch.empty(v.shape, dtype=v.dtype, device=device)
            if isinstance(v, (list, tuple)):
                return type(v)(back(x) for x in v)
            return v
        return back(out)
