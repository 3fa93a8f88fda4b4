"""A chapter's widget in a real browser (issue 10): JupyterLab runs headless on localhost, headless
Chromium (driven by Playwright) opens chapter 07, runs it (Run > Run All Cells), and checks that the
ipywidgets slider renders and that moving it (keyboard, then mouse) re-runs the kernel callback and
redraws the plot.

Only the cells the widget needs are run: the chapter is copied into a temporary root with the code cells
the widget cell depends on (found from the names each cell binds and reads), so the cells that only time
or check something else are left out; what is left is mostly the chapter's one rollout (chapter 05's
widget would need both of its rollouts: about twice as long).

What it needs from outside Python: a Chromium binary ($DPPO_CHROMIUM, else `chromium` on PATH;
scripts/setup.sh installs Debian's). Without one the test is skipped with the fix, except when $CI is
set: there a missing browser fails it.

Screenshots go to the test's tmp_path and, when $DPPO_BROWSER_SCREENSHOT_DIR is set, there too.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import symtable
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAPTER = REPO_ROOT / "notebooks" / "07_packing.ipynb"
SLIDER_LABEL = "window"  # the description of the slider that is moved (an IntSlider, step 1)

CHROMIUM_ENV = "DPPO_CHROMIUM"
SCREENSHOT_ENV = "DPPO_BROWSER_SCREENSHOT_DIR"
CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMIUM_FIX = (f"install chromium (Debian/Ubuntu: `sudo apt-get install chromium`; `bash scripts/setup.sh` "
                f"does it when it can), or set {CHROMIUM_ENV}=/path/to/chromium")
# Headless on a machine with no network but loopback: no sandbox (root, containers), no GPU, and none of
# Chromium's own background connections (they fail noisily on a closed network).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Generous limits: on a loaded 2-core machine JupyterLab alone has taken 3 minutes to load. Each is only
# an upper bound; every wait ends as soon as its condition holds.
SERVER_START_S = 300
LAB_LOAD_MS = 600_000
RUN_CELLS_MS = 1_200_000  # the chapter's rollout (32 prompts x 8 samples) is most of it
RESPONSE_MS = 300_000
SHUTDOWN_S = 60
POLL_MS = 500  # how often in-page conditions are re-checked (light on a busy CPU)

OUTPUT_IMG = ".widget-interact .widget-output img"
TRACEBACK_JS = """() => [...document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.textContent).find(t => t.includes('Traceback')) || null"""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """Skip for a missing prerequisite, but fail in CI, where the browser test must really run."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so the browser test may not be skipped)", pytrace=False)
    pytest.skip(reason)


def find_chromium() -> str | None:
    """$DPPO_CHROMIUM if set (it must then be an executable file), else the first Chromium on PATH."""
    env = os.environ.get(CHROMIUM_ENV)
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            pytest.fail(f"{CHROMIUM_ENV}={env} is not an executable file; {CHROMIUM_FIX}", pytrace=False)
        return env
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


# ----------------------------------------------------------------------------------------------------
# Which cells the widget cell needs


def cell_names(source: str) -> tuple[set[str], set[str]] | None:
    """(names the cell binds at module level, global names it reads), or None if it cannot be parsed.

    IPython syntax (magics, `!cmd`) is turned into Python first. Names read inside functions, lambdas
    and comprehensions count when they resolve to globals: a function defined here and called later
    still needs them."""
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        top = symtable.symtable(TransformerManager().transform_cell(source), "<cell>", "exec")
    except SyntaxError:
        return None
    binds = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    reads = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    stack = list(top.get_children())
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        for s in table.get_symbols():
            if s.is_global():
                if s.is_referenced():
                    reads.add(s.get_name())
                if s.is_assigned():
                    binds.add(s.get_name())
    return binds, reads


def needed_cells(sources: list[str], target: int) -> list[int]:
    """Indices of the code cells to run, in order, for the cell ``sources[target]`` to run as it would
    after all the cells above it: the target, and for every name it reads the last cell above it that
    binds that name, recursively. A cell that cannot be parsed makes every cell above it needed.

    Limitation: a cell that changes an object in place (``x.append(...)``) without rebinding its name is
    not seen as a dependency; the widget cell would then fail loudly, not pass silently."""
    names = [cell_names(s) for s in sources[: target + 1]]
    if any(n is None for n in names):
        return list(range(target + 1))
    needed, todo = {target}, [target]
    while todo:
        i = todo.pop()
        for name in names[i][1]:
            j = next((j for j in range(i - 1, -1, -1) if name in names[j][0]), None)
            if j is not None and j not in needed:
                needed.add(j)
                todo.append(j)
    return sorted(needed)


