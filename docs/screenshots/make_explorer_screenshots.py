"""Photograph the explorer in JupyterLab: runs the browser test, which saves a screenshot after
each action, with its screenshots going to this folder (``explorer_*.png``).

    python docs/screenshots/make_explorer_screenshots.py

Needs what the browser test needs: ``pip install -e '.[dev,notebook]'`` and Chromium with its
driver (Debian: ``apt-get install chromium chromium-driver``; see ``.ci/setup-browser``). The
window is 1280 px wide; each picture is the explorer alone, in the light theme except
``explorer_dark.png``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent
ROOT = OUT.parents[1]


def main() -> int:
    env = dict(os.environ, QWEN_NPU_SCREENSHOTS=str(OUT), CI="true")   # CI: a missing browser fails
    rc = subprocess.call([sys.executable, "-m", "pytest", "tests/browser", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env)
    for png in sorted(OUT.glob("explorer_*.png")):
        print(f"{png.relative_to(ROOT)}  {png.stat().st_size // 1024} KiB")
    return rc


if __name__ == "__main__":
    sys.exit(main())
