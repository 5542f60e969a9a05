"""The `qwen-npu` command: demo, bench, inspect, env, build-kernels."""
from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module of qwen_npu, the function that adds its parser)
SUBCOMMANDS = (("bench", "bench", "add_bench_parser"), ("inspect", "dump", "add_inspect_parser"),
               ("env", "env", "add_env_parser"), ("build-kernels", "kernel_build", "add_build_parser"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen-npu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a guided tour on the small trained Qwen3 that ships with the package")
    demo.add_argument("--model", help="a Qwen3 checkpoint folder or Hugging Face repo id instead of the built-in one")
    demo.set_defaults(handler=_demo)
    for command, module, adder in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"qwen_npu.{module}")
        except ImportError as e:            # the other subcommands still work; this one says why not
            why = f"qwen_npu.{module} failed to import: {type(e).__name__}: {e}"
            broken = sub.add_parser(command, help=f"UNAVAILABLE ({why})")
            broken.set_defaults(handler=lambda args, why=why: _unavailable(why))
            continue
        getattr(mod, adder)(sub)
    args = parser.parse_args(argv)
    return args.handler(args) or 0


def _unavailable(why: str) -> int:
    print(f"qwen-npu: {why}", file=sys.stderr)
    return 1


def _demo(args) -> int:
    from .demo import run_demo
    run_demo(model_dir=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