def widget_cell_index(sources: list[str]) -> int:
    for i, s in enumerate(sources):
        if re.search(r"^\s*(import ipywidgets|from ipywidgets import)", s, re.M) and "interact" in s:
            return i
    raise AssertionError("no ipywidgets `interact` cell found")


def write_trimmed_chapter(chapter: Path, dest_dir: Path,
                          target: Callable[[list[str]], int] = widget_cell_index) -> tuple[Path, list[int]]:
    """Copy ``chapter`` into ``dest_dir`` with only the code cells one of its cells needs (``target`` finds
    that cell among the code cells' sources; by default the widget cell), outputs and saved widget state
    cleared, so whatever renders comes from the live kernel, each with the markdown cell right above it.
    Returns the copy's path and the kept code cells' indices in the chapter."""
    import nbformat

    nb = nbformat.read(chapter, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    sources = [nb.cells[i].source for i in code]
    keep = [code[k] for k in needed_cells(sources, target(sources))]
    cells = [nbformat.v4.new_markdown_cell(
        f"*Copy of `{chapter.name}` made by `tests/course/test_browser.py`: only the cells its target cell needs "
        f"(code cells {', '.join(str(i) for i in keep)} of the chapter).*")]
    for i in keep:
        if i > 0 and nb.cells[i - 1].cell_type == "markdown" and i - 1 not in keep:
            cells.append(nb.cells[i - 1])
        cell = nb.cells[i]
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
        cells.append(cell)
    nb.cells = cells
    nb.metadata.pop("widgets", None)
    dest = dest_dir / chapter.name
    nbformat.write(nb, dest)
    return dest, keep


def test_needed_cells_follows_names_through_functions():
    sources = [
        "import torch\nx = torch.ones(2)",       # 0: needed (x, torch)
        "y = slow_thing()",                      # 1: not needed
        "%matplotlib inline\ndef f():\n    return x + 1",  # 2: needed (f), reads x inside the function
        "z = [f() for _ in range(3)]\nprint(y)",  # 3: target
    ]
    assert needed_cells(sources, 3) == [0, 1, 2, 3]
    sources[3] = "z = [f() for _ in range(3)]"
    assert needed_cells(sources, 3) == [0, 2, 3]
    assert needed_cells(["x = (", "print(x)"], 1) == [0, 1]  # unparsable: run everything above


def test_chapter_slice_keeps_the_widget_and_drops_the_slow_cells(tmp_path):
    path, keep = write_trimmed_chapter(CHAPTER, tmp_path)
    nb = json.loads(path.read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert "widgets.interactive(" in code[-1] and "warm_start(" in "".join(code)
    assert not any("best_of(" in s or "loss_and_grads(" in s for s in code), keep  # timing/gradient cells
    assert all(c.get("outputs", []) == [] for c in nb["cells"]) and "widgets" not in nb["metadata"]


def test_missing_chromium_skips_outside_ci_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv(CHROMIUM_ENV, raising=False)
    monkeypatch.setenv("PATH", "")
    assert find_chromium() is None
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="install chromium"):
        unavailable(f"no Chromium found: {CHROMIUM_FIX}")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        unavailable(f"no Chromium found: {CHROMIUM_FIX}")


# ----------------------------------------------------------------------------------------------------
# JupyterLab server


@dataclass
class Lab:
    url: str
    token: str
    proc: subprocess.Popen
    log: Path
    runtime_dir: Path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError as e:
            return f"(no server log: {e})"


def _lab_env(home: Path) -> dict[str, str]:
    """The server's (and so the kernel's) environment: ours, with Jupyter's and IPython's per-user
    config, data, runtime and settings moved into ``home``, so nothing of the user's is read or written."""
    env = dict(os.environ)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    env.pop("MPLBACKEND", None)  # let the kernel pick matplotlib's inline backend
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def chromium() -> str:
    """The Chromium binary, once Playwright and JupyterLab are known to be installed (else skip, or
    fail in CI)."""
    for module in ("playwright", "jupyterlab", "ipywidgets"):
        try:
            __import__(module)
        except ImportError:
            unavailable(f"{module} is not installed: bash scripts/setup.sh (or pip install -e '.[dev]')")
    path = find_chromium()
    if path is None:
        unavailable(f"no Chromium found: {CHROMIUM_FIX}")
    return path


@pytest.fixture
def jupyter_lab(chromium, tmp_path) -> Iterator[tuple[Lab, Path]]:
    """JupyterLab on 127.0.0.1 at a port the OS picks, with a random token, serving a temporary root.
    Yields (server, root). Always shut down (REST shutdown, then SIGTERM, then SIGKILL). Asks for
    ``chromium`` first, so that nothing starts when the test is going to be skipped."""
    root, home = tmp_path / "root", tmp_path / "jupyter-home"
    root.mkdir()
    env = _lab_env(home)
    # A fresh user's JupyterLab asks with a pop-up whether to fetch Jupyter news; answer "never" up front.
    news = home / "lab-settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    token = secrets.token_hex(24)
    log = tmp_path / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", "--ServerApp.port_retries=0",
           f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
           "--ServerApp.allow_root=True",             # CI runs as root
           "--ServerApp.terminals_enabled=False",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly",     # no PyPI look-ups from the server
           f"--LabApp.user_settings_dir={home / 'lab-settings'}",
           f"--LabApp.workspaces_dir={home / 'lab-workspaces'}"]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(url="", token=token, proc=proc, log=log, runtime_dir=home / "runtime")
    try:
        info_file = lab.runtime_dir / f"jpserver-{proc.pid}.json"
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with code {proc.returncode} while starting:\n"
                            f"{lab.log_tail()}", pytrace=False)
            if info_file.exists():
                try:
                    info = json.loads(info_file.read_text())
                    lab.url = f"http://127.0.0.1:{info['port']}"
                    with urllib.request.urlopen(_api(lab, "/api/status"), timeout=10) as r:
                        if r.status == 200:
                            break
                except (OSError, ValueError, KeyError):
                    pass  # file half written, or not serving yet
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{lab.log_tail()}",
                            pytrace=False)
            time.sleep(0.5)
        yield lab, root
    finally:
        _stop_lab(lab)


