"""radixserve.lang: a small SGLang-style frontend language for structured LLM programs.

    from radixserve import Engine
    from radixserve.lang import function, gen, select, user, assistant, set_default_backend

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64, stop="\\n"))

    set_default_backend(Engine("smollm2-135m"))       # or RuntimeEndpoint("http://host:port")
    state = qa.run(question="What is the capital of France?", temperature=0)
    print(state["answer"])

Programs are executed by a per-state worker thread (``s += ...`` returns at once), so the
branches of ``s.fork(n)`` and the programs of ``run_batch`` reach the runtime together and
share the cached prefix. The frontend hint (prefix prefill before a fork or select) is on
by default; turn it off with ``radixserve.lang.config.frontend_hint = False``,
``@function(hint=False)`` or ``prog.run(..., hint=False)``.
"""

from radixserve.lang.backend import Backend, EngineBackend, GenResult, RuntimeEndpoint, SelectResult
from radixserve.lang.interpreter import (LangConfig, SglFunction, config, function, get_default_backend,
                                         set_default_backend)
from radixserve.lang.ir import (assistant, assistant_begin, assistant_end, gen, select, system, system_begin,
                                system_end, user, user_begin, user_end)
from radixserve.lang.program_state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend", "EngineBackend", "GenResult", "LangConfig", "ProgramState", "ProgramStateGroup", "RuntimeEndpoint",
    "SelectResult", "SglFunction", "assistant", "assistant_begin", "assistant_end", "config", "function", "gen",
    "get_default_backend", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
    "user_begin", "user_end",
]
