"""The dashboard in headless Chromium (Debian's chromium + chromium-driver): it loads
offline, signs in with the one-time link, draws the chart (memory stacked by model),
values update, and its Empty-cache button reaches the server; without the link every
action is off and says why. Skipped where Chromium is not installed. The serving charts,
the try-it box, the other actions and the screenshots under load:
test_dashboard_serving.py."""

from __future__ import annotations

import contextlib
import time
import webbrowser
from pathlib import Path

import httpx
from browser import require_chromium
from images import photo
from live_server import live_server

DOCS = Path(__file__).resolve().parents[2] / "docs"

require_chromium()


def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def text_of(browser, key: str) -> str:
    """Read in one script call: the page rebuilds these rows on every sample, so an element
    found first and read afterwards may already be gone."""
    return str(browser.execute_script(
        "const dd = document.querySelector(`dd[data-key=\"${arguments[0]}\"]`);"
        "return dd ? dd.textContent : '';", key))


def test_dashboard_draws_updates_and_empties_the_cache(server, browser):
    link = httpx.post(f"{server.url}/v1/admin/ui-link", headers=server.admin()).json()["url"]
    assert "#code=" in link
    browser.get(link)
    chart = browser.find_element("id", "chart")
    wait_until(lambda: int(chart.get_attribute("data-points")) >= 2)
    assert browser.find_element("id", "state").get_attribute("class") in {"ok", "high",
                                                                             "shedding"}
    assert "limit" in browser.find_element("id", "headline").text
    assert browser.find_element("id", "headline").text.startswith("Used: ")
    assert "#code" not in browser.current_url  # the code leaves the address bar

    before = text_of(browser, "Requests")
    for _ in range(3):
        httpx.post(f"{server.url}/v1/classify", content=photo(),
                   headers={"Content-Type": "image/jpeg"})
    wait_until(lambda: text_of(browser, "Requests") != before)

    pixels = browser.execute_script(
        "const c = document.getElementById('chart');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;")
    assert pixels > 5000  # grid, watermark lines and the memory lines were drawn
    assert browser.execute_script(  # the one model of this server has its band
        "return [...document.querySelectorAll('#bands span[data-model]')]"
        ".map((s) => s.dataset.model);") == ["efficientnet_lite0"]

    button = browser.find_element("id", "empty")
    assert button.is_enabled()
    with server.client() as client:
        releases = client.get("/v1/memory").json()["idle_releases"]
    button.click()
    wait_until(lambda: browser.find_element("id", "message").text.startswith("Gave back"))
    with server.client() as client:
        assert client.get("/v1/memory").json()["idle_releases"] == releases


def test_dashboard_shows_the_diagnostics(server, browser):
    """On the CPU: no GPU row, memory steady, nothing emptied for fragmentation. A sample
    as a GPU with a leak would send it (drawn by the page's own code): the GPU row and
    the notice appear."""
    browser.get(f"{server.url}/ui")
    wait_until(lambda: int(browser.find_element("id", "chart").get_attribute("data-points")) >= 1)
    with server.client() as client:
        assert client.get("/v1/memory").json()["device"] == "cpu"
    assert text_of(browser, "GPU busy") == ""
    assert text_of(browser, "Kept when idle") == "steady"
    assert text_of(browser, "Emptied (fragmented)") == "0"
    assert not browser.find_element("id", "used-legend").is_displayed()
    assert not browser.find_element("id", "notice").is_displayed()
    hidden, notice, busy = browser.execute_script(
        "show(Object.assign({}, samples[samples.length - 1], {leak_suspected: true,"
        " leak_growth_bytes: 12 * 1024 * 1024, gpu_utilization_ratio: 0.4}));"
        "const n = document.getElementById('notice');"
        "return [n.hidden, n.textContent,"
        " document.querySelector('dd[data-key=\"GPU busy\"]').textContent];")
    assert not hidden and "Possible memory leak" in notice and "12 MiB" in notice
    assert busy == "40%"