def _api(lab: Lab, path: str, method: str = "GET") -> urllib.request.Request:
    return urllib.request.Request(lab.url + path, method=method,
                                  headers={"Authorization": f"token {lab.token}"})


def _is_our_kernel(pid: int, runtime_dir: Path) -> bool:
    """Whether ``pid`` is a kernel of this test's server: its command line names a connection file in
    the server's own runtime directory."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"ipykernel" in cmdline and os.fsencode(runtime_dir) in cmdline


def _kernel_pids(server_pid: int, runtime_dir: Path) -> list[int]:
    """The server's kernel processes, where /proc can tell (Linux); else none."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and _is_our_kernel(int(stat.parent.name), runtime_dir):
            pids.append(int(stat.parent.name))
    return pids


def _stop_lab(lab: Lab) -> None:
    """Ask the server to shut down (it stops its kernels), then signal it if it does not; a kernel
    left behind (each runs in a session of its own) is killed too."""
    proc = lab.proc
    kernels = _kernel_pids(proc.pid, lab.runtime_dir) if proc.poll() is None else []
    try:
        _stop_server(lab)
    finally:
        for pid in kernels:
            if _is_our_kernel(pid, lab.runtime_dir):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass  # gone meanwhile


def _stop_server(lab: Lab) -> None:
    proc = lab.proc
    if proc.poll() is None and lab.url:
        try:
            urllib.request.urlopen(_api(lab, "/api/shutdown", "POST"), timeout=30).close()
        except OSError:
            pass
    for sig, wait_s in ((None, SHUTDOWN_S), (signal.SIGTERM, 20), (signal.SIGKILL, 20)):
        if proc.poll() is not None:
            return
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)  # its own session: the server and anything it left behind
            except ProcessLookupError:
                return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass


# ----------------------------------------------------------------------------------------------------
# The browser test


def _save_screenshot(page, tmp_path: Path, name: str) -> list[Path]:
    """Screenshot into tmp_path and, if set, $DPPO_BROWSER_SCREENSHOT_DIR; returns the files written."""
    paths = [tmp_path / name]
    page.screenshot(path=str(paths[0]))
    extra = os.environ.get(SCREENSHOT_ENV)
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        paths.append(Path(extra) / name)
        shutil.copyfile(paths[0], paths[1])
    return paths


def _page_state(page) -> str:
    """What a person would look at first when the test fails: dialogs, the status bar, a traceback."""
    try:
        return page.evaluate("""() => {
            const text = sel => [...document.querySelectorAll(sel)].map(e => e.innerText.trim()).join(' | ');
            return `status bar: ${text('#jp-main-statusbar')}\\ndialogs: ${text('.jp-Dialog') || 'none'}`;
        }""") + f"\ntraceback: {page.evaluate(TRACEBACK_JS) or 'none'}"
    except Exception as e:  # the page itself may be what broke
        return f"(page state unavailable: {e})"


