"""minisgl: a compact, fast, OpenAI-compatible LLM inference server."""

import os
from typing import TYPE_CHECKING, Any

# OpenMP worker threads that wait passively: with libgomp's default they spin for milliseconds
# after every parallel region, and on a machine whose cores other processes also use (the API
# server and detokenizer share them with the forward) a preempted thread then stalls every
# region while its spinning siblings hold the CPU it needs: a decode step measured 1.5 to 7 times
# slower here. The CPU decode stack synchronizes its own threads within a step (see
# minisgl/kernels/csrc/decode.c), so waiting passively costs it one wake-up per step. libgomp
# reads this once, when torch loads it: it takes effect only if torch is not imported yet, and a
# value set by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from minisgl.core import SamplingParams  # noqa: E402 (after the environment is set)

if TYPE_CHECKING:
    from minisgl.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Import the engine lazily: `import minisgl` stays cheap for the API server and tools.
    if name in ("LLM", "RequestOutput"):
        from minisgl import llm

        return getattr(llm, name)
    raise AttributeError(name)
