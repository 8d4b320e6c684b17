"""A live loraplex server (tiny model, embedded engine, SQLite) and headless Chromium driven by Playwright."""

from __future__ import annotations

import shutil
import socket
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"


@dataclass
class LiveConsole:
    url: str
    admin_key: str
    adapter_zip: Path
    app: object


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_console(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveConsole]:
    import uvicorn

    from loraplex.config import Settings
    from loraplex.platform.app import create_app
    from loraplex.platform.db import session_scope
    from loraplex.platform.tenants import create_admin_key
    from loraplex.testing import make_peft_adapter

    work = tmp_path_factory.mktemp("browser")
    adapter_dir = make_peft_adapter(tiny_llama_dir, work / "adapter", r=4, seed=3)
    adapter_zip = work / "sql-helper.zip"
    with zipfile.ZipFile(adapter_zip, "w") as zf:
        for f in sorted(adapter_dir.iterdir()):
            if f.is_file():
                zf.write(f, f.name)
    settings = Settings(
        environment="test", secret_key="browser-test-secret-0123456789", data_dir=work / "data",
        model=str(tiny_llama_dir), served_model_name="tiny-llama", kv_cache_memory=8 * 1024 * 1024,
        max_num_seqs=8, max_loras=2, max_cpu_loras=4, max_lora_rank=16, usage_flush_interval=0.1,
        warm_adapters_interval=0,
    )
    app = create_app(settings)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                          timeout_keep_alive=75))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # a start-up wait, not a speed check
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.05)
    with session_scope(app.state.services.sessions) as session:
        _, admin_key = create_admin_key(session, settings)
    try:
        yield LiveConsole(f"http://127.0.0.1:{port}", admin_key, adapter_zip, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1366, "height": 768}, device_scale_factor=1)
    external: list[str] = []

    def local_only(route) -> None:
        # the console must work offline: any request off this machine is refused and remembered
        url = route.request.url
        if url.startswith(("http://127.0.0.1:", "data:", "blob:")):
            route.continue_()
        else:
            external.append(url)
            route.abort()

    context.route("**/*", local_only)
    pg = context.new_page()
    pg.external_requests = external
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # refused requests (a wrong sign-in is a 401) show up as console errors too; only script errors count
    pg.on("console", lambda msg: errors.append(msg.text)
          if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    pg.js_errors = errors
    try:
        yield pg
    finally:
        context.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
