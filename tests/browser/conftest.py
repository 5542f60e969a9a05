"""Fixtures of the browser tests: a throw-away JupyterLab on 127.0.0.1 and headless Chromium.

Every test here is marked ``browser`` (``pytestmark``); skip them with ``-m "not browser"``. Without Chromium,
chromedriver or Selenium they are skipped, except under ``CI=true`` where that is a failure.
Screenshots are written to a temporary folder, or to ``QWEN_NPU_SCREENSHOTS`` when it is set
(``docs/screenshots/make_explorer_screenshots.py`` sets it to ``docs/screenshots``).
"""
from __future__ import annotations

import os
from pathlib import Path

import chromium_kit as chromium
import pytest


@pytest.fixture(scope="session")
def browser_paths():
    browser, driver, problem = chromium.find()
    if problem:
        msg = f"browser tests need headless Chromium and Selenium: {problem} (see .ci/setup-browser)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return browser, driver


@pytest.fixture(scope="session")
def lab_root(tmp_path_factory):
    return tmp_path_factory.mktemp("jupyterlab")


@pytest.fixture(scope="session")
def lab(browser_paths, lab_root):
    from lab_server_kit import LabServer
    notebooks = lab_root / "notebooks"
    notebooks.mkdir()
    server = LabServer(lab_root / "server", notebooks).start()
    try:
        yield server
    finally:
        survivors = server.stop()
        assert survivors == [], f"processes of the JupyterLab server still alive after stopping: {survivors}"


@pytest.fixture(scope="session")
def driver(browser_paths, lab_root):
    browser, driver_path = browser_paths
    drv = chromium.start(browser, driver_path, lab_root / "chromium-profile", lab_root / "chromedriver.log")
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture(scope="session")
def shots_dir(lab_root) -> Path:
    out = os.environ.get("QWEN_NPU_SCREENSHOTS")
    return Path(out).resolve() if out else lab_root / "screenshots"
