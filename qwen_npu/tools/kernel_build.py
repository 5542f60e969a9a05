"""``qwen_npu.build_kernels()`` / ``qwen-npu build-kernels``: build the CPU kernels ahead of time.

The first Session that uses the cpu kernel set builds it anyway (about a minute or two, said on screen);
building ahead of time moves that minute into an image build, a CI setup step or a moment of
your choosing. The build is cached per machine (see ``kernels/build.py``), so a second call only
loads it.
"""
from __future__ import annotations

import time

from ..errors import DeviceError


def build_kernels(*, progress: bool = True, log=None) -> str:
    """Build (or load) the cpu kernel set now; returns where it is cached. ``DeviceError`` when
    this machine cannot build it, with the reason (the compiler's first error for a failed build)."""
    from ..kernels import build, cpu
    try:
        cpu.ensure_built(log=log, progress=progress)
    except build.KernelBuildError as e:
        raise DeviceError(str(e)) from e
    return str(cpu.extension().library)


def add_build_parser(subparsers) -> None:
    """Register ``qwen-npu build-kernels`` on an argparse subparsers object."""
    p = subparsers.add_parser("build-kernels", help="build the C++ CPU kernels now (for images and CI)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs)")
    p.set_defaults(handler=run_build)


def run_build(args) -> int:
    from ..device import cpu_kernels_choice
    t0 = time.perf_counter()
    try:
        where = build_kernels(progress=not args.no_progress, log=print)
    except DeviceError as e:
        print(f"qwen-npu build-kernels: {e}")
        return 1
    print(f"the CPU kernels are ready ({time.perf_counter() - t0:.1f} s): {where}")
    chosen, why = cpu_kernels_choice()
    print(f"kernels='auto' on this CPU runs the {chosen} set: {why}")
    return 0
