"""Execute the notebooks, export them to HTML and photograph their views in headless Chromium.

    python docs/screenshots/make_screenshots.py              # execute, export, screenshot
    python docs/screenshots/make_screenshots.py --no-execute # use the outputs stored in the notebooks
    python docs/screenshots/make_screenshots.py 03_slot_collisions   # only these notebooks

1. Every ``notebooks/0*.ipynb`` is executed in place in a fresh ``python3`` kernel (working
   directory ``notebooks/``), without per-cell timings or widget state, so diffs stay clean.
2. Each notebook is exported whole to ``build/notebooks-html/<name>.html`` (nbconvert, lab
   template) for reading in a browser.
3. For every entry of ``SHOTS`` the cell whose last source line matches is exported on its own
   (input and outputs) and Chromium takes a screenshot, cropped to the content, saved as
   ``docs/screenshots/<shot>.png``.

Needs nbclient, nbconvert, Pillow and Chromium (Debian: ``apt-get install chromium``). The
pages are opened as local files; external scripts (MathJax, require.js) are removed first, so
no network is used.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
OUT = Path(__file__).resolve().parent
HTML_DIR = ROOT / "build" / "notebooks-html"
WIDTH = 1100

# (png name, notebook, last source line of the code cell to show)
SHOTS = [
    ("session", "02_paged_kv_cache", "sess.sample(step)\nsess"),
    ("step_chunked_prefill", "02_paged_kv_cache", "step = sess.prefill()\nstep"),
    ("step_decode_new_block", "02_paged_kv_cache", "    step = sess.step()\nstep"),
    ("request_prefix_cache", "05_prefix_cache", "b"),
    ("session_prefix_cache", "05_prefix_cache", 'prompt tokens from the cache")\nsess'),
    ("blocks", "05_prefix_cache", "sess.blocks"),
    ("audit", "05_prefix_cache", "sess.audit(d)"),
    ("step_slot_collision", "03_slot_collisions", "live.history[1]"),
    ("kv_slot_collided", "03_slot_collisions", "live.kv.slot(report.first.slot)"),
    ("check_report", "03_slot_collisions", "live.check()"),
    ("slot_report", "03_slot_collisions", "positions=step.positions, active_rows=step.num_active)"),
    ("rows_per_step_fixed_batch", "03_slot_collisions", "plot_rows_per_step(live)"),
    ("device_logits", "01_quickstart", "step.logits"),
    ("topk", "04_device_resident_logits_and_sampling", "tk"),
    ("step_timings", "06_profiling", "plot_step_timings(sess)"),
]


def execute(path: Path) -> None:
    import nbclient
    import nbformat
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False, store_widget_state=False,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata.pop("widgets", None)                  # live widget state: meaningless once the kernel is gone
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


def to_html(nb) -> str:
    from nbconvert import HTMLExporter
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return re.sub(r'<script[^>]*src="https?://[^"]*"[^>]*>\s*</script>', "", body)


def find_cell(nb, key: str):
    """The code cell whose source ends with ``key`` (the last match)."""
    found = [c for c in nb.cells if c.cell_type == "code" and c.source.rstrip().endswith(key)]
    if not found:
        raise SystemExit(f"no code cell ending with {key!r}")
    return found[-1]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    raise SystemExit("Chromium not found: apt-get install chromium")


def screenshot(html_file: Path, png: Path, height: int = 2400) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
                        f"--screenshot={png}", f"--window-size={WIDTH},{height}", html_file.as_uri()],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    crop(png)


def crop(png: Path, margin: int = 12) -> None:
    """Cut the white border away and save as an 8-bit palette PNG (small files)."""
    from PIL import Image, ImageChops
    im = Image.open(png).convert("RGB")
    bbox = ImageChops.difference(im, Image.new("RGB", im.size, (255, 255, 255))).getbbox()
    if bbox:
        left, top, right, bottom = bbox
        im = im.crop((max(0, left - margin), max(0, top - margin), min(im.width, right + margin),
                      min(im.height, bottom + margin)))
    im.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)


def main(argv=None) -> int:
    import nbformat
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="use the outputs stored in the notebooks")
    parser.add_argument("names", nargs="*", help="notebook names (e.g. 03_slot_collisions); default: all")
    args = parser.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("0*.ipynb"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names]
    HTML_DIR.mkdir(parents=True, exist_ok=True)
    books = {}
    for path in paths:
        if not args.no_execute:
            print(f"executing {path.name}", flush=True)
            execute(path)
        nb = nbformat.read(path, as_version=4)
        books[path.stem] = nb
        (HTML_DIR / f"{path.stem}.html").write_text(to_html(nb))
    with tempfile.TemporaryDirectory() as tmp:
        for name, book, key in SHOTS:
            if book not in books:
                continue
            nb = nbformat.v4.new_notebook(metadata=books[book].metadata)
            nb.cells = [find_cell(books[book], key)]
            page = Path(tmp) / f"{name}.html"
            page.write_text(to_html(nb))
            png = OUT / f"{name}.png"
            screenshot(page, png)
            print(f"{png.relative_to(ROOT)}: {png.stat().st_size // 1024} KiB", flush=True)
    print(f"whole notebooks as HTML: {HTML_DIR.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
