"""Op signatures read out of the torch-npu wheel's files, and binding a recorded call against them.

Sources (all text inside the wheel, parsed with torch's own schema parser):
- torch_npu's custom ops (``npu_rms_norm``, ``npu_fused_infer_attention_score``, ...): the
  ``func:`` schemas of ``npu_native_functions_by_codegen.yaml``, which ``torch_npu.X`` exposes
  as ``torch.ops.npu.X``.
- the ATB ops (``_npu_reshape_and_cache``, ``_npu_paged_attention``): their declarations in
  ``AtbOpsInterface.h``, turned into schemas. A header has no defaults and no keyword-only
  marker, so an optional parameter is taken to default to None, and the C++ ``_opt`` suffix of
  an optional string is dropped; ``compiled_schemas`` reads the schemas stored whole in
  ``libop_plugin_atb.so`` so a test can check these rules where both exist.
"""
from __future__ import annotations

import dataclasses
import re

import torch

NO_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str          # torch's spelling: "Tensor", "Optional[Tensor]", "List[int]", "float", ...
    default: object    # NO_DEFAULT when the caller must pass it
    kwarg_only: bool
    mutable: bool      # Tensor(a!): written in place


@dataclasses.dataclass(frozen=True)
class Signature:
    op: str
    params: tuple[Param, ...]
    source: str        # the wheel file it was read from
    returns: int = 0   # how many tensors the schema returns

    @property
    def functional(self) -> bool:
        """Returns its results and writes no argument: a caller that drops them loses the op."""
        return self.returns > 0 and not any(p.mutable for p in self.params)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.op} has no argument {name!r}")


class BindError(TypeError):
    """A call that does not fit the op's signature; the message names the op and the argument."""


def from_schema(schema: str, source: str) -> Signature:
    parsed = torch._C.parse_schema(schema)
    params = tuple(Param(a.name, str(a.type), a.default_value if a.has_default_value() else NO_DEFAULT,
                         a.kwarg_only, bool(a.alias_info and a.alias_info.is_write))
                   for a in parsed.arguments)
    return Signature(parsed.name.split("::")[-1], params, source, len(parsed.returns))


def custom_schemas(yaml_text: str, source: str) -> dict[str, Signature]:
    """Every ``func:`` of the native-functions yaml, keyed by op name (overloads keep their '.x')."""
    out: dict[str, Signature] = {}
    for m in re.finditer(r"^\s*(?:-\s*)?func:\s*(.+?)\s*$", yaml_text, re.MULTILINE):
        text = m.group(1).strip("'\"")
        name = text.split("(", 1)[0]
        if "(" in text and name not in out:   # entries that only name an aten op have no schema
            out[name] = from_schema(text, source)
    return out


# C++ parameter type in AtbOpsInterface.h -> schema type (None: optional, defaults to None)
_CPP_TYPES = [
    (r"const at::Tensor\s*&", "Tensor", False),
    (r"at::Tensor\s*&", "Tensor(!)", False),
    (r"const c10::optional<at::Tensor>\s*&", "Tensor?", True),
    (r"(const )?int64_t", "int", False),
    (r"(const )?double", "float", False),
    (r"(const )?bool", "bool", False),
    (r"c10::SymIntArrayRef", "SymInt[]", False),
    (r"at::IntArrayRef", "int[]", False),
    (r"c10::optional<c10::string_view>", "str?", True),
    (r"c10::string_view", "str", False),
    (r"c10::optional<int64_t>", "int?", True),
]


