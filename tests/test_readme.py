"""The README's Python example runs as written, from outside the checkout (on the CPU it
runs the torch reference), and prints the shapes it promises."""
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_example_runs_from_another_directory(tmp_path):
    usage = README.read_text().split("## Using it", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, flags=re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "(6, 16, 128) (6, 1, 128)"
    assert "Warning" not in proc.stderr, proc.stderr  # e.g. torch's without numpy
