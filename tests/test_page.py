"""The chat page at ``/`` in a real headless browser (Debian's chromium, driven by
selenium through its chromedriver): the API key typed in, a reply streaming in, a page
reloaded and a gateway killed mid-stream, the stop button. Each time the text the page
ends with must equal the reply the store holds, and the turn must have run once.

The gateway and projector use a database of their own with an API key in it (so auth
is on), fed from the simulated stack's log; the worker is the SIMULATED engine at 10
tokens/s, so a reply (64 tokens, "t0 t1 ...") takes about 6 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from infra.process import free_port
from pipeline.topics import PROMPTS
from projections.migrate import migrate
from schemas import PromptSubmitted
from tests.conftest import Service, Stack, new_database, start_service, wait_healthy
from tests.logread import read_events
from workers.sim_engine import sim_token_text

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
REPLY = "".join(sim_token_text(i) for i in range(64))  # the simulated engine's default
# Set to a path to save a screenshot of the page there (docs/chat-page.png is one).
SCREENSHOT = os.environ.get("PIPELINE_PAGE_SCREENSHOT")


@dataclass
class Site:
    stack: Stack
    url: str
    port: int
    key: str
    services: dict[str, Service]

    def start_gateway(self) -> Service:
        gateway = start_service(self.stack, "page-gateway", "gateway", "--port",
                                str(self.port), GATEWAY_MODELS="sim")
        self.services["gateway"] = gateway
        wait_healthy(self.url, list(self.services.values()), timeout=60)
        return gateway

    def stored(self, session: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/v1/sessions/{session}/messages", timeout=30,
                      headers={"Authorization": f"Bearer {self.key}"})
        assert r.status_code == 200, r.text
        return r.json()["data"]


@pytest.fixture(scope="module")
def site(sim_stack: Stack) -> Iterator[Site]:
    database_url = new_database(sim_stack.database_url, "page")
    migrate(database_url)
    stack = Stack(sim_stack.bootstrap, database_url, sim_stack.logs)
    made = subprocess.run([sys.executable, "-m", "launch", "keys", "create", "--tenant",
                           "page"], env=stack.env(), capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    port = free_port()
    s = Site(stack, f"http://127.0.0.1:{port}", port, made.stdout.strip(), {
        "projector": start_service(stack, "page-projector", "projector",
                                   PROJECTOR_GROUP="projector-page"),
        "worker": start_service(stack, "page-worker", "worker", "--engine", "sim",
                                WORKER_SIM_TOKENS_PER_S="10"),
    })
    try:
        s.start_gateway()
        yield s
    finally:
        for service in s.services.values():
            service.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), \
        "the page tests need Debian's chromium and chromium-driver (make test installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # Without the background-networking flags chromium keeps dialling Google's hosts,
    # which this closed network refuses.
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1200,760",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=ChromeService(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def script(driver: WebDriver, js: str) -> Any:
    return driver.execute_script(js)


def reply_text(driver: WebDriver) -> str:
    return script(driver, "const r = document.querySelector('#messages li.assistant:last-child');"
                          "return r ? r.textContent : '';")


def reply_state(driver: WebDriver) -> str | None:
    return script(driver, "const r = document.querySelector('#messages li.assistant:last-child');"
                          "return r ? r.dataset.state || null : null;")


def open_page(driver: WebDriver, site: Site) -> None:
    driver.get(site.url)
    until(lambda: script(driver, "return document.body.dataset.ready") == "true",
          "the page to load")


def signed_in(driver: WebDriver, site: Site) -> None:
    """The page, with the key already kept in the browser."""
    open_page(driver, site)
    script(driver, f"localStorage.setItem('pipeline.apiKey', '{site.key}')")
    open_page(driver, site)


def new_chat(driver: WebDriver, site: Site, prompt: str) -> str:
    """Start a new session on the page and send ``prompt``; the session's id."""
    signed_in(driver, site)
    driver.find_element(By.ID, "new-chat").click()
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    until(lambda: len(reply_text(driver).split()) >= 5, "the reply to stream in")
    return script(driver, "return localStorage.getItem('pipeline.session')")