def test_the_legend_says_what_an_own_model_is(server, browser):
    """The server's samples say what each model is; the page's own legend, given a
    sample with an own model of each task and a built-in one: the own ones have a muted
    note after the name, the built-in one none."""
    with server.client() as client:
        loaded = client.get("/v1/memory").json()["models"][0]
    assert (loaded["task"], loaded["format"], loaded["labels"], loaded["own"]) == (
        "classify", "efficientnet_lite", 1000, False)
    browser.get(f"{server.url}/ui")
    wait_until(lambda: int(browser.find_element("id", "chart").get_attribute("data-points")) >= 1)
    shown = browser.execute_script("""
        const model = (name, task, format, labels) => ({name, task, format, labels,
          own: format !== 'efficientnet_lite', weights_bytes: 4 << 20,
          batch_peak_bytes: 20 << 20, batch_size: 8, pinned: false});
        legend(Object.assign({}, samples[samples.length - 1], {models: [
          model('shapes', 'classify', 'onnx', 3), model('tags', 'multilabel', 'timm', 12),
          model('faces', 'embed', 'onnx', 0),
          model('efficientnet_lite0', 'classify', 'efficientnet_lite', 1000)]}));
        return [...document.querySelectorAll('#bands span[data-model]')].map((s) =>
          [s.textContent, s.querySelector('small') ? s.querySelector('small').textContent : '',
           s.querySelector('small') ? getComputedStyle(s.querySelector('small')).color : '']);""")
    assert shown == [
        ["shapes your model (onnx, 3 labels) 4 MiB (+ 20 MiB while working)",
         "your model (onnx, 3 labels)", "rgb(91, 96, 104)"],
        ["tags your model (timm, multilabel, 12 labels) 4 MiB (+ 20 MiB while working)",
         "your model (timm, multilabel, 12 labels)", "rgb(91, 96, 104)"],
        ["faces your model (onnx, image features) 4 MiB (+ 20 MiB while working)",
         "your model (onnx, image features)", "rgb(91, 96, 104)"],
        ["efficientnet_lite0 4 MiB (+ 20 MiB while working)", "", ""],
    ]


def test_dashboard_link_works_once_and_without_it_the_button_is_off(server, browser):
    link = httpx.post(f"{server.url}/v1/admin/ui-link", headers=server.admin()).json()["url"]
    code = link.split("#code=")[1]
    assert httpx.post(f"{server.url}/v1/ui/session", json={"code": code}).status_code == 200
    reused = httpx.post(f"{server.url}/v1/ui/session", json={"code": code})
    assert reused.status_code == 401
    browser.get(f"{server.url}/ui")
    wait_until(lambda: int(browser.find_element("id", "chart").get_attribute("data-points")) >= 1)
    wait_until(lambda: browser.find_elements("css selector", "#unloads button"))
    # every action of the tray's menu is there, off, and says why
    buttons = browser.find_elements("css selector", "#actions button")
    assert {b.text for b in buttons} == {"Pause serving", "Empty GPU cache", "Reset peak",
                                         "Save a support report",
                                         "Unload efficientnet_lite0", "Stop vramguard"}
    for button in buttons:
        assert not button.is_enabled(), button.text
        assert button.get_attribute("title") == ("Open the dashboard from the tray icon to "
                                                 "use this"), button.text
    assert "Open the dashboard from the vramguard tray icon" in browser.find_element(
        "id", "powers").text
    link = browser.find_element("id", "use")
    assert link.text == "Use it from your app" and link.get_attribute("href") == (
        f"{server.url}/ui/use")
    page = httpx.get(f"{server.url}/ui").text
    assert server.token() not in page and "http" not in page.split("<script>")[1][:2000].lower()


def test_the_trays_launch_page_signs_the_dashboard_in(server, browser, monkeypatch, tmp_path):
    """What the tray hands the browser is a private local page, not the link: a real
    browser follows it from file:// to the dashboard, which signs in with the code."""
    from tray.client import ApiClient
    from tray.dashboard import DashboardOpener

    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url))
    with ApiClient(server.url, server.token_file) as client:
        DashboardOpener(client, tmp_path / "run").open()
    assert len(opened) == 1 and opened[0].startswith("file://") and "code" not in opened[0]
    browser.get(opened[0])
    wait_until(lambda: browser.current_url.startswith(f"{server.url}/ui"))
    wait_until(lambda: browser.find_element("id", "empty").is_enabled())
    assert "#code" not in browser.current_url


