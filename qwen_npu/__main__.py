"""``python -m qwen_npu ...``: the ``qwen-npu`` command, for environments whose scripts are not on PATH."""
from .tools.cli import main

raise SystemExit(main())
