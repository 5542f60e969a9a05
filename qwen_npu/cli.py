"""The `qwen-npu` command: demo, bench, inspect, env, build-kernels."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen-npu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a guided tour on the small trained Qwen3 that ships with the package")
    demo.add_argument("--model", help="a Qwen3 checkpoint folder instead of the built-in one")
    demo.set_defaults(handler=_demo)
    for module, adder in (("bench", "add_bench_parser"), ("dump", "add_inspect_parser"),
                          ("env", "add_env_parser"), ("kernel_build", "add_build_parser")):
        try:
            mod = __import__(f"qwen_npu.{module}", fromlist=[adder])
        except ImportError:
            continue
        if hasattr(mod, adder):
            getattr(mod, adder)(sub)
    args = parser.parse_args(argv)
    return args.handler(args) or 0


def _demo(args) -> int:
    from .demo import run_demo
    run_demo(model_dir=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
