"""Every example prints its answers and exits with status 0 — every time.

An in-process engine runs its core on a (daemon) thread. If Python finalizes while that
thread is inside a step, the thread is ended inside a torch op and the process aborts
with "terminate called without an active exception" (status 134), after printing correct
answers. The examples used to end that way by accident on SmolLM2 (in 1 to 3 runs of 4:
a request finished here by a stop string still runs in the core until its abort
arrives), so one run proves little: each script runs ``RUNS`` times.
``exit_while_generating.py`` ends with the core busy on purpose; before the fix it
aborted in 10 runs of 10.

The runs use the tiny random model (``RADIXSERVE_EXAMPLE_MODEL``: the abort depends on
the core being inside a step at exit, not on the model) and are forked from one
interpreter that has imported torch (``fork_runs.py``): each child still leaves through
atexit and interpreter finalization, but does not pay the seconds of imports again.
The same on SmolLM2, by hand: ``python tests/fork_runs.py 3 /tmp/out examples/[a-z]*.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
RUNS = 10
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))

# What each script prints once it has its answers (the tiny model's text is gibberish).
ANSWERS = {
    "few_shot_qa": [r"^  -> .*\(cached \d+/\d+ prompt tokens\)$"] * 3,
    "multi_turn_chat": [r"^assistant: "] * 2 + [r"^\(cached \d+/\d+ prompt tokens on the last turn\)$"],
    "react_agent": [r"^answer: "],
    "self_consistency": [r"^path \d+: "] * 5 + [r"^majority vote: "],
    "tree_of_thought": [r"^step \d+: "] * 2 + [r"^answer:"],
    "exit_while_generating": [r"^leaving after \d+ step\(s\), with the core still generating$"],
}
SCRIPTS = [*EXAMPLES, TESTS / "exit_while_generating.py"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[int]], Path]:
    """Run every script RUNS times: two forking parents side by side, half the scripts each."""
    out = tmp_path_factory.mktemp("example-runs")
    env = {**os.environ, "RADIXSERVE_EXAMPLE_MODEL": "tiny-random"}
    halves = [SCRIPTS[0::2], SCRIPTS[1::2]]
    procs = [subprocess.Popen([sys.executable, str(TESTS / "fork_runs.py"), str(RUNS), str(out),
                               *map(str, half)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for half in halves]
    report: dict[str, list[int]] = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, f"fork_runs.py failed:\n{stderr}"
            report.update({Path(k).stem: v for k, v in json.loads(stdout.splitlines()[-1]).items()})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return report, out


def test_every_example_has_its_answers_listed() -> None:
    assert {p.stem for p in SCRIPTS} == set(ANSWERS)


@pytest.mark.parametrize("script", [p.stem for p in SCRIPTS])
def test_script_prints_its_answers_and_exits_0_every_time(script: str, runs) -> None:
    report, out = runs
    statuses = report[script]
    assert len(statuses) == RUNS
    for i, status in enumerate(statuses):
        text = (out / f"{script}-{i}.txt").read_bytes().decode(errors="replace")  # no newline translation
        assert status == 0, f"run {i} of {script} exited with {status} (runs: {statuses}):\n{text[-3000:]}"
        for pattern in set(ANSWERS[script]):
            found = len(re.findall(pattern, text, re.MULTILINE))
            want = ANSWERS[script].count(pattern)
            assert found >= want, f"run {i} of {script}: {want} line(s) like {pattern!r}, got {found}:\n{text}"
        assert "Traceback" not in text and "terminate called" not in text, text
