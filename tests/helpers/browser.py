"""The browser the UI tests drive: Debian's chromium, through Playwright."""
from __future__ import annotations

import os
from pathlib import Path

CHROMIUM = Path(os.environ.get("EDGEFLOW_CHROMIUM", "/usr/bin/chromium"))
# Debian's chromium, driven by Playwright (never `playwright install`: no downloads at test time).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
