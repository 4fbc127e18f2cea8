"""Pytest's side of the browser tests (tests/test_chat_page*.py): Playwright and
Debian's Chromium, skipped where they are missing, except in CI, where a
missing browser fails the run (.ci/run installs it)."""

from __future__ import annotations

import os

import pytest

from bench.browser import CHROMIUM, launch

IN_CI = bool(os.environ.get("CI"))


def _missing(reason: str):
    if IN_CI:
        pytest.fail(f"{reason}: the browser tests must run in CI (.ci/run installs Chromium with apt)", pytrace=False)
    pytest.skip(reason)


def start_browser():
    """(playwright, browser); the caller stops both."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (the test extra has it)")
    if not os.path.exists(CHROMIUM):
        _missing(f"{CHROMIUM} is missing (apt-get install chromium)")
    pw = sync_playwright().start()
    try:
        return pw, launch(pw)
    except Exception:
        pw.stop()
        raise


def fill_setting(page, field: str, value) -> None:
    """Set one of the conversation's settings through the settings panel."""
    if page.locator("#settings").is_hidden():
        page.click("#toggle-settings")
    page.fill(f"#{field}", str(value))
    page.press(f"#{field}", "Tab")  # 'change' fires on leaving the field
    page.click("#toggle-settings")


def ask(page, text: str) -> None:
    """Type ``text`` in the composer and press Enter."""
    page.fill("#input", text)
    page.press("#input", "Enter")
