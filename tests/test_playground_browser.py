"""The playground page (GET /) in headless Chromium, against the real server on the embedded model.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them); when the
browser cannot start, the tests fail with the reason. ``DLLM_SCREENSHOT=docs/playground.png``
writes the compare-mode screenshot there (docs/serving.md's picture); otherwise it goes to a tmp path.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

pytestmark = pytest.mark.integration  # the server's warm-up compiles three methods (about 1.5 min on 2 cores)

PROMPT = "sort: 3 9 1 4"
COMPARE_PROMPT = "(3+2)*4-7"  # every step within the tiny model's range [0, 20]
METHODS = ("flash_cache", "flash_cache+verify", "fast_dllm")
GEN_LENGTH = 64
API_KEY = "playground-test-key"
SERVER_START_SECONDS = 600  # bounded wait for the warm-up
ANSWER_SECONDS = 120
REPO_ROOT = Path(__file__).resolve().parents[1]


def _api_key() -> str:
    return os.environ.get("DLLM_PLAYGROUND_API_KEY", API_KEY)


def _server_command(port_file: Path) -> list[str]:
    """The server on a port the OS picks (written to port_file once it serves)."""
    methods = [arg for m in METHODS for arg in ("--method", m)]
    return [
        sys.executable,
        "-m",
        "dllm_jax.serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--batch-size",
        "2",
        "--gen-length",
        str(GEN_LENGTH),
        "--api-key",
        API_KEY,
        *methods,
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    """The server on the embedded tiny model, on a loopback port the OS picks; stopped by its PID.

    DLLM_PLAYGROUND_SERVER=URL (and DLLM_PLAYGROUND_API_KEY) uses a server already running with
    _server_command's options.
    """
    if os.environ.get("DLLM_PLAYGROUND_SERVER"):
        yield os.environ["DLLM_PLAYGROUND_SERVER"].rstrip("/")
        return
    folder = tmp_path_factory.mktemp("server")
    port_file, log_path = folder / "port", folder / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(_server_command(port_file), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not port_file.exists():
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the server was not serving within {SERVER_START_SECONDS} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        base = f"http://127.0.0.1:{int(port_file.read_text())}"
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through chromedriver; a failure to start fails the test with the reason."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.fail("chromium and chromedriver are needed (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    except WebDriverException as e:
        pytest.fail(f"headless chromium could not start: {e.msg}")
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _open_page(browser, server: str, prompt_text: str = PROMPT) -> None:
    """Loads the page (public) and gives it the API key, which its API calls need."""
    browser.get(server + "/")
    model_name = browser.find_element(By.ID, "model-name")
    WebDriverWait(browser, 30).until(lambda b: model_name.text not in ("", "…"))
    assert model_name.text.startswith("unavailable (401: missing API key"), model_name.text
    browser.find_element(By.ID, "api-key").send_keys(_api_key(), Keys.TAB)
    WebDriverWait(browser, 30).until(lambda b: not model_name.text.startswith("unavailable"))
    assert model_name.text == "tiny-llada"
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(prompt_text)


def _wait_for_panels(browser, count: int) -> list:
    def finished(b):
        panels = b.find_elements(By.CSS_SELECTOR, "[data-panel]")
        return len(panels) == count and all(
            p.get_attribute("data-state") in ("done", "error", "stopped") for p in panels
        )

    WebDriverWait(browser, ANSWER_SECONDS, poll_frequency=0.2).until(finished)
    panels = browser.find_elements(By.CSS_SELECTOR, "[data-panel]")
    for panel in panels:
        error = panel.find_element(By.CSS_SELECTOR, "[data-role=error]").text
        assert panel.get_attribute("data-state") == "done", f"a panel failed: {error}"
    return panels


def _role(panel, role: str):
    return panel.find_element(By.CSS_SELECTOR, f"[data-role={role}]")


def _filled_cells(panel) -> list:
    return panel.find_elements(By.CSS_SELECTOR, "[data-cell][data-state=filled]")


def _api_answer(server: str, streamed_request: dict) -> tuple[str, dict]:
    """The non-streamed answer (text, dllm statistics) of the request the page streamed."""
    client = openai.OpenAI(base_url=server + "/v1", api_key=_api_key(), max_retries=0, timeout=ANSWER_SECONDS)
    body = {k: v for k, v in streamed_request.items() if k not in ("stream", "stream_options", "dllm")}
    extension = {k: v for k, v in streamed_request["dllm"].items() if k != "canvas"}
    if "messages" in body:
        response = client.chat.completions.create(**body, extra_body={"dllm": extension})
        text = response.choices[0].message.content
    else:
        response = client.completions.create(**body, extra_body={"dllm": extension})
        text = response.choices[0].text
    return text, (response.model_extra or {}).get("dllm") or {}


def _save_screenshot(browser, default_path: Path) -> Path:
    """A PNG of the whole page (beyond the window): DLLM_SCREENSHOT if set, else default_path."""
    path = Path(os.environ.get("DLLM_SCREENSHOT") or default_path)
    if not path.is_absolute():
        path = REPO_ROOT / path
    size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG") and len(png) > 10_000, "chromium returned no real screenshot"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return path


def test_the_pages_files_and_nothing_else_are_served_without_the_key(server):
    for path, media_type in (
        ("/", "text/html"),
        ("/static/app.js", "text/javascript"),
        ("/static/style.css", "text/css"),
        ("/static/favicon.svg", "image/svg+xml"),
        ("/favicon.ico", "image/svg+xml"),
    ):
        r = httpx.get(server + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type), (path, r.status_code)
    for path in ("/static/index.html", "/static/", "/v1/models"):
        assert httpx.get(server + path, timeout=10).status_code == 401, path


def test_page_streams_the_canvas_and_replays_it(server, browser, tmp_path):
    _open_page(browser, server)
    browser.find_element(By.ID, "run").click()
    (panel,) = _wait_for_panels(browser, 1)

    origins = browser.execute_script("return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")
    assert set(origins) == {server}, f"the page fetched from elsewhere: {set(origins)}"
    streamed = json.loads(panel.get_attribute("data-request"))
    assert streamed["stream"] is True and streamed["dllm"]["canvas"] is True
    api_text, api_stats = _api_answer(server, streamed)
    # textContent keeps the answer's whitespace (Selenium's .text trims it)
    assert browser.execute_script("return arguments[0].textContent", _role(panel, "final-text")) == api_text
    assert api_text.startswith("1 3 4 9")

    filled = _filled_cells(panel)
    steps_drawn = {int(c.get_attribute("data-step")) for c in filled}
    assert len(steps_drawn) > 1, f"every cell was filled at one step: {steps_drawn}"
    assert int(_role(panel, "steps").text) == api_stats["steps"] >= max(steps_drawn)
    assert len(panel.find_elements(By.CSS_SELECTOR, "[data-cell]")) == GEN_LENGTH
    assert len(filled) >= len(api_text)

    slider = _role(panel, "replay")
    frames = int(slider.get_attribute("max"))
    assert frames == len(steps_drawn) and int(slider.get_attribute("value")) == frames
    slider.send_keys(Keys.HOME)
    assert int(slider.get_attribute("value")) == 0 and _filled_cells(panel) == []
    slider.send_keys(Keys.ARROW_RIGHT)
    first_frame = _filled_cells(panel)
    assert 0 < len(first_frame) < len(filled)
    assert {int(c.get_attribute("data-step")) for c in first_frame} == {min(steps_drawn)}
    slider.send_keys(Keys.END)
    assert len(_filled_cells(panel)) == len(filled)
    _save_screenshot(browser, tmp_path / "playground-single.png")


def test_the_first_load_preset_shows_the_denoising_step_by_step(server, browser, tmp_path):
    """Run at the page's defaults: "watch it denoise" commits one token per step, so the answer
    fills in over at least 8 steps on the embedded model."""
    _open_page(browser, server)
    assert Select(browser.find_element(By.ID, "preset")).first_selected_option.get_attribute("value") == "denoise"
    threshold = browser.find_element(By.CSS_SELECTOR, "[data-setting] [data-field=threshold]")
    assert threshold.get_attribute("value") == "1"
    browser.find_element(By.ID, "run").click()
    (panel,) = _wait_for_panels(browser, 1)
    steps = sorted({int(c.get_attribute("data-step")) for c in _filled_cells(panel)})
    assert len(steps) >= 8, steps
    assert _role(panel, "tokens-per-step").text == "1.00"  # the server's count: one token per step
    _save_screenshot(browser, tmp_path / "playground-denoise.png")
    Select(browser.find_element(By.ID, "preset")).select_by_value("fast")
    assert threshold.get_attribute("value") == ""


def test_the_legend_and_the_method_menu(server, browser):
    """The legend names the empty-token cell and tells padding from masked cells; the method
    menu shows its longest option whole."""
    _open_page(browser, server)
    legend = browser.find_element(By.CSS_SELECTOR, ".legend").text
    assert "∅" in legend and "padding" in legend and "masked" in legend
    looks = browser.execute_script(
        """
        const look = (name) => { const s = getComputedStyle(document.querySelector(`[data-swatch=${name}]`));
                                 return [s.backgroundColor, s.backgroundImage, s.opacity].join(" | "); };
        return { masked: look("masked"), padding: look("padding") };
        """
    )
    assert looks["masked"] != looks["padding"] and "gradient" in looks["padding"], looks
    widths = browser.execute_script(
        """
        return [...document.querySelectorAll('[data-field="method"]')].map((select) => {
          const longest = [...select.options].map((o) => o.text).sort((a, b) => b.length - a.length)[0];
          const probe = document.createElement("span");
          probe.style.font = getComputedStyle(select).font;
          probe.style.whiteSpace = "pre";
          probe.textContent = longest;
          document.body.appendChild(probe);
          const needed = probe.getBoundingClientRect().width;
          probe.remove();
          return [needed, select.getBoundingClientRect().width];
        });
        """
    )
    assert widths and all(needed + 20 <= width for needed, width in widths), widths
    assert httpx.get(server + "/favicon.ico", timeout=10).status_code == 200


def test_compare_mode_shows_each_settings_step_count(server, browser, tmp_path):
    _open_page(browser, server, COMPARE_PROMPT)
    browser.find_element(By.ID, "compare").click()
    WebDriverWait(browser, 10).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "[data-setting]")) == 3)
    methods = [
        Select(f.find_element(By.CSS_SELECTOR, "[data-field=method]")).first_selected_option.get_attribute("value")
        for f in browser.find_elements(By.CSS_SELECTOR, "[data-setting]")
    ]
    assert methods == list(METHODS)
    browser.find_element(By.ID, "run").click()
    panels = _wait_for_panels(browser, 3)

    counts = []
    for panel, method in zip(panels, METHODS):
        streamed = json.loads(panel.get_attribute("data-request"))
        assert streamed["dllm"]["method"] == method and method in _role(panel, "settings-summary").text
        api_text, api_stats = _api_answer(server, streamed)
        assert browser.execute_script("return arguments[0].textContent", _role(panel, "final-text")) == api_text
        steps = int(_role(panel, "steps").text)
        assert steps == api_stats["steps"], (
            f"{method}: the panel shows {steps} steps, the API says {api_stats['steps']}"
        )
        passes = _role(panel, "forward-passes").text
        if api_stats.get("forward_passes") is not None:
            assert passes == str(api_stats["forward_passes"]), f"{method}: {passes} forward passes shown"
        counts.append((steps, passes))
    assert len(set(counts)) > 1, f"the compared methods show the same steps and passes: {counts}"
    _save_screenshot(browser, tmp_path / "playground-compare.png")


def test_text_completions_endpoint(server, browser):
    _open_page(browser, server)
    Select(browser.find_element(By.ID, "endpoint")).select_by_value("completions")
    browser.find_element(By.ID, "run").click()
    (panel,) = _wait_for_panels(browser, 1)
    assert panel.get_attribute("data-path") == "/v1/completions"
    streamed = json.loads(panel.get_attribute("data-request"))
    assert streamed["prompt"] == PROMPT and "messages" not in streamed
    api_text, _ = _api_answer(server, streamed)
    assert browser.execute_script("return arguments[0].textContent", _role(panel, "final-text")) == api_text
    assert _filled_cells(panel)


def test_a_rejected_request_is_shown_in_its_panel(server, browser):
    _open_page(browser, server)
    threshold = browser.find_element(By.CSS_SELECTOR, "[data-setting] [data-field=threshold]")
    threshold.clear()  # the first-load preset's 1
    threshold.send_keys("-1")
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.CSS_SELECTOR, "[data-panel]").get_attribute("data-state") == "error"
    )
    error = browser.find_element(By.CSS_SELECTOR, "[data-panel] [data-role=error]")
    assert error.is_displayed() and error.text.startswith("400: dllm.threshold"), error.text


def test_canvas_marks_verified_drafts_the_end_and_padding(server, browser):
    """The page's drawing, fed a hand-made stream (the server's drafts need a real verify run)."""
    browser.get(server + "/")
    cells = browser.execute_script(
        """
        const panel = new Panel(document.getElementById("panels"), "T", "", { path: "/v1/completions", body: {} });
        const commit = (position, token_id, text, verified = false) => ({ position, token_id, text, verified });
        panel.update({ choices: [{ index: 0, text: "a", finish_reason: null }],
          dllm: { step: 1, gen_length: 6, commits: [commit(0, 5, "a"), commit(2, 7, " ", true)], eos_position: null } });
        panel.update({ choices: [{ index: 0, text: "b ", finish_reason: "stop" }],
          dllm: { step: 3, gen_length: 6, commits: [commit(1, 6, "b"), commit(3, 96, ""), commit(4, 96, "")], eos_position: 3 } });
        panel.update({ choices: [], usage: { completion_tokens: 3 }, dllm: { steps: 3, forward_passes: 5 } });
        panel.finish();
        const role = (r) => panel.root.querySelector(`[data-role=${r}]`).textContent;
        return { counters: [role("steps"), role("tokens"), role("tokens-per-step"), role("forward-passes"), role("final-text")],
                 replay: panel.root.querySelector("[data-role=replay]").max,
                 cells: [...panel.root.querySelectorAll("[data-cell]")].map((c) => ({
                   classes: [...c.classList].sort().join(" "), step: c.dataset.step ?? null, text: c.textContent,
                   background: c.style.background })) };
        """
    )
    assert cells["counters"] == ["3", "3", "1.00", "5", "ab "]
    assert cells["replay"] == "2"
    got = [(c["classes"], c["step"], c["text"]) for c in cells["cells"]]
    assert got == [
        ("cell", "1", "a"),
        ("cell", "3", "b"),
        ("cell verified", "1", "␣"),
        ("cell eos", "3", "EOS"),
        ("cell eos padding", "3", "EOS"),
        ("cell masked padding", None, ""),
    ]
    backgrounds = [c["background"] for c in cells["cells"]]
    assert backgrounds[0] == backgrounds[2] != backgrounds[1] == backgrounds[3]


def test_sse_parser_takes_events_split_anywhere(server, browser):
    """The page's SSE reader, fed one byte per read: CRLF and a UTF-8 character cut in two."""
    browser.get(server + "/")
    events = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const text = ': keep-alive\\r\\n\\r\\ndata: {"text": "é→"}\\r\\n\\r\\ndata: a\\ndata: b\\n\\nevent: x\\ndata:c\\r\\rdata: [DONE]\\r\\n\\r\\n';
        const bytes = new TextEncoder().encode(text);
        const body = new ReadableStream({ start(c) { for (const b of bytes) c.enqueue(new Uint8Array([b])); c.close(); } });
        (async () => { const out = []; for await (const e of sseEvents(body)) out.push(e); done(out); })()
          .catch((e) => done("error: " + e));
        """
    )
    assert events == ['{"text": "é→"}', "a\nb", "c", "[DONE]"]
