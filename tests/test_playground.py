"""The web playground: its run endpoint refuses every page but its own, and the page works in a real browser.

The browser checks drive Debian's `chromium` through `chromedriver` with selenium (`make test` installs them
with apt where it can). `HORIZON_SCREENSHOT=path` makes the browser run also write the README's screenshot
(`make screenshot`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest
from PIL import Image

from horizon.server.playground import PlaygroundSettings

from .live import LiveServer, engine_requests

BUDGETS = {"thinking_budgets": {"low": 6, "high": 12}}  # the random model never stops thinking by itself


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    (root / "note.txt").write_text("<script>window.pwned = 1</script> a file's text")
    # the screenshot shows the bundled model (it answers); the tests run on the random one (it never changes)
    model = "bundled" if os.environ.get("HORIZON_SCREENSHOT") else "tiny-random"
    with LiveServer(tmp_path_factory.mktemp("keys"), api_key=None, generation_config=BUDGETS,
                    playground=PlaygroundSettings(str(root)), model=model) as srv:
        srv.tmp = root
        yield srv


def page_token(srv) -> str:
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    return re.search(r'name="horizon-csrf" content="([^"]+)"', page.text).group(1)


RUN = {"content": "hi", "max_tokens": 4, "temperature": 0}


# --- the run endpoint trusts only its own page ------------------------------------------------------------------
def test_cross_origin_missing_token_and_rebinding_are_refused_before_anything_runs(server):
    token = page_token(server)
    cases = {
        "cross-origin": {"origin": "http://evil.example", "x-horizon-csrf": token},
        "no origin": {"x-horizon-csrf": token},
        "no token": {"origin": server.url},
        "forged token": {"origin": server.url, "x-horizon-csrf": token.split(".")[0] + ".00"},
        # DNS rebinding: the attacker's name resolves to 127.0.0.1, so Host and Origin agree, on its name
        "rebinding": {"host": f"evil.example:{server.port}", "origin": f"http://evil.example:{server.port}",
                      "x-horizon-csrf": token},
    }
    with engine_requests(server) as seen:
        for name, headers in cases.items():
            r = httpx.post(server.url + "/playground/run", json=RUN, headers=headers)
            assert r.status_code == 403, name
            assert r.json()["error"]["type"] == "permission_error"
        assert seen == []  # nothing reached the engine
        ok = httpx.post(server.url + "/playground/run", json=RUN, headers={"origin": server.url,
                                                                          "x-horizon-csrf": token})
        assert ok.status_code == 200 and "event: history" in ok.text and len(seen) == 1


def test_the_run_endpoint_streams_the_history_as_the_api_returns_it(server):
    token = page_token(server)
    body = {**RUN, "tools": ["calculator"], "tool_choice": "required", "tier": "low", "max_tokens": 64,
            "max_steps": 2}
    r = httpx.post(server.url + "/playground/run", json=body, headers={"origin": server.url,
                                                                      "x-horizon-csrf": token}, timeout=120)
    events = [(m.group(1), json.loads(m.group(2))) for m in re.finditer(r"event: (\w+)\ndata: (.*)\n", r.text)]
    kinds = [k for k, _ in events]
    assert kinds[0] == "step" and "thinking" in kinds and "tool_call" in kinds and "tool_result" in kinds
    history = events[-1][1]["messages"]
    assert history[1]["role"] == "assistant" and history[1]["tool_calls"] and history[2]["role"] == "tool"
    # what the page exports is accepted back by the API, as a client would send it
    again = httpx.post(server.url + "/v1/chat/completions", json={"model": server.service.model_id,
                                                                   "messages": history + [{"role": "user",
                                                                                           "content": "and?"}],
                                                                   "max_tokens": 4, "reasoning_effort": "low"})
    assert again.status_code == 200, again.text
    # the files tool is confined to the root; shell is never offered
    refused = httpx.post(server.url + "/playground/run", json={**RUN, "tools": ["shell"]},
                         headers={"origin": server.url, "x-horizon-csrf": token})
    assert refused.status_code == 400


def test_pages_that_leave_at_once_hold_no_run_slot(server):
    from horizon.server.playground import MAX_RUNS

    token = page_token(server)
    headers = {"origin": server.url, "x-horizon-csrf": token}
    for _ in range(2 * MAX_RUNS):  # each leaves before reading a byte
        with httpx.stream("POST", server.url + "/playground/run", json={**RUN, "max_tokens": 64},
                          headers=headers) as r:
            assert r.status_code == 200
    for _ in range(100):  # the abandoned runs' threads end as soon as their cancelled steps come back
        ok = httpx.post(server.url + "/playground/run", json=RUN, headers=headers, timeout=60)
        if "runs are going already" not in ok.text:
            break
        time.sleep(0.05)
    assert "event: history" in ok.text  # every slot came back


def test_with_api_keys_the_run_needs_one_and_no_playground_means_no_page(tmp_path):
    with LiveServer(tmp_path, api_key="sekret", playground=PlaygroundSettings()) as srv:
        token = page_token(srv)
        assert 'name="horizon-auth" content="on"' in httpx.get(srv.url + "/").text
        headers = {"origin": srv.url, "x-horizon-csrf": token}
        assert httpx.post(srv.url + "/playground/run", json=RUN, headers=headers).status_code == 401
        ok = httpx.post(srv.url + "/playground/run", json=RUN, headers={**headers, "authorization": "Bearer sekret"})
        assert ok.status_code == 200
    with LiveServer(tmp_path, api_key=None) as srv:  # the app without the playground
        assert httpx.get(srv.url + "/").status_code == 404
        assert httpx.post(srv.url + "/playground/run", json=RUN).status_code == 404


# --- the page in a real browser ------------------------------------------------------------------------------
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("chromium and chromedriver are not installed (make test installs them with apt as root)")
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                 "--disable-gpu"):
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver))


def test_the_page_thinks_calls_tools_switches_tiers_exports_and_never_runs_model_html(server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser()
    wait = WebDriverWait(driver, 60)

    def turns_done() -> int:
        return len(driver.find_elements(By.CSS_SELECTOR, "#log .note.done"))

    def send(text: str) -> None:
        before = turns_done()
        box = driver.find_element(By.ID, "message")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)  # Enter sends
        wait.until(lambda d: turns_done() > before)

    def setting(id_: str, value: str) -> None:
        field = driver.find_element(By.ID, id_)
        field.clear()
        field.send_keys(value)

    try:
        driver.get(server.url + "/")
        wait.until(lambda d: d.switch_to.active_element.get_attribute("id") == "message")  # the input has focus
        setting("max-tokens", "16")
        setting("temperature", "0")

        # 1. tier low: thinking, then an answer, streamed into the page
        Select(driver.find_element(By.ID, "tier")).select_by_value("low")
        send("hello there")
        step = driver.find_elements(By.CSS_SELECTOR, "#log .turn.assistant")[-1]
        assert step.find_element(By.CSS_SELECTOR, ".thinking").text
        assert step.find_element(By.CSS_SELECTOR, ".answer").text
        assert "thinking 6" in step.find_element(By.CSS_SELECTOR, ".usage").text  # the tier's budget
        toggle = step.find_element(By.CSS_SELECTOR, "button.think-toggle")
        assert toggle.get_attribute("aria-label") and toggle.get_attribute("aria-expanded") == "true"
        toggle.click()
        assert toggle.get_attribute("aria-expanded") == "false"
        assert not step.find_element(By.CSS_SELECTOR, ".thinking").is_displayed()

        # 2. a calculator turn (greedy, the first step forced to call): the call and its result appear
        driver.find_element(By.ID, "tool-calculator").click()
        Select(driver.find_element(By.ID, "tool-choice")).select_by_value("required")
        setting("max-tokens", "64")
        send("what is 6 * 7?")
        assert driver.find_elements(By.CSS_SELECTOR, "#log .call .name")[-1].text.startswith("calculator(")
        assert driver.find_elements(By.CSS_SELECTOR, "#log .result pre")[-1].text
        driver.find_element(By.ID, "tool-calculator").click()
        Select(driver.find_element(By.ID, "tool-choice")).select_by_value("auto")

        # 3. switch the tier off for the next message, with an image attached: no thinking in that step, and
        # the image went in as an image part (its placeholder tokens are in the prompt)
        Select(driver.find_element(By.ID, "tier")).select_by_value("")
        setting("max-tokens", "8")
        picture = server.tmp / "red.png"
        Image.new("RGB", (32, 32), (200, 30, 30)).save(picture)
        driver.find_element(By.ID, "image").send_keys(str(picture))
        with engine_requests(server) as seen:
            send("and now without thinking")
        assert seen and seen[0].images and len(seen[0].images) == 1
        assert driver.find_elements(By.CSS_SELECTOR, "#log .turn.user .who")[-1].text.endswith("thinking none")
        last = driver.find_elements(By.CSS_SELECTOR, "#log .turn.assistant")[-1]
        assert not last.find_elements(By.CSS_SELECTOR, ".thinking") and last.find_element(By.CSS_SELECTOR,
                                                                                           ".answer").text

        if os.environ.get("HORIZON_SCREENSHOT"):  # `make screenshot`: the README's picture, from this run
            driver.execute_script("window.scrollTo(0, 0)")
            driver.save_screenshot(os.environ["HORIZON_SCREENSHOT"])

        # 4. model output that is HTML stays text: a JSON-schema answer forced to be markup
        markup = '<img src=x onerror="window.pwned=1"><script>window.pwned=1</script>'
        driver.find_element(By.ID, "json-mode").click()
        setting("schema", json.dumps({"type": "string", "enum": [markup]}))
        setting("max-tokens", "64")
        send("say it")
        answer = driver.find_elements(By.CSS_SELECTOR, "#log .turn.assistant .answer")[-1].text
        assert "<script>window.pwned=1</script>" in answer
        assert driver.execute_script("return window.pwned") is None
        assert not driver.find_elements(By.CSS_SELECTOR, "#log script, #log img")
        driver.find_element(By.ID, "json-mode").click()

        # 5. export, and send the conversation back to the API: accepted, full history
        driver.find_element(By.ID, "export").click()
        exported = json.loads(driver.find_element(By.ID, "export-json").text)
        roles = [m["role"] for m in exported["messages"]]
        assert roles.count("user") == 4 and "tool" in roles
        assert any(p.get("type") == "image_url" for m in exported["messages"] if isinstance(m["content"], list)
                   for p in m["content"])
        r = httpx.post(server.url + "/v1/chat/completions", json={**exported, "max_tokens": 4,
                                                                  "messages": exported["messages"] + [
                                                                      {"role": "user", "content": "thanks"}]})
        assert r.status_code == 200, r.text
    finally:
        driver.quit()
