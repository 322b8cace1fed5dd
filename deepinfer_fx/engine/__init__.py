"""The offline engine: ``LLM`` and ``SamplingParams``."""

from .llm import LLM
from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams
from .scheduler import EngineType

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineType"]
