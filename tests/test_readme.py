"""The README's example runs as written and says what it claims (one sync per minibatch)."""

import re
from pathlib import Path


def test_readme_train_step_example_runs(capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    losses_syncs = eval(out.strip())
    assert len(losses_syncs) == 2
    assert losses_syncs[0] == losses_syncs[1] and losses_syncs[0][1] == 1
