"""Run one comparison in a headless browser and save a screenshot of the demo.

``python demo/screenshot.py --model tiny-llada --out demo/screenshot.png`` retakes the README's
picture (e.g. once the embedded weights are trained); ``tests/test_demo.py`` uses
:func:`capture` against the app it serves. It drives Debian's ``chromium`` through Playwright and
never lets Playwright download a browser of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger("hf_blockbatch.demo.screenshot")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
DEFAULT_PROMPT = "A toy costs 5 dollars and a pen costs 6 dollars. Ben buys 3 toys and one pen. How many dollars does he spend?"


def find_chromium() -> str | None:
    """Debian's chromium (``HF_BLOCKBATCH_CHROMIUM`` overrides), or None when absent."""
    for candidate in (
        os.environ.get("HF_BLOCKBATCH_CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def capture(url: str, out: str | os.PathLike[str], prompt: str = DEFAULT_PROMPT, speed: str = "fast",
            width: int = 1440, height: int | None = 1335) -> dict[str, int | str]:  # fmt: skip
    """Open ``url``, run one comparison, wait for a live replay frame and then the final one, save
    the page (cropped to ``height`` pixels, the part with both answers; None: the full page).
    Returns what the page showed: the number of branch lanes and the banner's text."""
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install -y chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 1000})
            page.goto(url)
            page.get_by_label("Prompt").fill(prompt)
            page.get_by_text(speed, exact=True).click()
            page.get_by_role("button", name="Decode both ▶").click()
            page.wait_for_selector(".bb-chip.new", timeout=120_000)  # a replay frame: one forward's commits
            page.wait_for_selector(".bb-banner .big", timeout=300_000)  # the final frame's headline
            page.wait_for_timeout(400)  # the last chips' pop animation
            clip = {"x": 0, "y": 0, "width": width, "height": height} if height else None
            page.screenshot(path=str(out), full_page=True, clip=clip)
            return {"lanes": page.locator(".bb-lane").count(), "banner": page.inner_text(".bb-banner"),
                    "fast_chips": page.locator(".bb-side.fd .bb-chip").count()}  # fmt: skip
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llada", help="as for the app")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "screenshot.png"))
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--speed", default="normal", choices=["slow", "normal", "fast", "instant"])
    parser.add_argument(
        "--full-page", action="store_true", help="the whole page, not only down to the answers"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import app  # the module beside this file, as the Space runs it

    loaded = app.load_for_demo(args.model)
    demo = app.build_demo(loaded)
    _, url, _ = app.launch_demo(demo, server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        shown = capture(url, args.out, args.prompt, args.speed, height=None if args.full_page else 1335)
    finally:
        demo.close()
    logger.info("saved %s (%s)", args.out, shown["banner"].splitlines()[0] if shown["banner"] else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
