"""docs/preference.md's example runs as written and says what it claims: the held-out
preference accuracy is 0 while the policy is its own reference and rises with training; both
ranks agree."""

import re
from pathlib import Path

DOC = Path(__file__).parents[2] / "docs" / "preference.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_every_python_block_is_checked():
    assert len(BLOCKS) == 1, "a new docs/preference.md code block needs a test here"


def test_preference_example_learns_the_preference(capsys):
    exec(compile(BLOCKS[0], "docs/preference.md", "exec"), {})
    per_rank = eval(capsys.readouterr().out.strip())
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    before, after, margin_up = per_rank[0]
    assert before == 0.0 and after >= 0.75 and margin_up