def _fail(error: Exception, page, tmp_path: Path, shot_name: str, step: str, t0: float, chapter: Path,
          kept: list[int], console: list[str], lab: Lab) -> None:
    """Fail the test with what the page, the browser console and the server showed when ``step`` failed."""
    shots = []
    try:
        shots = _save_screenshot(page, tmp_path, shot_name)
    except Exception as shot_error:
        console.append(f"(failure screenshot not taken: {shot_error})")
    errors = "\n".join(console[-15:]) or "none"
    pytest.fail(f"browser test failed while {step} after {time.monotonic() - t0:.0f} s "
                f"(chapter {chapter.name}, code cells {kept}): {error}\n{_page_state(page)}\n"
                f"browser console errors:\n{errors}\nscreenshot: {[str(p) for p in shots]}\n"
                f"server log:\n{lab.log_tail(15)}", pytrace=False)


def _launch(pw, chromium: str, tmp_path: Path, console: list[str]):
    """Headless Chromium with its own profile; JavaScript errors and page errors are collected in ``console``."""
    context = pw.chromium.launch_persistent_context(
        str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True,
        args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 900}, timeout=120_000)
    page = context.pages[0] if context.pages else context.new_page()
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    return context, page


def _open_with_kernel(page, url: str) -> None:
    """Open the notebook in JupyterLab and wait until its kernel is up and connected."""
    page.goto(url, wait_until="domcontentloaded", timeout=LAB_LOAD_MS)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook", timeout=LAB_LOAD_MS)
    # The status bar reads "Python 3 (ipykernel) | Idle" once the kernel is up and connected.
    page.wait_for_function(
        "() => /\\|\\s*Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText || '')",
        timeout=LAB_LOAD_MS, polling=POLL_MS)


@pytest.mark.slow
def test_chapter_widget_renders_and_responds_in_chromium(chromium, jupyter_lab, tmp_path):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    lab, root = jupyter_lab
    notebook, kept = write_trimmed_chapter(CHAPTER, root)
    url = f"{lab.url}/lab/tree/{notebook.name}?token={lab.token}"
    console: list[str] = []
    step = "starting Chromium"
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    with sync_playwright() as pw:
        context, page = _launch(pw, chromium, tmp_path, console)
        try:
            step = "loading JupyterLab and starting the kernel"
            _open_with_kernel(page, url)
            timings["lab ready"] = time.monotonic() - t0

            step = "running the cells (Run > Run All Cells)"
            page.get_by_role("menubar").get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            # Until the widget shows up, or a cell fails, or a dialog opens (e.g. "the kernel died").
            page.wait_for_function(
                f"() => document.querySelector('.widget-interact') !== null || ({TRACEBACK_JS})() !== null"
                " || document.querySelector('.jp-Dialog') !== null", timeout=RUN_CELLS_MS, polling=POLL_MS)
            traceback = page.evaluate(TRACEBACK_JS)
            assert traceback is None, f"a cell failed:\n{traceback}"
            assert page.locator(".jp-Dialog").count() == 0, "a dialog opened instead of the widget"
            slider = page.locator(f".widget-slider:has(.widget-label:text-is('{SLIDER_LABEL}'))")
            slider.wait_for(state="visible", timeout=RESPONSE_MS)
            page.locator(OUTPUT_IMG).wait_for(state="visible", timeout=RESPONSE_MS)  # the first plot
            timings["widget rendered"] = time.monotonic() - t0

            step = "moving the slider with the keyboard"
            readout = slider.locator(".widget-readout")
            before, img_before = readout.inner_text().strip(), page.locator(OUTPUT_IMG).get_attribute("src")
            slider.locator(".noUi-handle").focus()
            page.keyboard.press("ArrowRight")
            expected = str(int(before) + 1)
            page.wait_for_function("([el, v]) => el.innerText.trim() === v",
                                   arg=[readout.element_handle(), expected], timeout=RESPONSE_MS, polling=POLL_MS)
            img_after_key = _wait_for_new_image(page, img_before)
            timings["keyboard response"] = time.monotonic() - t0

            step = "moving the slider with the mouse"
            box = slider.locator(".noUi-base").bounding_box()
            assert box is not None, "the slider's track has no size"
            page.mouse.click(box["x"] + 0.9 * box["width"], box["y"] + box["height"] / 2)
            page.wait_for_function("([el, v]) => el.innerText.trim() !== v",
                                   arg=[readout.element_handle(), expected], timeout=RESPONSE_MS, polling=POLL_MS)
            after = readout.inner_text().strip()
            assert int(after) > int(expected), f"clicking near the right end moved the slider to {after}"
            _wait_for_new_image(page, img_after_key)
            timings["mouse response"] = time.monotonic() - t0

            step = "taking the screenshot"
            page.locator(".widget-interact").evaluate("e => e.scrollIntoView({block: 'end'})")
            shots = _save_screenshot(page, tmp_path, "chapter-widget.png")
        except (PlaywrightError, AssertionError) as e:
            _fail(e, page, tmp_path, "chapter-widget-FAILED.png", step, t0, CHAPTER, kept, console, lab)
        finally:
            context.close()

    print(f"browser test: chapter {CHAPTER.name} (code cells {kept}); "
          + ", ".join(f"{k} at {v:.0f} s" for k, v in timings.items())
          + f"; screenshot: {', '.join(str(p) for p in shots)}")


