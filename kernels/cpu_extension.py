"""The cpu kernel set's C++ extension: its sources, flags, and whether and how it is built here.

The C++ sources (``csrc/``) are compiled once per machine by ``kernels/build.py`` (a C++ compiler,
the Python headers and ninja are needed; about a minute or two), when the first Session that uses the set
is made, or ahead of time with ``qwen-npu build-kernels`` / ``qwen_npu.build_kernels()``. The
build is cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), in a
folder named after a hash of the sources, flags, torch and Python versions, so an edited source is
rebuilt and never mixed with an old build. ``availability()`` says whether this machine can build
the set; ``kernels="auto"`` picks it wherever it can (``kernels/cpu_choice.py``).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

from . import build

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("module.cpp", "products.cpp", "linear.cpp", "linear_packed.cpp", "linear_bf16.cpp", "linear_amx.cpp",
           "attention.cpp", "attention_bf16.cpp", "attention_decode.cpp", "attention_decode_bf16.cpp",
           "attention_decode_amx.cpp", "attention_amx.cpp", "elementwise_avx512.cpp", "norm.cpp", "activation.cpp",
           "greedy.cpp", "peak.cpp", "layer.cpp")
HEADERS = ("vec.h", "vec512.h", "elementwise.h", "attention.h", "amx.h", "greedy.h", "products.h", "ops.h")
# -fopenmp: at::parallel_for is a header template; without it the kernels would run on one thread
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(can this machine build and run the set?, the reason in words). Compiles nothing; a build
    that was tried and failed is reported by ``build.build_status(extension())``."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return False, f"the CPU's vector capability is {cap}; these kernels need AVX2 + FMA"
    cxx = os.environ.get("CXX", "c++")              # what torch's builder runs
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler: {cxx!r} (from {'CXX' if 'CXX' in os.environ else 'the default'}) is not on PATH"
    if build.ninja_path() is None:
        return False, "ninja is not installed (pip install ninja) to build the kernels"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return False, f"the Python headers are missing ({header}; install python3-dev or the like)"
    return True, f"{cap} CPU, C++ compiler {shutil.which(cxx)}"


def available() -> bool:
    return availability()[0]


@functools.lru_cache(maxsize=1)
def extension() -> build.Extension:
    """The extension to build: its name carries a hash of everything that changes the binary."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    digest.update(f"{torch.__version__} {sys.version}".encode())
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    return build.Extension(name=f"qwen_npu_cpu_{digest.hexdigest()[:12]}",
                           sources=tuple(str(CSRC / n) for n in SOURCES), cflags=CFLAGS,
                           ldflags=("-fopenmp",), include_paths=(str(CSRC),))


def ensure_built(*, log=None, progress: bool = True):
    """Build (or load) the C++ extension now; ``build.KernelBuildError`` says why it cannot."""
    ok, reason = availability()
    if not ok:
        raise build.KernelBuildError(f"the cpu kernel set cannot be built here: {reason}")
    return build.ensure_built(extension(), log=log, progress=progress)


@functools.lru_cache(maxsize=1)
def ops():
    """The compiled extension (a Session builds it when it is made; this loads it if not)."""
    return ensure_built()
