"""What the tests do with a JupyterLab page through Selenium: open a notebook, use the menus,
find the explorer and its parts, press its buttons, and wait (bounded) for what the page shows."""
from __future__ import annotations

import time
from pathlib import Path

from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

OPEN_TIMEOUT_S = 120       # JupyterLab's assets load and the notebook opens
KERNEL_TIMEOUT_S = 300     # the notebook's cells run (kernel start, torch import, a tiny checkpoint)
ACTION_TIMEOUT_S = 60      # one button's round trip through the kernel

CONTRAST_JS = r"""
const minimum = arguments[0];
function rgba(s) { const m = s.match(/[\d.]+/g) || ['0', '0', '0', '0'];
                   return m.map(Number).concat(m.length < 4 ? [1] : []); }
function lum([r, g, b]) { return [r, g, b].map(v => { v /= 255; return v <= 0.03928 ? v / 12.92
                          : Math.pow((v + 0.055) / 1.055, 2.4); }).reduce((a, v, i) => a + v * [0.2126, 0.7152, 0.0722][i], 0); }
function background(e) {
  for (; e; e = e.parentElement) {
    const cs = getComputedStyle(e);
    if (cs.backgroundImage !== 'none') return null;           // stripes or gradients: not judged
    const c = rgba(cs.backgroundColor);
    if (c[3] > 0.5) return c;
  }
  return [255, 255, 255, 1];
}
const out = [];
const root = document.querySelector('.qwen-npu-explorer');
for (const e of root.querySelectorAll('*')) {
  const own = Array.from(e.childNodes).filter(n => n.nodeType === 3 && n.textContent.trim()).map(n => n.textContent.trim());
  if (!own.length || !e.getClientRects().length) continue;
  const cs = getComputedStyle(e);
  if (cs.visibility === 'hidden' || parseFloat(cs.opacity) < 0.5) continue;
  const bg = background(e);
  if (!bg) continue;
  const fg = rgba(cs.color);
  const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
  const ratio = (a + 0.05) / (b + 0.05);
  if (ratio < minimum) out.push(`${JSON.stringify(own.join(' ').slice(0, 40))}: ${cs.color} on rgb(${bg.slice(0, 3)}) ratio ${ratio.toFixed(2)}`);
}
return out;
"""


