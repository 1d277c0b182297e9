"""Run scripts many times, each run in a child forked from one interpreter that did the imports.

    python tests/fork_runs.py N OUTDIR script.py [script.py ...]

Importing torch and radixserve takes seconds; a child forked after the imports starts at
once, so a script can be run many times cheaply. Each child runs its script as
``__main__`` (no arguments) and then leaves the way any script does — atexit handlers,
thread shutdown, ``Py_FinalizeEx`` — which is what a clean exit has to survive
(``multiprocessing`` would end its children with ``os._exit`` instead). The parent only
imports: it starts no thread and runs no torch op before forking, so each child's OpenMP
and ZMQ state is fresh. ``gc.freeze()`` keeps the imported modules out of the children's
final collection (with torch loaded it takes most of a second).

Each run's stdout and stderr go to ``OUTDIR/<script stem>-<i>.txt``; the parent prints
one JSON object: script path -> exit status of each run (``-6`` is SIGABRT).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys


def _fork_runs() -> tuple[str, str] | None:
    """In the parent: run every child, report, return None. In a child: return (script,
    output path) for the caller to run the script at module level."""
    n, outdir, scripts = int(sys.argv[1]), sys.argv[2], [os.path.abspath(p) for p in sys.argv[3:]]
    import torch  # noqa: F401  (the expensive imports, shared by every child)
    import torch.utils.cpp_extension  # noqa: F401  (the kernels' loader)
    import zmq  # noqa: F401

    import radixserve.engine.client  # noqa: F401
    import radixserve.engine.engine  # noqa: F401
    import radixserve.lang  # noqa: F401

    gc.freeze()
    report: dict[str, list[int]] = {}
    for script in scripts:
        stem = os.path.splitext(os.path.basename(script))[0]
        for i in range(n):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return script, os.path.join(outdir, f"{stem}-{i}.txt")
            _, status = os.waitpid(pid, 0)
            report.setdefault(script, []).append(os.waitstatus_to_exitcode(status))
    print(json.dumps(report))
    return None


_child = _fork_runs()
if _child is not None:  # a child: become the script, at module level, and exit as it does
    _script, _out = _child
    _fd = os.open(_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(_fd, 1)
    os.dup2(_fd, 2)
    os.close(_fd)
    sys.argv = [_script]
    sys.path[0] = os.path.dirname(_script)
    runpy.run_path(_script, run_name="__main__")