def band_pixels(browser) -> dict[str, int]:
    """For each band in the legend (a model's name, or 'images'): how many pixels of the
    chart have exactly its colour."""
    return browser.execute_script("""
        const c = document.getElementById('chart');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const out = {};
        for (const span of document.querySelectorAll('#bands span')) {
          const rgb = getComputedStyle(span.querySelector('i')).backgroundColor
            .match(/\\d+/g).map(Number);
          let n = 0;
          for (let i = 0; i < d.length; i += 4)
            if (d[i] === rgb[0] && d[i + 1] === rgb[1] && d[i + 2] === rgb[2]
                && d[i + 3] === 255) n++;
          out[span.dataset.model || 'images'] = n;
        }
        return out;""")


def test_the_chart_stacks_memory_by_model(tmp_path, browser):
    """A server with two models: a band per model, named in the legend with what it takes
    ('kept loaded' for both: they were asked for at start), larger once zoomed in on what
    vramguard holds; an unloaded model leaves the legend but keeps its band for the time
    it was loaded."""
    with live_server(tmp_path, "--no-cache", "--batch-size", "4", "--models",
                     "efficientnet_lite1", "--memory-budget", "2GiB",
                     env={"VRAMGUARD_RATE_LIMIT": "0"}) as server:
        browser.get(httpx.post(f"{server.url}/v1/admin/ui-link",
                               headers=server.admin()).json()["url"])
        chart = browser.find_element("id", "chart")
        wait_until(lambda: chart.get_attribute("data-bands") ==
                   "efficientnet_lite0,efficientnet_lite1")
        for _ in range(4):
            for model in ("efficientnet_lite0", "efficientnet_lite1"):
                answer = httpx.post(f"{server.url}/v1/classify?model={model}", content=photo(),
                                    headers={"Content-Type": "image/jpeg"}, timeout=60)
                # 503 when other programs on a busy test machine took the budget (on the
                # CPU they share system memory): the bands are drawn all the same
                assert answer.status_code in (200, 503), answer.text
        wait_until(lambda: int(chart.get_attribute("data-points")) >= 12, timeout=30)
        legend = browser.find_element("id", "bands").text
        assert "efficientnet_lite0 " in legend and "efficientnet_lite1 " in legend
        assert "while working), kept loaded" in legend and "Images in progress" in legend
        # What vramguard holds (two small models and a batch of four, about 100 MB at its
        # peak) is under a tenth of the 2 GiB limit: the chart opens zoomed in on it, so
        # that it is not a sliver under the limit's line.
        zoom = browser.find_element("id", "zoom")
        wait_until(lambda: zoom.text == "Show the whole limit")
        zoomed = band_pixels(browser)
        assert zoomed["efficientnet_lite0"] > 500 and zoomed["efficientnet_lite1"] > 500, zoomed
        zoom.click()  # the whole limit
        wait_until(lambda: zoom.text == "Zoom in on what vramguard holds")
        drawn = band_pixels(browser)
        assert zoomed["efficientnet_lite0"] > 5 * drawn["efficientnet_lite0"], (drawn, zoomed)
        zoom.click()
        DOCS.mkdir(exist_ok=True)
        with contextlib.suppress(AssertionError):  # a picture of a calm moment, if any
            wait_until(lambda: browser.find_element("id", "state").get_attribute("class")
                       == "ok", timeout=20)
        browser.save_screenshot(str(DOCS / "dashboard-models.png"))

        unloaded = httpx.post(f"{server.url}/v1/models/efficientnet_lite1/unload",
                              headers=server.admin())
        assert unloaded.status_code == 200, unloaded.text
        wait_until(lambda: not browser.find_elements(
            "css selector", '#bands span[data-model="efficientnet_lite1"]'))
        assert chart.get_attribute("data-bands") == "efficientnet_lite0,efficientnet_lite1"
