"""radixserve: an LLM serving runtime built around RadixAttention.

Every request's KV cache lives in a radix tree keyed by token ids, so a prefix shared by
two requests is computed once. The public API is small:

    from radixserve import Engine, SamplingParams
    engine = Engine("smollm2-135m")
    out = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
"""

from radixserve.kernels.isa import cap_libraries

cap_libraries()  # before torch's first op: see radixserve.kernels.isa (a no-op without RADIXSERVE_CPU_ISA)

from radixserve.config import package_version  # noqa: E402
from radixserve.request import RequestOutput  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

__version__ = package_version()


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it lazily so `radixserve --help` is fast.
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "RequestOutput", "SamplingParams", "__version__"]
