"""docs/rl.md's RL-loop example runs as written and says what it claims: both ranks end with the
engine at trainer step 6 (3 iterations x 2 train_steps) and verl's timing names."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rl_loop_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs/rl.md").read_text(), re.S)
    (loop,) = [b for b in blocks if "rl.step(" in b]
    exec(compile(loop, "docs/rl.md", "exec"), {})
    per_rank = eval(capsys.readouterr().out.strip())
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    version, timings = per_rank[0]
    assert version == 6
    assert {"timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/weight_sync",
            "timing_s/step"} <= set(timings)
