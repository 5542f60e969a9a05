"""The `qwen-npu` command: demo, bench, inspect, env, build-kernels."""
from __future__ import annotations

import argparse
import sys

def _bench_parser():
    from .bench import add_bench_parser
    return add_bench_parser


def _inspect_parser():
    from ..dump import add_inspect_parser
    return add_inspect_parser


def _env_parser():
    from .env import add_env_parser
    return add_env_parser


def _build_parser():
    from .kernel_build import add_build_parser
    return add_build_parser


# (subcommand, its module, the import of the function that adds its parser): imported when the
# command line is parsed, so a subcommand whose module cannot import says why and the rest work
SUBCOMMANDS = (("bench", "qwen_npu.tools.bench", _bench_parser),
               ("inspect", "qwen_npu.dump", _inspect_parser),
               ("env", "qwen_npu.tools.env", _env_parser),
               ("build-kernels", "qwen_npu.tools.kernel_build", _build_parser))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen-npu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a guided tour on the small trained Qwen3 that ships with the package")
    demo.add_argument("--model", help="a Qwen3 checkpoint folder or Hugging Face repo id instead of the built-in one")
    demo.set_defaults(handler=_demo)
    for command, module, parser_adder in SUBCOMMANDS:
        try:
            add_parser = parser_adder()
        except ImportError as e:            # the other subcommands still work; this one says why not
            why = f"{module} failed to import: {type(e).__name__}: {e}"
            broken = sub.add_parser(command, help=f"UNAVAILABLE ({why})")
            broken.set_defaults(handler=lambda args, why=why: _unavailable(why))
            continue
        add_parser(sub)
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
