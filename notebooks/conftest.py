"""Run the notebooks of this folder under nbval whenever pytest collects it, ``--nbval`` or not.

Each notebook is executed in a fresh kernel and every stored output is compared with the new one,
after ``sanitize.cfg`` masks what genuinely varies (measured durations and rates). Without nbval
installed the notebooks are simply not collected.
"""
from pathlib import Path

SANITIZE = Path(__file__).with_name("sanitize.cfg")


def pytest_collect_file(file_path, parent):
    opt = parent.config.option
    if file_path.suffix != ".ipynb" or not hasattr(opt, "nbval_sanitize_with"):
        return None                                   # not a notebook, or nbval is not installed
    if opt.nbval_sanitize_with is None:
        opt.nbval_sanitize_with = str(SANITIZE)
    if opt.nbval or opt.nbval_lax:
        return None                                   # nbval collects it itself
    from nbval.plugin import IPyNbFile
    return IPyNbFile.from_parent(parent, path=file_path)
