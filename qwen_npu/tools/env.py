"""``qwen_npu.env_report()`` / ``qwen-npu env``: the block to paste into a bug report.

Versions (Python, torch, transformers, tokenizers, torch_npu, CANN), the devices this process
sees, whether the C++ CPU kernels can be built and are built (the compiler's error when their
last build failed), whether the CPU has native bf16, and what
``Session.from_pretrained(device="auto", kernels="auto")`` would choose here, and why.
Versions come from package metadata, so nothing heavy is imported; torch_npu is only ever
probed through ``qwen_npu.device`` (its guarded loader).
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import json
import os
import platform
import re
import sys

import torch

from .. import device as devices
from ..config import device_outputs_default

ENV_VARS = ("QWEN_NPU_DEVICE_OUTPUTS", "QWEN_NPU_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS", "TORCH_DEVICE_BACKEND_AUTOLOAD", "ASCEND_RT_VISIBLE_DEVICES",
            "CUDA_VISIBLE_DEVICES", "ASCEND_TOOLKIT_HOME", "OMP_NUM_THREADS")
CANN_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann/latest")


@dataclasses.dataclass(frozen=True)
class EnvReport:
    """Ordered (name, value) lines; ``str()`` is the paste-ready text, ``as_dict()`` for JSON."""

    items: tuple[tuple[str, str], ...]

    def as_dict(self) -> dict[str, str]:
        return dict(self.items)

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.items)
        return "\n".join(["qwen-npu environment"] + [f"  {k:<{width}}  {v}" for k, v in self.items])

    __repr__ = __str__


def env_report() -> EnvReport:
    """Collect the report now (probes the NPU once; never raises for a missing package)."""
    items = [
        ("qwen_npu", _version("qwen-npu")),
        ("python", f"{platform.python_version()} ({platform.python_implementation()}) {sys.executable}"),
        ("platform", platform.platform()),
        ("torch", (f"{torch.__version__} (cuda {torch.version.cuda or 'none'}, "
                   f"{torch.get_num_threads()} cpu threads)")),
        ("transformers", _version("transformers")),
        ("tokenizers", _version("tokenizers")),
        ("torch_npu", _version("torch-npu", "torch_npu")),
        ("CANN", cann_version()),
        ("cpu", f"{os.cpu_count()} cores"),
        ("cuda devices", _cuda_devices()),
    ]
    npu_ok, npu_reason = devices.npu_status()
    items.append(("npu devices", _npu_devices() if npu_ok else npu_reason))
    items.append(("npu attention", npu_attention_choice(devices.installed_op_support())))
    items += _cpu_kernels()
    items += _session_choice()
    env = ", ".join(f"{k}={os.environ[k]}" for k in ENV_VARS if k in os.environ)
    items.append(("environment", env or "-"))
    return EnvReport(tuple(items))


def cann_version() -> str:
    """The Ascend CANN toolkit version from its install files, or "not found"."""
    roots = [os.environ[k] for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH") if os.environ.get(k)]
    for root in roots + list(CANN_ROOTS):
        files = glob.glob(os.path.join(root, "*", "ascend_toolkit_install.info"))
        files += [os.path.join(root, n)
                  for n in ("version.cfg", "compiler/version.info", "runtime/version.info")]
        for f in files:
            try:
                with open(f) as fh:
                    text = fh.read()
            except OSError:
                continue
            m = re.search(r"^\s*(?:version|Version)\s*=\s*\[?([^\]\s:]+)", text, re.MULTILINE)
            if m:
                return f"{m.group(1)} ({root})"
    return "not found"


def _version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cuda_devices() -> str:
    if not torch.cuda.is_available():
        return "none"
    return "; ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))


def _npu_devices() -> str:
    npu = devices.load_torch_npu().npu
    try:
        return "; ".join(f"npu:{i} {npu.get_device_name(i)}" for i in range(npu.device_count()))
    except (AttributeError, RuntimeError) as e:
        return f"{npu.device_count()} visible (names unavailable: {e})"


def npu_attention_choice(support: dict[str, str | None], block_size: int | None = None) -> str:
    """Which attention op the npu kernel set takes for each kind of step on this stack
    (``npu_runtime.op_support``) at ``block_size`` (default: the npu default, 128), as
    ``kernels/npu.py`` decides, and the limits that send a call to the reference kernel."""
    if not support:
        return "- (torch_npu not loaded)"
    from ..kernels import npu as npu_k
    fia_name, atb_name = npu_k.FIA, npu_k.ATB_DECODE
    bs = devices.default_block_size("npu") if block_size is None else block_size
    fia, atb = support.get(fia_name, "not probed"), support.get(atb_name, "not probed")
    paged = fia is None and bs in npu_k.PAGED_BLOCK_SIZES
    atb_ok = atb is None and bs % 16 == 0
    atb_text = f"{atb_name} (ATB; block_size * head_dim <= {128 * 128}, head_dim <= 256)"
    fresh = f"{fia_name} (unpaged)" if fia is None else "the reference"
    chunks = f"{fia_name} (paged)" if paged else "the reference"
    decode = [f"{fia_name} (paged)"] if paged else []
    decode += [atb_text] if atb_ok else ([] if decode else ["the reference"])
    parts = [f"block size {bs}: all-fresh prefill: {fresh}", f"prefill chunks and mixed steps: {chunks}",
             "decode: " + ", where that cannot: ".join(decode)]
    if fia is None:
        parts.append("FIA needs fp16/bf16, head_dim % 16 == 0, at most 64 query heads per kv head"
                     + (f", paged: kv_heads * head_dim <= {npu_k.MAX_KV_HIDDEN}" if paged else
                        ", paged: a block size of 128..512 in steps of 128"))
    else:
        parts.append(f"no FIA: {fia}")
    if atb is not None:
        parts.append(f"no ATB decode: {atb}")
    elif not atb_ok:
        parts.append(f"no ATB decode at block size {bs} (not a multiple of 16)")
    missing = [op for op, why in support.items() if why is not None and op not in (fia_name, atb_name)]
    if missing:
        parts.append("missing, run by the reference kernels: " + ", ".join(missing))
    return "; ".join(parts)


def _cpu_kernels() -> list[tuple[str, str]]:
    """Can the cpu set be built here, is it built (or did its build fail, and how), and what
    kernels="auto" picks on this CPU and why."""
    from ..kernels import build, cpu, cpu_choice, cpu_features
    ok, reason = cpu.availability()
    items = [("cpu isa", cpu_features.isa_cap_in_force()[1]),
             ("cpu kernels", f"{'usable' if ok else 'not usable'}: {reason}")]
    if ok:
        state, detail = build.build_status(cpu.extension())
        hint = {"not built": "; `qwen-npu build-kernels` builds it now (about a minute or two)",
                "failed": "; `qwen-npu build-kernels` tries again",
                "failed before": "; `qwen-npu build-kernels` tries again"}.get(state, "")
        items.append(("cpu kernel build", f"{state}: {detail}{hint}"))
    items.append(("native bf16", cpu_choice.native_bf16()[1]))
    chosen, why = devices.cpu_kernels_choice()
    items.append(("cpu auto choice", f"{chosen}: {why}"))
    return items


def _session_choice() -> list[tuple[str, str]]:
    try:
        dev = devices.resolve_device("auto")
        kernels = devices.resolve_kernels("auto", dev)
    except Exception as e:  # noqa: BLE001 - the report must still print
        return [("session default", f"cannot resolve device 'auto': {e}")]
    outputs = device_outputs_default()
    return [("session default", (f"device={dev}, kernels={kernels}, "
                                 f"block_size={devices.default_block_size(dev)}, "
                                 f"device_outputs={'on' if outputs else 'off'}"))]


def add_env_parser(subparsers) -> None:
    """Register ``qwen-npu env [--json]`` on an argparse subparsers object."""
    p = subparsers.add_parser("env", help="versions, devices and kernel choice, for a bug report")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(handler=run_env)


def run_env(args) -> int:
    report = env_report()
    print(json.dumps(report.as_dict()) if args.json else str(report))
    return 0
