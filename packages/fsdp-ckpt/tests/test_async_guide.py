"""The Python blocks of ``docs/guide/checkpoints-async.md`` run as written, one after the
other, in one fresh process (CPU, world 1), and their assertions hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide" / "checkpoints-async.md"


def test_guide_code_blocks_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 5, "the guide's examples were not found"
    script = tmp_path / "guide.py"
    script.write_text("\n".join(blocks))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wait(): [rank 0]" not in done.stdout  # one rank: no rank prefix
    assert "No space left on device" in done.stdout
    assert "next call: the previous asynchronous save" in done.stdout
