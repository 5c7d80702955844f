"""The dashboard tests' Chromium lookup: a machine without Chromium skips them, CI fails them
(CI must run them; .ci/run installs chromium)."""

from __future__ import annotations

import pytest
from support import browser


@pytest.fixture
def no_chromium(monkeypatch):
    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    monkeypatch.setattr(browser.os.path, "exists", lambda path: False)


def test_without_chromium_ci_fails(no_chromium, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no chromium"):
        browser.chromium_binary()


def test_without_chromium_elsewhere_skips(no_chromium, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium"):
        browser.chromium_binary()
