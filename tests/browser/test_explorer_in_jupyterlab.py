"""The explorer in JupyterLab, driven through headless Chromium like a person would use it.

A notebook that builds a tiny Session and calls ``explore(sess)`` is run with Run > Run All Cells;
then the test types, presses and slides in the page and, after every action, checks what the page
shows. Screenshots of the explorer are taken along the way (see conftest).
"""
from __future__ import annotations

import os

import nbformat
import pytest

if os.environ.get("CI", "").lower() != "true":         # under CI a missing Selenium is an error
    pytest.importorskip("selenium", reason="the browser tests need Selenium: pip install -e '.[dev]'")

from lab_page_kit import KERNEL_TIMEOUT_S, LabPage, wait_until
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

pytestmark = pytest.mark.browser

SETUP = """\
import time
from qwen_npu import Session
from qwen_npu.inspect import explore
from qwen_npu.testing import make_tiny_qwen3

path = make_tiny_qwen3("tiny-qwen3")
sess = Session.from_pretrained(path, kernels="reference", max_batch=16, chunk_size=64, num_blocks=96)"""
SHOW = "explorer = explore(sess)\nexplorer"
NOTEBOOK = "explorer.ipynb"
SLOW_S = 4           # seconds each step sleeps in the long-step part


def write_notebook(folder) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(SHOW)]
    nbformat.write(nb, folder / NOTEBOOK)


@pytest.fixture(scope="module")
def page(lab, driver, shots_dir):
    write_notebook(lab.notebooks)
    p = LabPage(driver, shots_dir)
    p.open(lab.lab_url(NOTEBOOK), lambda: lab.kernel_connected(NOTEBOOK))
    p.run_all()
    wait_until("the explorer to appear in the notebook",
               lambda: driver.find_elements(By.CSS_SELECTOR, ".qwen-npu-explorer .qwen-npu-message"),
               KERNEL_TIMEOUT_S, poll=0.5,
               describe=lambda: f"errors: {p.error_outputs()}\nkernel: {p.kernel_status()}")
    return p


def test_explorer_end_to_end(page):
    p = page
    p.wait_text("message", "ready: add a request")
    assert "no requests" in p.text("session") and "no step has run yet" in p.text("step")
    p.screenshot("ready")

    p.type_into(".qwen-npu-prompt input", "Paged attention in one sentence:")
    msg = p.press("add request", "added request 0 (")
    n_prompt = int(msg.split("(")[1].split()[0])
    assert "REQUESTS: 1 WAITING" in p.text("session") and f"r0 waiting {n_prompt} 0" in p.text("session")
    assert p.part("prompt").find_element(By.CSS_SELECTOR, "input").get_attribute("value") == ""
    p.screenshot("add_request")

    # an action the session refuses: the reason is shown where it can be seen, nothing is raised
    # and every control works again
    p.press("decode step", "decode step failed: InvalidRequestError", "nothing to decode: 1 waiting")
    assert p.in_viewport("message"), "the error line is not visible without scrolling"
    assert p.disabled_controls() == [] and p.error_outputs() == []
    p.screenshot("error")

    p.part("auto-sample").find_element(By.CSS_SELECTOR, "input").click()      # sample by hand
    msg = p.press("prefill", f"prefill: step 0 ran 1 row(s), {n_prompt} token(s)")
    assert "sampled" not in msg
    p.wait_text("step", "Step 0: prefill", f"0..{n_prompt - 1}")
    p.screenshot("prefill")

    p.press("sample", "sampled 1 token(s) of step 0")
    p.wait_text("topk", "Top-5 next tokens")
    p.screenshot("sample")

    p.part("auto-sample").find_element(By.CSS_SELECTOR, "input").click()
    p.press("decode step", "decode step: step 1 ran 1 row(s), 1 token(s), sampled [")
    p.wait_text("step", "Step 1: decode")
    p.screenshot("decode_step")

    handle = p.part("history").find_element(By.CSS_SELECTOR, ".noUi-handle")
    handle.click()
    handle.send_keys(Keys.HOME)
    p.wait_text("step", "Step 0: prefill")
    p.screenshot("history")

    p.type_into(".qwen-npu-slot-number input", "2", enter=True)
    p.wait_text("slot", "Slot 2", "position 2", "r0")
    p.screenshot("slot")

    # a batch of 16: fifteen more requests, steps until one decode step runs all sixteen rows
    for i in range(1, 16):
        p.type_into(".qwen-npu-prompt input", f"request {i}: how do paged caches work?")
        p.press("add request", f"added request {i} (")
    for _ in range(6):
        if "ran 16 row(s)" in p.press("step", "step: step "):
            break
    assert "ran 16 row(s)" in p.text("message"), p.describe()
    p.wait_text("step", ": decode", "r15")
    p.screenshot("batch16")
    assert p.overflow() == [], "the explorer does not fit a 1280 px wide window:\n" + "\n".join(p.overflow())
    assert p.low_contrast() == [], "\n".join(p.low_contrast())

    # the dark theme: every text still readable, the layout unchanged
    p.submenu("Settings", "Theme", "apputils:change-theme", "JupyterLab Dark")
    wait_until("the dark theme", lambda: p.d.execute_script("return document.body.dataset.jpThemeLight") == "false")
    p.screenshot("dark")
    assert p.low_contrast() == [], "\n".join(p.low_contrast())
    assert p.overflow() == [], "\n".join(p.overflow())
    p.submenu("Settings", "Theme", "apputils:change-theme", "JupyterLab Light")
    wait_until("the light theme", lambda: p.d.execute_script("return document.body.dataset.jpThemeLight") == "true")

    # a long step (made to sleep through the public intervention hook, from a code cell typed into
    # the page): the page shows a progress indicator, no control can start a second action until
    # it is over, and then every control works again
    p.type_cell_below_and_run(f'slow = sess.intervene("embed", lambda x: time.sleep({SLOW_S}), '
                              'requests=[0]).__enter__()')
    p.button("step").click()
    wait_until("the progress indicator", lambda: "running step" in p.text("busy")
               and p.part("busy").find_elements(By.TAG_NAME, "progress"), describe=p.describe)
    assert set(p.disabled_controls()) >= {"add request", "prefill", "decode step", "step", "sample", "refresh"}
    p.screenshot("busy")
    p.wait_idle()
    p.wait_text("message", "step: step ", "ran 16 row(s)")
    p.type_cell_below_and_run("slow.__exit__(None, None, None)")
    p.press("decode step", "decode step: step ", "ran 16 row(s)")

    # nothing raised anywhere: no error in any cell, nothing in JupyterLab's log console (where
    # output of widget callbacks that escaped would go)
    assert p.error_outputs() == []
    assert p.log_console() == "No log messages."
