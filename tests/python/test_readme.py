"""The README's Python quick start runs as written (it starts its own peer)."""

import pathlib
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def quick_start():
    text = README.read_text()
    section = text[text.index("## Quick start: Python") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


def test_the_python_quick_start_runs_as_written():
    run = subprocess.run([sys.executable, "-c", quick_start()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "moved and read back 64 KiB over" in run.stdout
