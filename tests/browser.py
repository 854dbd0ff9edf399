"""Open an HTML page in headless Chromium: a screenshot, and whether each image loaded.

Chromium is a Debian package (``chromium``); ``.ci/run`` installs it when it is missing, so these
checks always run in CI. Without it a test skips and says why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

#: Appended to a copy of the page (never to the report itself, which holds no script): after the
#: load event, each image's natural width (0: broken) goes into an attribute that --dump-dom prints.
_PROBE = ("<script>addEventListener('load',()=>{document.documentElement.setAttribute('data-images',"
          "[...document.images].map(i=>i.complete?i.naturalWidth:0).join(','))});</script>")


def chromium() -> str:
    """The Chromium binary, or skip the test naming what to install."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    base = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            "--allow-file-access-from-files", "--virtual-time-budget=10000"]
    env = dict(os.environ, HOME=os.environ.get("HOME", "/tmp"))
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout, env=env)


@dataclass
class Rendered:
    screenshot: Image.Image
    image_widths: list[int]

    @property
    def colours(self) -> int:
        px = np.asarray(self.screenshot.convert("RGB").resize((300, self.screenshot.height * 300 // 1200)))
        return len(np.unique(px.reshape(-1, 3), axis=0))


def render(page: Path, tmp: Path, *, size: tuple[int, int] = (1200, 3000)) -> Rendered:
    """Screenshot ``page`` and read back each image's natural width (from a probed copy beside it)."""
    shot = tmp / "screenshot.png"
    done = _run([f"--window-size={size[0]},{size[1]}", f"--screenshot={shot}", page.resolve().as_uri()])
    assert shot.is_file(), f"Chromium wrote no screenshot: {done.stderr[-2000:]}"
    probed = tmp / f"probe-{page.name}"  # the page holds every image inline: a copy elsewhere shows the same
    probed.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    dom = _run(["--dump-dom", probed.resolve().as_uri()]).stdout
    found = re.search(r'data-images="([0-9,]*)"', dom)
    assert found, f"the probe did not run: {dom[:500]}"
    widths = [int(w) for w in found[1].split(",") if w]
    return Rendered(Image.open(shot), widths)
