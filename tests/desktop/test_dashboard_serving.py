"""The dashboard's serving charts, its try-it box and its tray actions, in headless
Chromium against real servers on 127.0.0.1.

Under real load (two models, requests flowing from threads, a client over its rate
limit, bad images) the charts show photos per second, answer times and refusals by
reason, the table per model; the screenshots in docs/ are taken then. A photo dropped on
the page (or picked) is answered, through the same rate limits as any client; a page on
another site cannot do the same. Opened from the tray's link, the page does what the
tray menu does: pause, resume, reset the peak, save a support report, unload a model,
stop vramguard."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import require_chromium, wait_until
from images import DATA, photo
from live_server import LiveServer, live_server

DOCS = Path(__file__).resolve().parents[2] / "docs"
MODELS = ("efficientnet_lite0", "efficientnet_lite1")

require_chromium()


def colour_pixels(browser: Any, canvas: str, rgb: tuple[int, int, int]) -> int:
    """How many pixels of the canvas have exactly this colour, fully opaque."""
    return int(browser.execute_script("""
        const c = document.getElementById(arguments[0]);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const [r, g, b] = arguments[1];
        let n = 0;
        for (let i = 0; i < d.length; i += 4)
          if (d[i] === r && d[i + 1] === g && d[i + 2] === b && d[i + 3] === 255) n++;
        return n;""", canvas, list(rgb)))


def table(browser: Any) -> dict[str, dict[str, str]]:
    """The serving table, by model (and 'All models'), read in one script call."""
    return dict(browser.execute_script("""
        const out = {};
        for (const tr of document.querySelectorAll('#per-model tbody tr')) {
          const row = {};
          for (const td of tr.querySelectorAll('td')) row[td.dataset.field] = td.textContent;
          out[tr.dataset.model] = row;
        }
        return out;"""))


def stage_file(browser: Any, path: Path) -> None:
    """Pick a file from disk into a file input made for the purpose, so that a drop of it
    (``drop_staged``) is one quick script call (Selenium cannot drag from the desktop)."""
    helper = browser.execute_script("""
        const input = document.createElement('input');
        input.type = 'file'; input.id = 'test-drop-source';
        document.body.appendChild(input);
        return input;""")
    helper.send_keys(str(path))


def drop_staged(browser: Any) -> None:
    """Hand the staged file to the try-it box in a drop event, as a person dragging it
    there does."""
    browser.execute_script("""
        const input = document.getElementById('test-drop-source');
        const transfer = new DataTransfer();
        transfer.items.add(input.files[0]);
        input.remove();
        const box = document.getElementById('drop');
        for (const kind of ['dragenter', 'dragover', 'drop'])
          box.dispatchEvent(new DragEvent(kind, {bubbles: true, cancelable: true,
                                                 dataTransfer: transfer}));""")


def drop_file(browser: Any, path: Path) -> None:
    """Drop a file from disk on the try-it box."""
    stage_file(browser, path)
    drop_staged(browser)


def answer_of(browser: Any) -> tuple[str, list[str], str]:
    """The try-it box's outcome code, the labels shown and the timing line."""
    code, labels, timing = browser.execute_script("""
        return [document.getElementById('try-message').dataset.code || '',
                [...document.querySelectorAll('#labels li')].map((li) => li.dataset.label),
                document.getElementById('timing').textContent];""")
    return str(code), list(labels), str(timing)


class Load:
    """Requests flowing from threads while the test looks: for each model one photo at a
    time (the next once the last is answered, so the load follows what this machine can
    do), a bad image now and then, and bursts from a client that goes over its rate
    limit (429)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self.steady, args=(model,), daemon=True)
                        for model in MODELS]
        self.threads.append(threading.Thread(target=self.bursts, daemon=True))

    def post(self, http: httpx.Client, body: bytes, **params: str) -> None:
        answer = http.post("/v1/classify", content=body, params=params,
                           headers={"Content-Type": "image/jpeg"})
        self.statuses.append(answer.status_code)

    def steady(self, model: str) -> None:
        """About 4 photos a second, from 4 clients in turn (each within its rate)."""
        with httpx.Client(base_url=self.url, timeout=60) as http:
            sent = 0
            while not self.stop.is_set():
                http.headers["X-Client-Id"] = f"steady-{model}-{sent % 4}"
                self.post(http, photo("chelsea.jpg" if sent % 2 else "coffee.jpg"),
                          model=model)
                sent += 1
                if sent % 5 == 0:
                    self.post(http, b"this is not a photo")
                self.stop.wait(0.25)

    def bursts(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60,
                          headers={"X-Client-Id": "bursty"}) as http:
            while not self.stop.wait(4):
                workers = [threading.Thread(target=self.post, args=(http, photo()))
                           for _ in range(8)]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Two models, each kept loaded; a rate limit of 4 requests (one more a second) per
    client, which the steady clients stay under and the bursts do not."""
    with live_server(tmp_path_factory.mktemp("loaded"), "--no-cache", "--batch-size", "4",
                     "--models", MODELS[1],
                     env={"VRAMGUARD_CLASSIFY_BURST": "4",
                          "VRAMGUARD_CLASSIFY_PER_S": "1"}) as running:
        yield running