def wait_until(what: str, fn, timeout: float = ACTION_TIMEOUT_S, poll: float = 0.1, describe=None):
    """Poll ``fn`` until it returns something true; on timeout fail saying what was awaited and
    what the page showed instead."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = fn()
            if last:
                return last
        except (StaleElementReferenceException, WebDriverException) as e:
            last = e
        if time.monotonic() > deadline:
            seen = describe() if describe else last
            raise AssertionError(f"waited {timeout:.0f} s for {what}; the page shows instead:\n{seen}")
        time.sleep(poll)


class LabPage:
    def __init__(self, driver, shots: Path):
        self.d = driver
        self.shots = shots
        shots.mkdir(parents=True, exist_ok=True)

    # ---- JupyterLab ----------------------------------------------------------------------------
    def open(self, url: str, kernel_ready) -> None:
        """Open a notebook and wait until its kernel is connected (``kernel_ready()`` is true)."""
        self.d.get(url)
        wait_until("the notebook to open", lambda: self.d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"),
                   OPEN_TIMEOUT_S, poll=0.5)
        wait_until("the notebook's kernel to start and connect", kernel_ready, OPEN_TIMEOUT_S, poll=0.5,
                   describe=self.kernel_status)
        wait_until("the page to show the kernel idle", lambda: self.kernel_status() == "idle", OPEN_TIMEOUT_S,
                   poll=0.2, describe=self.kernel_status)

    def kernel_status(self) -> str:
        return self.d.execute_script(
            "const e = document.querySelector('.jp-Notebook-ExecutionIndicator');"
            "return e ? (e.getAttribute('data-status') || e.title || '') : '';") or ""

    def menu(self, top: str, command: str) -> None:
        """Click menu ``top`` in the menu bar, then its item that runs ``command``."""
        bar = self.d.find_element(By.XPATH, f"//div[contains(@class,'lm-MenuBar-itemLabel') and text()='{top}']")
        bar.click()
        item = wait_until(f"menu item {command}", lambda: [e for e in self.d.find_elements(
            By.CSS_SELECTOR, f".lm-Menu-item[data-command='{command}']") if e.is_displayed()], 10)
        item[0].click()

    def submenu(self, top: str, sub: str, command: str, label: str) -> None:
        """Menu ``top`` > submenu ``sub`` > the item running ``command`` whose label is ``label``."""
        self.d.find_element(By.XPATH, f"//div[contains(@class,'lm-MenuBar-itemLabel') and text()='{top}']").click()
        opener = wait_until(f"submenu {sub}", lambda: [e for e in self.d.find_elements(
            By.XPATH, f"//li[contains(@class,'lm-Menu-item')][.//div[text()='{sub}']]") if e.is_displayed()], 10)
        ActionChains(self.d).move_to_element(opener[0]).click(opener[0]).perform()
        item = wait_until(f"menu item {label}", lambda: [e for e in self.d.find_elements(
            By.XPATH, f"//li[@data-command='{command}'][.//div[text()='{label}']]") if e.is_displayed()], 10)
        item[0].click()

    def run_all(self) -> None:
        """Run > Run All Cells, then wait until the first cell is running or has run."""
        self.menu("Run", "runmenu:run-all")
        wait_until("the first cell to start running after Run All Cells", lambda: self.d.find_element(
            By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell .jp-InputPrompt").text.strip() not in ("", "[ ]:"), 30,
            describe=self.kernel_status)

    def cell_outputs(self, index: int):
        cells = self.d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")
        return cells[index].find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")

    def error_outputs(self) -> list[str]:
        """Text of every error or stderr output anywhere in the notebook."""
        sel = (".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'],"
               ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error'],"
               ".jp-OutputArea-output.jp-mod-error")
        return [e.text for e in self.d.find_elements(By.CSS_SELECTOR, sel)]

    def type_cell_below_and_run(self, code: str) -> None:
        """Add a code cell at the end of the notebook, type ``code`` into it, run it (Shift+Enter)
        and wait until it has run without an error."""
        cells = self.d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")
        index = len(cells)
        cells[-1].find_element(By.CSS_SELECTOR, ".jp-InputPrompt").click()   # select it (command mode)
        ActionChains(self.d).send_keys(Keys.ESCAPE).send_keys("b").perform()  # new cell below
        editor = wait_until("a new cell", lambda: self.d.find_elements(
            By.CSS_SELECTOR, ".jp-Notebook .jp-Cell.jp-mod-active .cm-content"), 10)[0]
        editor.click()
        editor.send_keys(code)
        ActionChains(self.d).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()

        def ran():
            assert self.error_outputs() == [], self.error_outputs()
            cell = self.d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")[index]
            return cell.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text.strip()[1:-2].isdigit()
        wait_until(f"the typed cell to run: {code}", ran, describe=self.kernel_status)

    def log_console(self) -> str:
        """View > Show Log Console, and the text it shows."""
        self.menu("View", "logconsole:open")
        panel = wait_until("the log console", lambda: self.d.find_elements(By.CSS_SELECTOR, ".jp-LogConsolePanel"), 10)
        return panel[0].text.strip()

    # ---- the explorer --------------------------------------------------------------------------
    def explorer(self):
        return self.d.find_element(By.CSS_SELECTOR, ".qwen-npu-explorer")

    def part(self, name: str):
        return self.d.find_element(By.CSS_SELECTOR, f".qwen-npu-explorer .qwen-npu-{name}")

    def text(self, name: str) -> str:
        return self.part(name).text

    def describe(self) -> str:
        try:
            return "\n".join(f"[{n}] {self.text(n)[:600]}" for n in ("message", "busy", "session", "step", "slot"))
        except WebDriverException as e:
            return f"(no explorer: {e.msg})"

    def button(self, label: str):
        return self.explorer().find_element(By.XPATH, f".//button[normalize-space()='{label}']")

    def controls(self):
        """Every button and input of the explorer."""
        return self.explorer().find_elements(By.CSS_SELECTOR, "button, input")

    def wait_text(self, name: str, *needles: str, timeout: float = ACTION_TIMEOUT_S) -> str:
        return wait_until(f"{' and '.join(map(repr, needles))} in the explorer's {name}",
                          lambda: all(n in self.text(name) for n in needles) and self.text(name),
                          timeout, describe=self.describe)

    def press(self, label: str, *expect: str) -> str:
        """Press a button and wait until the message line shows every one of ``expect``."""
        before = self.text("message")
        self.button(label).click()
        msg = wait_until(f"the message line to change after pressing {label!r}",
                         lambda: self.text("message") != before and all(e in self.text("message") for e in expect)
                         and self.text("message"), describe=self.describe)
        self.wait_idle()
        return msg

    def wait_idle(self) -> None:
        """Until no action is running: progress indicator gone and every control enabled again."""
        wait_until("the explorer to finish its action",
                   lambda: not self.part("busy").text.strip() and self.disabled_controls() == [],
                   describe=lambda: f"busy={self.part('busy').text!r} disabled={self.disabled_controls()}")

    def disabled_controls(self) -> list[str]:
        """Labels (or placeholder, or input type) of the explorer's disabled buttons and inputs."""
        out = []
        for e in self.controls():
            if not e.is_enabled():
                out.append(e.text or e.get_attribute("placeholder") or e.get_attribute("type"))
        return out

    def type_into(self, css: str, text: str, *, enter: bool = False) -> None:
        box = self.explorer().find_element(By.CSS_SELECTOR, css)
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(text + (Keys.ENTER if enter else ""))

    def screenshot(self, name: str) -> Path:
        """The explorer, whole: the window grows as tall as it needs for the picture (its width
        stays), then returns to its size."""
        el = self.explorer()
        size = self.d.get_window_size()
        tall = int(self.d.execute_script("return arguments[0].getBoundingClientRect().height;", el)) + 320
        path = self.shots / f"explorer_{name}.png"
        try:
            if tall > size["height"]:
                self.d.set_window_size(size["width"], tall)
            self.d.execute_script("arguments[0].scrollIntoView({block: 'start'});", el)
            wait_until("the explorer to be in view", lambda: self.d.execute_script(
                "const r = arguments[0].getBoundingClientRect(); return r.top >= 0 && r.bottom <= innerHeight;",
                el), 10)
            el.screenshot(str(path))
        finally:
            self.d.set_window_size(size["width"], size["height"])
        return path

    def low_contrast(self, minimum: float = 3.0) -> list[str]:
        """Text in the explorer whose colour against the background behind it has a contrast
        ratio (WCAG) below ``minimum``: text a reader of this theme cannot make out."""
        return self.d.execute_script(CONTRAST_JS, minimum)

    # ---- geometry ------------------------------------------------------------------------------
    def overflow(self) -> list[str]:
        """Elements that scroll or clip sideways because their content is wider than they are:
        the explorer, everything in it, and its ancestors up to the notebook's scroller."""
        return self.d.execute_script("""
            const out = [];
            const root = document.querySelector('.qwen-npu-explorer');
            const nb = root.closest('.jp-WindowedPanel-outer') || root.closest('.jp-Notebook');
            const chain = [];
            for (let e = root.parentElement; e && e !== nb; e = e.parentElement) chain.push(e);
            for (const e of [nb, ...chain, root, ...root.querySelectorAll('*')]) {
                if (!e || e.clientWidth === 0) continue;
                if (getComputedStyle(e).overflowX === 'visible') continue;   // overflow shows in a parent
                if (e.scrollWidth > e.clientWidth + 1)
                    out.push(`${e.tagName}.${e.className} scrollWidth ${e.scrollWidth} > ${e.clientWidth}`);
            }
            if (root.getBoundingClientRect().right > nb.getBoundingClientRect().right)
                out.push('the explorer ends right of the notebook');
            return out;""")

    def in_viewport(self, name: str) -> bool:
        """Whether part ``name`` is wholly inside the window and the notebook's visible area."""
        return self.d.execute_script("""
            const e = document.querySelector('.qwen-npu-explorer .qwen-npu-' + arguments[0]);
            const r = e.getBoundingClientRect();
            const nb = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer')
                       || document.querySelector('.jp-NotebookPanel .jp-Notebook');
            const v = nb.getBoundingClientRect();
            return r.height > 0 && r.top >= Math.max(0, v.top) && r.bottom <= Math.min(window.innerHeight, v.bottom)
                   && r.left >= 0 && r.right <= window.innerWidth;""", name)
