"""minisgl: a compact, fast, OpenAI-compatible LLM inference server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams

if TYPE_CHECKING:
    from minisgl.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Import the engine lazily: `import minisgl` stays cheap for the API server and tools.
    if name in ("LLM", "RequestOutput"):
        from minisgl import llm

        return getattr(llm, name)
    raise AttributeError(name)