def signed_in(browser: Any, server: LiveServer) -> None:
    link = httpx.post(f"{server.url}/v1/admin/ui-link", headers=server.admin()).json()["url"]
    browser.get(link)
    wait_until(lambda: browser.find_element("id", "empty").is_enabled())


def test_the_serving_under_load_per_model_and_in_total(loaded: LiveServer,
                                                        browser: Any) -> None:
    signed_in(browser, loaded)
    with Load(loaded.url) as load:
        def answered() -> dict[str, float]:  # photos a second, per model, in the last sample
            return dict(browser.execute_script("""
                const s = samples[samples.length - 1].serving;
                return Object.fromEntries(Object.entries(s.models)
                  .map(([name, f]) => [name, f.images_per_s]));"""))

        def seen_s() -> float:
            return float(browser.execute_script(
                "return samples[samples.length - 1].t - samples[0].t"))

        wait_until(lambda: 429 in load.statuses and 400 in load.statuses
                   and all(answered().get(name, 0) > 0 for name in MODELS)
                   and seen_s() > 30, timeout=150)
        time.sleep(5)  # the last refusals drawn over a few samples, not only the newest
        rows = table(browser)
        assert set(rows) == {*MODELS, "All models"}, rows
        for name in (*MODELS, "All models"):
            assert rows[name]["p50"].endswith(("ms", " s")), rows
            assert rows[name]["p95"].endswith(("ms", " s")), rows
        assert "too many from one app" in rows["All models"]["refused"], rows
        assert "not a usable photo" in rows["All models"]["refused"], rows
        legend = browser.find_element("id", "refused-legend").text
        assert "too many from one app" in legend and "not a usable photo" in legend
        assert "photos a second; a typical answer takes" in browser.find_element(
            "id", "serving-headline").text
        # Each chart drew its series: the total's line (per model too: two models
        # answered), both answer-time lines, a band for each reason seen.
        assert colour_pixels(browser, "rate-chart", (0x1D, 0x1F, 0x23)) > 50
        for model_line in ((0x2F, 0x6F, 0xDB), (0xD9, 0x73, 0x0D)):
            assert colour_pixels(browser, "rate-chart", model_line) > 20
        assert colour_pixels(browser, "time-chart", (0x1D, 0x1F, 0x23)) > 80
        assert colour_pixels(browser, "refused-chart", (0xF0, 0xAA, 0x00)) > 50  # 429s
        assert colour_pixels(browser, "refused-chart", (0x7B, 0x3F, 0xB5)) > 20  # bad
        DOCS.mkdir(exist_ok=True)
        browser.save_screenshot(str(DOCS / "dashboard.png"))  # what a laptop shows first
        browser.set_window_size(1280, 1250)
        time.sleep(1.5)  # a sample or two, drawn at the new size
        browser.save_screenshot(str(DOCS / "dashboard-serving.png"))
        browser.set_window_size(420, 2600)
        time.sleep(1.5)
        assert browser.execute_script(  # one column: nothing wider than the window
            "return document.documentElement.scrollWidth") <= 420
        browser.save_screenshot(str(DOCS / "dashboard-narrow.png"))

        # The page's own photos go through the same limits as any app's: they share the
        # bucket of every program at this address that sends no X-Client-Id. Emptied
        # from here, it refuses the photo dropped right after. (It gains a token a
        # second: on a slow machine one may come between the two, so a few tries.)
        browser.set_window_size(1280, 800)
        with httpx.Client(base_url=loaded.url, timeout=60) as same_address:
            for _ in range(10):
                stage_file(browser, DATA / "coffee.jpg")
                assert 429 in (same_address.post("/v1/classify", content=b"not a photo")
                               .status_code for _ in range(50))  # stops at the first 429
                drop_staged(browser)
                wait_until(lambda: answer_of(browser)[0] != "")
                if answer_of(browser)[0] == "rate_limited":
                    break
                browser.execute_script(
                    "document.getElementById('try-message').dataset.code = ''")
        assert answer_of(browser)[0] == "rate_limited"
        assert "Too many photos at once" in browser.find_element("id", "try-message").text