def _wait_for_new_image(page, old_src: str | None) -> str:
    """Wait until the widget's output shows a plot other than ``old_src`` (the kernel re-ran the
    callback and the browser displayed its new figure); returns the new image's src."""
    page.wait_for_function(
        "([sel, old]) => { const i = document.querySelector(sel); return !!i && i.complete && i.src !== old; }",
        arg=[OUTPUT_IMG, old_src], timeout=RESPONSE_MS, polling=POLL_MS)
    src = page.locator(OUTPUT_IMG).get_attribute("src")
    assert src and src != old_src
    return src


# ----------------------------------------------------------------------------------------------------
# A chapter's check in the browser: chapter 03b's Horvitz-Thompson enumeration

ESTIMATION_CHAPTER = REPO_ROOT / "notebooks" / "03b_estimation.ipynb"
HT_PRINT = 'print(f"E[Ŷ] = '  # the line that prints the exact mean and variance over every keep pattern
HT_OUTPUT = re.compile(r"E\[Ŷ\] = ([\d.]+), Σ y = ([\d.]+) \| Var\[Ŷ\] = ([\d.]+), formula ([\d.]+)")


def horvitz_thompson_cell_index(sources: list[str]) -> int:
    return next(i for i, s in enumerate(sources) if HT_PRINT in s)


@pytest.mark.slow
def test_estimation_chapter_horvitz_thompson_cell_runs_in_chromium(chromium, jupyter_lab, tmp_path):
    """Chapter 03b opened in JupyterLab in Chromium: its exact Horvitz-Thompson check runs in the live kernel
    (with the cells it needs, the training-run cell left out) and its printed mean and variance match Σ y and
    the Poisson formula."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    lab, root = jupyter_lab
    notebook, kept = write_trimmed_chapter(ESTIMATION_CHAPTER, root, horvitz_thompson_cell_index)
    kept_code = "".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                        if c["cell_type"] == "code")
    assert HT_PRINT in kept_code and "train_step(" not in kept_code, kept  # the slice skips the training run
    url = f"{lab.url}/lab/tree/{notebook.name}?token={lab.token}"
    output_js = """(marker) => [...document.querySelectorAll('.jp-OutputArea-output')]
        .map(e => e.textContent).find(t => t.includes(marker)) || null"""
    console: list[str] = []
    step = "starting Chromium"
    t0 = time.monotonic()
    with sync_playwright() as pw:
        context, page = _launch(pw, chromium, tmp_path, console)
        try:
            step = "loading JupyterLab and starting the kernel"
            _open_with_kernel(page, url)

            step = "running the cells (Run > Run All Cells)"
            page.get_by_role("menubar").get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            page.wait_for_function(
                f"() => ({output_js})('E[Ŷ] =') !== null || ({TRACEBACK_JS})() !== null"
                " || document.querySelector('.jp-Dialog') !== null", timeout=RUN_CELLS_MS, polling=POLL_MS)
            traceback = page.evaluate(TRACEBACK_JS)
            assert traceback is None, f"a cell failed:\n{traceback}"
            assert page.locator(".jp-Dialog").count() == 0, "a dialog opened instead of the output"
            shown = page.evaluate(output_js, "E[Ŷ] =")
            found = HT_OUTPUT.search(shown or "")
            assert found, f"the Horvitz-Thompson cell printed {shown!r}"
            mean, total, var, formula = map(float, found.groups())
            assert mean == total and var == formula, shown
            shots = _save_screenshot(page, tmp_path, "chapter-03b-horvitz-thompson.png")
        except (PlaywrightError, AssertionError) as e:
            _fail(e, page, tmp_path, "chapter-03b-FAILED.png", step, t0, ESTIMATION_CHAPTER, kept, console, lab)
        finally:
            context.close()
    print(f"browser test: chapter {ESTIMATION_CHAPTER.name} (code cells {kept}) in {time.monotonic() - t0:.0f} s; "
          f"screenshot: {', '.join(str(p) for p in shots)}")
