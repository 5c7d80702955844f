"""Every curl example in README.md and docs/ that sends a JSON body also sends
``Content-Type: application/json``: ``curl -d`` alone sends
``application/x-www-form-urlencoded``, which the broker answers 422 "Input should be a valid
dictionary" (a new user's first lease request did)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = re.compile(r"(^|\s)(-d|--data|--data-binary|--data-raw|--json)(\s|=|')")


def _commands(text: str) -> list[str]:
    out, cur = [], ""
    for line in text.splitlines():
        if cur or re.search(r"(^|[\s`$(])curl\s", line):
            cur += " " + line.rstrip("\\").strip()
            if line.rstrip().endswith("\\"):
                continue
            out.append(cur[cur.index("curl") :].split("`")[0])
            cur = ""
    return out


def test_curl_examples_with_a_body_send_a_json_content_type():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad, seen = [], 0
    for f in files:
        for cmd in _commands(f.read_text()):
            if not DATA.search(cmd) or "--json" in cmd:  # --json sets the content type itself
                continue
            seen += 1
            if not re.search(r"content-type:\s*application/json", cmd, re.I):
                bad.append(f"{f.relative_to(ROOT)}: {cmd.strip()[:120]}")
    assert seen, "no curl example with a body found: the scan is broken"
    assert not bad, (
        "curl examples sending a body without Content-Type: application/json:\n" + "\n".join(bad)
    )
