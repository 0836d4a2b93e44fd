"""The /admin page in a real headless browser (Debian's chromium and chromium-driver, driven
by Selenium) against a real gateway in front of simulated replicas: the admin key asked for
and refused, the numbers it shows against /admin/stats, the charts against /admin/history,
and the page following traffic as it flows.

`PREFIX_GATEWAY_SCREENSHOT=docs/admin-page.png` also writes the screenshot the docs show,
after a whole chart window (a minute) of traffic."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway import processes
from gateway.config import key_digest
from tests.conftest import poll, start_gateway, start_sims, tenant_prompt, two_pool_config

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
ADMIN = "admin-key-for-the-page-test"
REASONS = {"affinity", "cold", "overflow", "hash", "least_load", "round_robin"}

# CI installs both (.ci/run); elsewhere the test says what is missing.
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER) and not os.environ.get("CI"),
    reason="needs Debian's chromium and chromium-driver (bash .ci/install-chromium.sh)")


@pytest.fixture
def browser() -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1700", "--lang=en-GB"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER or "chromedriver"))
    try:
        yield driver
    finally:
        driver.quit()


def _traffic(url: str, done: threading.Event, worker: int) -> None:
    """Requests of a few tenants to both pools, some streamed, until `done`."""
    with httpx.Client(base_url=url, timeout=30) as client:
        i = 0
        while not done.is_set():
            tenant = (i * 7 + worker) % 5 + 5 * (i // 150)  # new tenants now and then
            body = {"model": "tiny", "max_tokens": 8, "stream": i % 3 == 0,
                    "messages": [{"role": "system", "content": tenant_prompt(tenant)},
                                 {"role": "user", "content": f"question {i}"}]}
            headers = {"x-traffic-class": "batch"} if i % 4 == 3 else {}
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            i += 1


def _alert(driver, deadline_s: float = 20.0):
    def find():
        try:
            return driver.switch_to.alert
        except Exception:  # NoAlertPresentException, until the page asks
            return None
    return poll(find, deadline_s)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None) -> str:
    """As JavaScript writes a number: 3.0 as 3."""
    return "–" if v is None else str(int(v)) if v == int(v) else repr(v)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{1000 * v:.1f} ms"


# The page draws itself again at each refresh: what a test reads, it reads in one script,
# never through elements that the next refresh replaces.
_SHOWN = """
const out = {};
for (const row of document.querySelectorAll("tr[data-replica]")) {
  const cells = {};
  for (const c of row.querySelectorAll("td[data-field]")) {
    cells[c.dataset.field] = c.textContent.trim();
  }
  out[row.dataset.replica] = cells;
}
return out;"""


def _shown(driver) -> dict[str, dict[str, str]]:
    """Replica -> field -> the text the page shows in its replica tables."""
    return driver.execute_script(_SHOWN)


def _expected(stats: dict) -> dict[str, dict[str, str]]:
    """The same, as /admin/stats has it, formatted as the page formats it."""
    out = {}
    for pool in stats["pools"]:
        for r in pool["replicas"]:
            out[r["name"]] = {
                "name": r["name"] + (" draining" if r["draining"] else ""),
                "engine_waiting": _num(r["engine_waiting"]),
                "engine_kv_usage": _pct(r["engine_kv_usage"]),
                "engine_step_s": _ms(r["engine_step_s"]), "speed": f"{r['speed']:.2f}",
                "healthy": "yes" if r["healthy"] else "NO", "inflight": str(r["inflight"]),
                "requests": str(r["requests"]), "errors": str(r["errors"]),
                "estimated_hit_ratio": _pct(r["estimated_hit_ratio"]),
                "engine_hit_ratio": _pct(r["engine_hit_ratio"]),
                "ttft_p50_s": _ms(r["ttft_p50_s"]), "ttft_p95_s": _ms(r["ttft_p95_s"]),
                "index_blocks": f"{r['index_blocks']} / {r['index_capacity_blocks']}"}
    return out


def _points(driver, pool: str, chart: str, series: str) -> list[tuple[float, float]]:
    """The data points of one series of one of a pool's charts, in SVG coordinates."""
    points = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(l => l.getAttribute('points'))"
        ".join(' ')", f'.charts[data-pool="{pool}"] svg[data-chart="{chart}"] '
                      f'polyline[data-series="{series}"]')
    return [tuple(map(float, p.split(","))) for p in points.split()]


