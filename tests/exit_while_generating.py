"""A program that ends while the in-process engine core is still generating (test script).

What the examples do by accident — a request finished on the client side by a stop string
keeps running in the core until its abort arrives — done on purpose: a streamed program
is left generating and the script returns. Python then finalizes with the core thread
inside a step; unless something stops and joins that thread first, it is ended inside a
torch op and the process aborts ("terminate called without an active exception").
``tests/test_examples.py`` runs this through ``fork_runs.py`` and wants exit status 0.
"""

from __future__ import annotations

from radixserve.engine.engine import Engine
from radixserve.lang import EngineBackend, function, gen, set_default_backend


@function
def story(s):
    s += "Once upon a time" + gen("story", max_tokens=1500, temperature=0, ignore_eos=True)


if __name__ == "__main__":
    backend = EngineBackend(Engine("tiny-random", kv_cache_tokens=4096))
    set_default_backend(backend)
    state = story.run(stream=True)
    chunks = state.text_iter()
    next(chunks)  # the prompt
    next(chunks)  # the first generated text: the core is stepping
    steps = backend.engine.core.steps
    print(f"leaving after {steps} step(s), with the core still generating", flush=True)