def _split_params(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def header_schema(decl_params: str, op: str) -> str:
    """One AtbOpsInterface.h parameter list as a schema string (ValueError on an unknown type)."""
    args, written = [], 0
    for param in _split_params(decl_params):
        m = re.fullmatch(r"(.*?)\s*([A-Za-z_]\w*)", param)
        cpp, name = m.group(1).strip(), m.group(2)
        if cpp.startswith("c10::optional<c10::string_view>"):
            name = name.removesuffix("_opt")   # torchgen's C++ name for an optional str argument
        for pattern, kind, optional in _CPP_TYPES:
            if re.fullmatch(pattern, cpp):
                if "(!)" in kind:   # each in-place tensor gets its own alias set: a, b, ..., z, aa, ...
                    kind = kind.replace("(!)", f"({chr(97 + written % 26) * (1 + written // 26)}!)")
                    written += 1
                args.append(f"{kind} {name}" + ("=None" if optional else ""))
                break
        else:
            raise ValueError(f"{op}: parameter {name!r} has C++ type {cpp!r} the reader does not know")
    return f"{op}({', '.join(args)}) -> ()"


def atb_schemas(header_text: str, source: str) -> dict[str, Signature]:
    """Every ``TORCH_NPU_API <ret> name(...)`` of AtbOpsInterface.h; ops with a parameter type the
    reader does not know are left out (looking them up then says so)."""
    out = {}
    for m in re.finditer(r"TORCH_NPU_API\s+[^;(]*?\b([A-Za-z_]\w*)\s*\(([^;]*)\)\s*;", header_text):
        try:
            out.setdefault(m.group(1), from_schema(header_schema(m.group(2), m.group(1)), source))
        except (ValueError, RuntimeError):   # unknown type, or an optional before a required one
            continue
    return out


def compiled_schemas(library: bytes, source: str) -> dict[str, Signature]:
    """The schemas stored whole as C strings in a compiled op library (short ones are split by
    the compiler and cannot be read back)."""
    out = {}
    for raw in re.findall(rb"[\x20-\x7e]{12,}", library):
        text = raw.decode()
        if re.fullmatch(r"[A-Za-z_][\w.]*\(.*\) -> .+", text):
            try:
                sig = from_schema(text, source)
            except RuntimeError:
                continue
            out.setdefault(text.split("(", 1)[0], sig)
    return out


def compiled_schema(library: bytes, op: str, source: str) -> Signature | None:
    """The schema of ``op`` (default overload) stored whole in a compiled library, if any."""
    m = re.search(rb"(?<![\w.])" + re.escape(op.encode()) + rb"\([\x20-\x7e]*?\) -> [\x20-\x7e]+", library)
    return from_schema(m.group(0).decode(), source) if m else None


def _fits(kind: str, value) -> bool:
    if kind.startswith("Optional["):
        return value is None or _fits(kind[len("Optional["):-1], value)
    if kind == "Tensor":
        return isinstance(value, torch.Tensor)
    if kind in ("int", "SymInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind in ("List[int]", "List[SymInt]"):
        return isinstance(value, (list, tuple, torch.Size)) and all(_fits("int", v) for v in value)
    if kind == "List[Tensor]":
        return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)
    raise BindError(f"the check cannot judge values of schema type {kind}")


def _type_name(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor[{str(value.dtype).removeprefix('torch.')}, {list(value.shape)}]"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of " + ", ".join(sorted({type(v).__name__ for v in value}) or ["nothing"])
    return type(value).__name__


def bind(sig: Signature, args: tuple, kwargs: dict) -> dict[str, object]:
    """How torch's dispatcher would match ``op(*args, **kwargs)`` to the schema: {name: value}
    for every parameter (defaults filled in). BindError names the op and the argument."""
    positional = [p for p in sig.params if not p.kwarg_only]
    if len(args) > len(positional):
        raise BindError(f"{sig.op}: takes {len(positional)} positional arguments "
                        f"({', '.join(p.name for p in positional)}), the call passes {len(args)}")
    bound: dict[str, object] = {}
    where: dict[str, str] = {}
    for i, (p, value) in enumerate(zip(positional, args)):
        bound[p.name], where[p.name] = value, f"position {i}"
    names = [p.name for p in sig.params]
    for name, value in kwargs.items():
        if name not in names:
            raise BindError(f"{sig.op}: has no argument {name!r} (it takes {', '.join(names)})")
        if name in bound:
            raise BindError(f"{sig.op}: argument {name!r} is passed both by position and by keyword")
        bound[name], where[name] = value, "keyword"
    for p in sig.params:
        if p.name not in bound:
            if p.default is NO_DEFAULT:
                raise BindError(f"{sig.op}: argument {p.name!r} is required and the call does not pass it")
            bound[p.name] = p.default
            continue
        if not _fits(p.type, bound[p.name]):
            raise BindError(f"{sig.op}: argument {p.name!r} ({where[p.name]}) expects {p.type}, "
                            f"the call passes {_type_name(bound[p.name])}")
    return {p.name: bound[p.name] for p in sig.params}