def test_the_trays_actions_from_the_dashboard(loaded: LiveServer, browser: Any) -> None:
    """Last in this file: it stops the server."""
    signed_in(browser, loaded)
    message = browser.find_element("id", "message")
    assert "do what the tray menu does" in browser.find_element("id", "powers").text
    with loaded.client() as http:
        def paused() -> bool:
            return bool(http.get("/v1/stats", headers={"X-Client-Id": "t"}).json()["paused"])

        browser.find_element("id", "pause").click()
        wait_until(lambda: paused() and message.text.startswith("Paused"))
        wait_until(lambda: browser.find_element("id", "pause").text == "Resume serving")
        browser.find_element("id", "pause").click()
        wait_until(lambda: not paused() and message.text == "Taking photos again.")

        browser.find_element("id", "reset").click()
        wait_until(lambda: message.text == "Peak reset.")

        browser.find_element("id", "report").click()
        wait_until(lambda: message.text.startswith("Saved the support report as "))
        assert message.get_attribute("data-report").endswith(".zip")

        unload = browser.find_element("css selector", f'#unloads button[data-model="{MODELS[1]}"]')
        assert unload.is_enabled()
        unload.click()
        wait_until(lambda: message.text == f"Unloaded {MODELS[1]}.")
        states = {m["name"]: m["state"] for m in http.get("/v1/models").json()["models"]}
        assert states[MODELS[1]] == "available", states
        wait_until(lambda: not browser.find_elements(
            "css selector", f'#unloads button[data-model="{MODELS[1]}"]'))

        stop = browser.find_element("id", "stop")
        stop.click()  # the first click only asks again
        assert stop.text == "Click again to stop vramguard"
        assert loaded.process.poll() is None
        stop.click()
        wait_until(lambda: message.text.startswith("vramguard is stopping"))
    assert loaded.process.wait(30) == 0
    wait_until(lambda: browser.find_element("id", "state").text == "not running")


def test_a_photo_dropped_or_picked_is_answered(server: LiveServer, browser: Any) -> None:
    browser.get(f"{server.url}/ui")
    wait_until(lambda: int(browser.find_element("id", "chart").get_attribute(
        "data-points")) >= 1)
    drop_file(browser, DATA / "coffee.jpg")
    wait_until(lambda: answer_of(browser)[0] == "ok")
    _, labels, timing = answer_of(browser)
    assert labels[0] == "espresso", labels
    assert timing.startswith("Answered in ") and "waiting and computing" in timing
    assert browser.find_element("id", "preview").get_attribute("src").startswith("blob:")
    assert browser.execute_script(  # the photo was shown (the page's policy allows blob:)
        "return document.getElementById('preview').naturalWidth") > 0

    browser.find_element("id", "pick").send_keys(str(DATA / "chelsea.jpg"))
    wait_until(lambda: answer_of(browser)[1][:1] != ["espresso"])
    assert any("cat" in label for label in answer_of(browser)[1][:2]), answer_of(browser)

    drop_file(browser, DATA / "README.md")
    wait_until(lambda: answer_of(browser)[0] == "bad_image")
    assert browser.find_element("id", "answer").is_displayed() is False
    assert browser.find_element("id", "try-message").text  # the server's own words


ATTACK = """<!doctype html><title>loading</title><body>
<iframe name="sink"></iframe>
<script>
(async () => {{
  const bytes = await (await fetch("coffee.jpg")).blob();
  const photo = new File([bytes], "coffee.jpg", {{type: "image/jpeg"}});
  const outcomes = [];
  for (const mode of ["cors", "no-cors"]) {{
    try {{
      const r = await fetch("{api}/v1/classify", {{method: "POST", mode, body: photo,
                                                  headers: {{"Content-Type": "image/jpeg"}}}});
      outcomes.push(mode + ":" + r.type + ":" + r.status);
    }} catch (error) {{ outcomes.push(mode + ":failed"); }}
  }}
  const form = document.createElement("form");
  form.method = "POST"; form.enctype = "multipart/form-data"; form.target = "sink";
  form.action = "{api}/v1/classify";
  const input = document.createElement("input");
  input.type = "file"; input.name = "file";
  const transfer = new DataTransfer(); transfer.items.add(photo); input.files = transfer.files;
  form.appendChild(input); document.body.appendChild(form); form.submit();
  document.title = "done " + outcomes.join(" ");
}})();
</script></body>"""


def test_a_page_on_another_site_cannot_send_photos_the_dashboards_way(
        tmp_path: Path, browser: Any, other_site: tuple[Path, str]) -> None:
    """What the try-it box does, from another site's page: a fetch in cors and in no-cors
    mode and a form upload (which no CORS rule stops). Each is refused before its upload
    is read: nothing is answered."""
    folder, site_url = other_site
    with live_server(tmp_path, "--no-cache") as running, running.client() as http:
        (folder / "coffee.jpg").write_bytes(photo())
        (folder / "attack.html").write_text(ATTACK.format(api=running.url))
        browser.get(f"{site_url}/attack.html")
        wait_until(lambda: browser.title.startswith("done"))
        outcomes = browser.title.split()[1:]
        assert outcomes == ["cors:failed", "no-cors:opaque:0"], outcomes

        def stats() -> dict[str, Any]:
            return dict(http.get("/v1/stats", headers={"X-Client-Id": "monitor"}).json())

        # the preflight of the cors fetch, the no-cors fetch and the form
        wait_until(lambda: stats()["requests"].get("forbidden", 0) >= 3)
        time.sleep(1)
        counted = stats()["requests"]
    assert counted == {"forbidden": 3}, counted  # nothing answered, nothing else tried
