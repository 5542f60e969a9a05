"""The pinned torch-npu wheel: which version, where it is cached, and its files, read as text.

The version pair lives in ONE place, ``pyproject.toml``'s ``npu`` extra (``torch==X``,
``torch-npu==Y``); change the torch-npu number there to check a newer release. The wheel is
fetched with ``pip download --no-deps`` into ``QWEN_NPU_WHEEL_CACHE`` (default ``.cache/wheels``
under the repository root) and is only ever opened as a zip file: torch_npu is never imported
and never installed.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10: pip's copy of the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
DOWNLOAD_TIMEOUT_S = 600

# the files of the wheel the checks read (paths inside the wheel)
CUSTOM_SCHEMAS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
CUSTOM_HEADER = "torch_npu/include/torch_npu/csrc/aten/CustomFunctions.h"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
ATB_LIBRARY = "torch_npu/lib/libop_plugin_atb.so"
NPU_LIBRARY = "torch_npu/lib/libtorch_npu.so"
ATB_OPS = "torch_npu/op_plugin/atb/_atb_ops.py"
META = "torch_npu/op_plugin/meta/_meta_registrations.py"
OP_DOCS = "torch_npu/_op_plugin_docs.py"


class WheelUnavailable(RuntimeError):
    """The wheel could not be fetched; ``unreachable`` is True when the registry did not answer."""

    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


def pinned_versions(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{"torch": "2.13.0", "torch-npu": "2.13.0"} from the ``npu`` extra; ValueError if not pinned."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"].get("npu", [])
    pins = {}
    for spec in extra:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([0-9][0-9A-Za-z.+]*)\s*", spec)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    missing = {"torch", "torch-npu"} - set(pins)
    if missing:
        raise ValueError(f"{pyproject}: the 'npu' extra must pin {' and '.join(sorted(missing))} "
                         f"with '==' (found {extra})")
    return pins


def cache_dir() -> Path:
    return Path(os.environ.get("QWEN_NPU_WHEEL_CACHE", ROOT / ".cache" / "wheels"))


def _cached(version: str, folder: Path) -> Path | None:
    found = sorted(folder.glob(f"torch_npu-{version}-*.whl"))
    return found[0] if found else None


def fetch(version: str, folder: Path | None = None, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """The cached wheel of torch-npu ``version``, downloading it first if needed (bounded by
    ``timeout_s``). Raises WheelUnavailable with pip's own words when it cannot be had."""
    folder = folder or cache_dir()
    hit = _cached(version, folder)
    if hit is not None:
        return hit
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"torch-npu=={version}", "-d", str(folder)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise WheelUnavailable(f"pip download torch-npu=={version} took more than {timeout_s:.0f} s",
                               unreachable=True) from None
    hit = _cached(version, folder)
    if proc.returncode != 0 or hit is None:
        said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        # offline, pip says "(from versions: none)"; a registry that answered lists its versions
        answered = any(re.search(r"from versions: (?!none\))", line) for line in said)
        raise WheelUnavailable(f"pip download torch-npu=={version} failed (exit {proc.returncode}): "
                               + " | ".join(said), unreachable=not answered)
    return hit


class Wheel:
    """Text members of one wheel file (read once each, never extracted, never imported)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path)
        self.names = set(self._zip.namelist())
        self._read: dict[str, bytes] = {}

    def read_bytes(self, member: str) -> bytes:
        if member not in self.names:
            raise KeyError(f"{self.path.name} has no file {member}")
        if member not in self._read:
            self._read[member] = self._zip.read(member)
        return self._read[member]

    def read_text(self, member: str) -> str:
        return self.read_bytes(member).decode("utf-8")

    @property
    def version(self) -> str:
        return self.path.name.split("-")[1]

    def requires_torch(self) -> str | None:
        """The torch requirement written in the wheel's METADATA (e.g. 'torch==2.13.0.*')."""
        meta = self.read_text(f"torch_npu-{self.version}.dist-info/METADATA")
        for line in meta.splitlines():
            m = re.match(r"Requires-Dist:\s*torch\s*(\S.*?)\s*(;.*)?$", line)
            if m:
                return m.group(1).strip("() ")
        return None


CUSTOM_OPS = "torch_npu/utils/custom_ops.py"


def exposed_ops(wheel: Wheel) -> dict[str, str]:
    """{name: what torch_npu.<name> is}: the ``torch_npu.X = torch.ops.npu.X`` lines of
    custom_ops.py, and the ATB loader's API_LIST (patched in as ``torch.ops.atb.X``)."""
    out = {m.group(1): m.group(2) for m in re.finditer(
        r"^torch_npu\.(\w+)\s*=\s*(torch\.ops\.\w+\.\w+)\s*$", wheel.read_text(CUSTOM_OPS), re.MULTILINE)}
    tree = ast.parse(wheel.read_text(ATB_OPS))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "API_LIST" for t in node.targets):
            out.update({name: f"torch.ops.atb.{name}" for name in ast.literal_eval(node.value)})
    return out