def _decisions(driver) -> list[dict[str, str]]:
    return driver.execute_script("""
        return [...document.querySelectorAll("tr.decision")].map(r => ({
          replica: r.querySelector('[data-field="replica"]').textContent,
          reason: r.querySelector('[data-field="reason"]').textContent}));""")


def test_admin_page_in_a_browser(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    sims = start_sims(["vllm", "vllm", "vllm", "trtllm", "trtllm"], tmp_path)
    try:
        cfg = two_pool_config(sims.urls[:3], sims.urls[3:], processes.free_ports(1)[0])
        cfg["auth"] = {"admin_keys": [{"name": "ops", "key": key_digest(ADMIN)}]}
        cfg["history"] = {"interval_s": 0.5, "window_s": 60, "decisions": 20}
        gw = start_gateway(cfg, tmp_path)
    except Exception:
        sims.stop()
        raise
    admin = {"Authorization": f"Bearer {ADMIN}"}
    done = threading.Event()
    workers = [threading.Thread(target=_traffic, args=(gw.url, done, w)) for w in range(2)]
    try:
        # Without the key: asked for it, shown nothing.
        browser.get(gw.url + "/admin?refresh=0.5")
        _alert(browser).dismiss()
        error = poll(lambda: browser.find_elements(By.ID, "error"))[0]
        assert "admin key is needed" in error.text
        assert not browser.find_elements(By.CSS_SELECTOR, "section.pool, svg, tr[data-replica]")
        assert "rt-0" not in browser.find_element(By.TAG_NAME, "body").text

        # A wrong key is refused and asked for again; the right one opens the page.
        browser.find_element(By.ID, "ask-key").click()
        wrong = _alert(browser)
        wrong.send_keys("not-the-key")
        wrong.accept()
        again = _alert(browser)
        assert "refused" in again.text
        again.send_keys(ADMIN)
        again.accept()
        poll(lambda: len(browser.find_elements(By.CSS_SELECTOR, "section.pool")) == 2, 20)
        assert set(_shown(browser)) == {"rt-0", "rt-1", "rt-2", "bt-0", "bt-1"}
        # Exact ties are written as the CLI writes them (toFixed alone gave 97.3% for 97.2%).
        ties = [0.9725, 0.9735, 0.00125, 0.5]
        assert browser.execute_script(
            "return arguments[0].map(v => [pct(v), ms(v)])", ties) == [
                [_pct(v), _ms(v)] for v in ties]

        # Under traffic, the tables, the charts and the decisions follow.
        for w in workers:
            w.start()

        def requests_shown() -> int:
            return sum(int(r.get("requests") or 0) for r in _shown(browser).values())

        first = poll(requests_shown, 30)
        poll(lambda: requests_shown() > first, 30)  # it updates as traffic flows
        poll(lambda: any(y < 96 for _, y in _points(browser, "realtime", "rate", "requests")),
             30)  # a point above the baseline (y=96 is zero: the chart is 110 high)
        poll(lambda: len(_points(browser, "realtime", "share", "rt-0")) >= 3, 30)
        rows = poll(lambda: _decisions(browser), 30)
        assert {r["reason"] for r in rows} <= REASONS
        assert {r["replica"] for r in rows} <= {"rt-0", "rt-1", "rt-2", "bt-0", "bt-1"}
        if os.environ.get("PREFIX_GATEWAY_SCREENSHOT"):
            # For the docs: a whole window of traffic on the charts.
            poll(lambda: browser.execute_script(
                "return +document.getElementById('updated').dataset.samples") >= 120, 180)
        shot = tmp_path / "admin.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("PREFIX_GATEWAY_SCREENSHOT"):
            shutil.copy(shot, os.environ["PREFIX_GATEWAY_SCREENSHOT"])
    finally:
        done.set()
        for w in workers:
            if w.is_alive():
                w.join(timeout=60)
    try:
        # Traffic stopped: the numbers shown are /admin/stats's.
        seen: list = []

        def matches() -> bool:
            stats = httpx.get(gw.url + "/admin/stats", headers=admin, timeout=10).json()
            seen[:] = [_shown(browser), _expected(stats)]
            return seen[0] == seen[1]

        try:
            poll(matches, 30, interval_s=0.2)
        except AssertionError:
            raise AssertionError(f"the page shows {seen[0]}, /admin/stats says {seen[1]}") \
                from None
        stats = httpx.get(gw.url + "/admin/stats", headers=admin, timeout=10).json()
        assert sum(r["requests"] for p in stats["pools"] for r in p["replicas"]) > 0

        # Each sample the page holds is a point of the rate chart, taken from /admin/history.
        history = httpx.get(gw.url + "/admin/history", headers=admin, timeout=10).json()
        assert history["samples"] and history["max_samples"] == 120
        assert any(p["requests"] for s in history["samples"] for p in s["pools"])
        held = 0

        def drawn() -> bool:
            nonlocal held
            held, points = browser.execute_script(
                "return [+document.getElementById('updated').dataset.samples, "
                "[...document.querySelectorAll('.charts[data-pool=\"batch\"] "
                "svg[data-chart=\"rate\"] polyline[data-series=\"requests\"]')]"
                ".map(l => l.getAttribute('points').split(' ').length)"
                ".reduce((a, b) => a + b, 0)]")
            return held and points == held

        poll(drawn, 10, interval_s=0.1)
        assert 2 <= held <= history["max_samples"]
    finally:
        gw.stop()
        sims.stop()


_EXPERIMENTS = """
return [...document.querySelectorAll("section.experiment")].map(s => ({
  name: s.dataset.experiment,
  title: s.querySelector('[data-field="title"]').textContent.replace(/\\s+/g, " ").trim(),
  rows: [...s.querySelectorAll("tr[data-row]")].map(r => [r.dataset.row,
    r.querySelector('[data-arm="baseline"]').textContent,
    r.querySelector('[data-arm="candidate"]').textContent]),
  lines: [...s.querySelectorAll("p[data-field]")].map(p => p.textContent.trim()),
  conditions: [...s.querySelectorAll(".conditions li")].map(li => li.textContent)}));"""


def test_experiments_section_matches_the_cli(browser) -> None:
    """The page against a stub admin API serving fixed experiments (tests/admin_stub.py): each
    figure written as `prefix-gateway experiments` writes it, hidden without experiments."""
    from gateway.experiments.report import arm_rows, render_report
    from tests.admin_stub import STATIC, admin_stub, experiments_body

    body = experiments_body()
    routes = {"/admin": (STATIC / "stats.html").read_text(),
              "/admin/stats": {"pools": [], "admission": {"classes": [], "pools": []}},
              "/admin/history": {"samples": [], "recent_decisions": [], "interval_s": 1,
                                 "window_s": 60, "max_samples": 120},
              "/admin/experiments": body}
    with admin_stub(routes) as url:
        browser.get(url + "/admin?refresh=0.5")
        shown = poll(lambda: browser.execute_script(_EXPERIMENTS), 20)
        # Every line the page shows is a line of the CLI's report, and the arms' rows are
        # its rows (the CLI pads its columns; the page puts them in cells).
        report = render_report(body).splitlines()
        assert [s["name"] for s in shown] == ["llama-vs-qwen", "trtllm-split"]
        for exp, page in zip(body["experiments"], shown, strict=True):
            assert page["title"] in report
            assert [tuple(r) for r in page["rows"]] == arm_rows(exp)
            for line in page["lines"] + page["conditions"]:
                assert any(r.strip() == line for r in report), line
        mirror = shown[0]
        assert len(mirror["lines"]) == 4 and len(mirror["conditions"]) == 4
        assert ("engine prefix-cache hit", "41.2%", "55.0%") in map(tuple, mirror["rows"])  # a tie
        # Exact ties, positive and negative, round as Python's format does.
        ties = [0.00125, -0.00125, 0.0625, -0.0625, 0.6125, 0.9725, 2.5e-4, -0.0, 1.0]
        assert browser.execute_script(
            "return arguments[0].map(v => [X.ms(v), X.sms(v), X.pct(v), X.num(v, 0), "
            "X.num(v, 2), X.num(1000 * v)])", ties) == [
                [f"{1000 * v:.1f} ms", f"{1000 * v:+.1f} ms", f"{100 * v:.1f}%", f"{v:.0f}",
                 f"{v:.2f}", f"{1000 * v:.1f}"] for v in ties]
        # No experiments, then a gateway without the endpoint: the section is gone.
        routes["/admin/experiments"] = {"experiments": []}
        poll(lambda: not browser.execute_script(
            "return document.getElementById('experiments').innerHTML"), 20)
        routes["/admin/experiments"] = body
        poll(lambda: browser.execute_script(_EXPERIMENTS), 20)
        del routes["/admin/experiments"]
        poll(lambda: not browser.execute_script(
            "return document.getElementById('experiments').innerHTML"), 20)
        assert not browser.find_elements("id", "error")