def finished(driver: WebDriver, site: Site, session: str, timeout: float = 60) -> str:
    """Wait for the page's reply to end; check it is the stored one, run once; return it."""
    until(lambda: reply_state(driver) == "done", "the reply to end", timeout)
    shown = reply_text(driver)
    messages = until(lambda: [m for m in site.stored(session) if m["role"] == "assistant"],
                     "the reply to be stored")
    assert len(messages) == 1 and shown == messages[0]["content"]
    prompts = [e for _, e in read_events(site.stack.bootstrap, PROMPTS)
               if isinstance(e, PromptSubmitted) and str(e.conversation_id) == session]
    assert len(prompts) == 1  # sent again after the reload or the restart: one turn
    assert script(driver, "return localStorage.getItem('pipeline.turn')") is None
    return shown


def test_the_page_asks_for_the_key_and_keeps_it(site: Site, browser: WebDriver) -> None:
    open_page(browser, site)
    script(browser, "localStorage.clear()")
    open_page(browser, site)
    until(lambda: "API key" in browser.find_element(By.ID, "status").text,
          "the page to ask for a key")
    browser.find_element(By.ID, "api-key").send_keys(site.key)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    until(lambda: [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
          == ["sim"], "the models to be listed")
    open_page(browser, site)  # kept in the browser
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == site.key
    assert browser.find_element(By.ID, "status").text == ""


def test_a_reply_survives_a_reload_mid_stream(site: Site, browser: WebDriver) -> None:
    session = new_chat(browser, site, "Survive a reload")
    before = reply_text(browser)
    browser.refresh()
    until(lambda: reply_text(browser).startswith(before), "the page to show what it had")
    assert finished(browser, site, session) == REPLY
    user = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#messages li.user")]
    assert user == ["Survive a reload"]
    until(lambda: "Survive a reload" in browser.find_element(By.ID, "sessions").text,
          "the session to be listed under its title")
    if SCREENSHOT:
        browser.save_screenshot(SCREENSHOT)


def test_a_reply_survives_a_gateway_restart_mid_stream(site: Site, browser: WebDriver) -> None:
    session = new_chat(browser, site, "Survive a restart")
    site.services["gateway"].kill()  # SIGKILL: the stream breaks with no goodbye
    until(lambda: "reconnecting" in browser.find_element(By.ID, "status").text,
          "the page to notice")
    site.start_gateway()
    assert finished(browser, site, session) == REPLY


def test_stop_ends_the_reply_where_the_store_ends_it(site: Site, browser: WebDriver) -> None:
    session = new_chat(browser, site, "Stop early")
    browser.find_element(By.ID, "stop").click()
    shown = finished(browser, site, session)
    assert REPLY.startswith(shown) and len(shown) < len(REPLY)


def test_a_failed_turn_shows_its_error_once_and_the_page_stops(site: Site,
                                                               browser: WebDriver) -> None:
    """A turn the engine refuses (longer than the simulated model's 8,192 tokens) ends
    with an error in its stream. The page took that for a dropped connection and
    reconnected forever, reading the same error each time; it shows it once and stops."""
    signed_in(browser, site)
    browser.find_element(By.ID, "new-chat").click()
    script(browser, "document.getElementById('prompt').value = 'x '.repeat(8200);")
    browser.find_element(By.ID, "send").click()
    until(lambda: reply_state(browser) == "done", "the failed turn to end", 60)
    shown = reply_text(browser)
    assert shown.count("maximum context length") == 1, shown
    time.sleep(2)  # no reconnecting afterwards
    assert "reconnecting" not in browser.find_element(By.ID, "status").text
    assert reply_text(browser) == shown
