"""The chat page at / in headless Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium):
a typed message gets a streamed reply equal to `llm.chat` with its speed and the FFN neurons computed
under it (the engine's own count), the header says where the model runs, and the stop button ends a
generation. A hybrid model's reply also says how many of those neurons ran on the GPU."""

from __future__ import annotations

import shutil

import pytest

from hotcold.runtime.engine import Engine
from hotcold.server.app import create_app
from hotcold.server.scheduler import Scheduler
from tests.server.conftest import SlowModel, off_main_thread, running

WAIT_S = 60
FIRST = "Tell me about the fox."


@pytest.fixture
def browser(tmp_path):
    pytest.importorskip(
        "selenium", reason="the chat page test drives Chromium with selenium (pip install selenium)"
    )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("needs Chromium and its driver: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def test_chat_page_streams_a_reply_and_stops(browser, llm):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    first = [{"role": "user", "content": FIRST}]
    chunks = off_main_thread(lambda: list(llm.stream_chunks(llm.chat_prompt_ids(first), max_tokens=12)))
    expected, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
    assert expected == off_main_thread(llm.chat, first, max_tokens=12, temperature=0.0)
    assert expected  # the check below means something only if the model says anything
    # 30 ms per token so the reply arrives in many pieces and the stop button has time to act
    engine = Engine(SlowModel(llm.loaded.model, 0.03), llm.tokenizer, llm.ctx_size)
    scheduler = Scheduler([engine])
    with running(create_app(llm, scheduler=scheduler)) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        for field, value in (("temperature", "0"), ("max-tokens", "12")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        browser.find_element(By.ID, "input").send_keys(FIRST, Keys.ENTER)
        reply = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-finish]"))[0]
        assert reply.get_attribute("data-finish") == finish
        assert reply.get_property("textContent") == expected
        assert int(reply.get_attribute("data-chunks")) > 1  # streamed, not delivered at once
        figures = browser.find_element(By.CSS_SELECTOR, ".msg.assistant + .figures")
        assert (
            int(figures.get_attribute("data-computed")) == engine.seq.neuron_totals()[0]
        )  # its only request
        assert (
            float(figures.get_attribute("data-tps")) > 0
            and float(figures.get_attribute("data-prompt-tps")) > 0
        )
        text = figures.get_property("textContent")
        assert "tokens/s" in text and "prompt" in text and "FFN neurons computed" in text
        assert "GPU" not in text and figures.get_attribute("data-gpu-share") == ""
        assert "CPU only" in browser.find_element(By.ID, "placement").get_property("textContent")
        assert browser.find_element(By.CSS_SELECTOR, ".msg.user").get_property("textContent") == FIRST

        # a long reply, stopped after its first pieces: the page says so and the server frees the slot
        box = browser.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys("200")
        browser.find_element(By.ID, "input").send_keys("And then?", Keys.ENTER)

        def second(d, attribute: str) -> str | None:
            replies = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
            return replies[1].get_attribute(attribute) if len(replies) > 1 else None

        wait.until(lambda d: int(second(d, "data-chunks") or 0) >= 2)
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda d: second(d, "data-finish"))
        assert second(browser, "data-finish") == "stopped"
        wait.until(lambda d: scheduler.cancelled == 1 and scheduler.busy == 0)


def test_chat_page_shows_the_share_on_the_gpu_for_a_hybrid_model(browser, hybrid_llm):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    engine = Engine(hybrid_llm.loaded.model, hybrid_llm.tokenizer, hybrid_llm.ctx_size)
    with running(create_app(hybrid_llm, scheduler=Scheduler([engine]))) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, WAIT_S)
        box = browser.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys("6")
        browser.find_element(By.ID, "input").send_keys(FIRST, Keys.ENTER)
        figures = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant + .figures"))[0]
        share = engine.seq.hot_total() / engine.seq.neuron_totals()[0]
        assert 0 < share < 1
        assert float(figures.get_attribute("data-gpu-share")) == pytest.approx(share)
        assert f"{100 * share:.1f}% of them on the GPU" in figures.get_property("textContent")
        header = wait.until(lambda d: d.find_element(By.ID, "placement").get_property("textContent"))
        assert "of FFN neurons hot on" in header
