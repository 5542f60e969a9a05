"""Headless Chromium under Selenium, from the system's packages (Debian: ``chromium`` and
``chromium-driver``); nothing is downloaded. ``find()`` says what is missing, ``start()`` opens
a browser with its own profile folder and a fixed window size."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

WIDTH, HEIGHT = 1280, 1000
PAGE_LOAD_TIMEOUT_S = 60
SCRIPT_TIMEOUT_S = 30


def _which(env: str, *names: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env] if Path(os.environ[env]).exists() else None
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def find() -> tuple[str | None, str | None, str]:
    """(browser, driver, problem): problem is "" when both were found and Selenium imports."""
    browser = _which("QWEN_NPU_CHROMIUM", "chromium", "chromium-browser")
    driver = _which("QWEN_NPU_CHROMEDRIVER", "chromedriver")
    missing = [what for what, p in (("chromium", browser), ("chromedriver (Debian: chromium-driver)", driver))
               if p is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[dev]')")
    return browser, driver, ("missing " + ", ".join(missing)) if missing else ""


def version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def start(browser: str, driver: str, profile: Path, log: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")           # never let Selenium fetch a driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", f"--window-size={WIDTH},{HEIGHT}", "--force-device-scale-factor=1",
                "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-features=Translate,MediaRouter",
                "--proxy-server=direct://", "--proxy-bypass-list=*",
                f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    service = Service(executable_path=driver, log_output=str(log))
    drv = webdriver.Chrome(service=service, options=opts)
    drv.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
    drv.set_script_timeout(SCRIPT_TIMEOUT_S)
    return drv
