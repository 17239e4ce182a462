"""Every ```python block of the README runs as written (the documented API works)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert BLOCKS, "README lost its python examples"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    assert "assert " in code, "a README example checks its own result"
    exec(compile(code, str(README), "exec"), {})
