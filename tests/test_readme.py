"""The README's code blocks run as written and say what they claim: the train step makes one
sync per minibatch; the RL loop's log-probs go straight back as extras (first ratio exactly 1)."""

import re
from pathlib import Path

import pytest

BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).parent.parent / "README.md").read_text(), re.S)


def _run(code, capsys):
    exec(compile(code, "README.md", "exec"), {})
    return eval(capsys.readouterr().out.strip())


def test_every_python_block_is_checked():
    assert len(BLOCKS) == 2, "a new README code block needs a test here"


def test_readme_train_step_example_runs(capsys):
    losses_syncs = _run(BLOCKS[0], capsys)
    assert len(losses_syncs) == 2
    assert losses_syncs[0] == losses_syncs[1] and losses_syncs[0][1] == 1


def test_readme_rl_example_runs(capsys):
    per_rank = _run(BLOCKS[1], capsys)
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    ppo_kl, clipfrac = per_rank[0]
    assert ppo_kl == pytest.approx(0.0, abs=1e-6) and clipfrac == 0.0
