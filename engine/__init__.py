"""Ray-free inference engine for DeepSeek-family MoE models."""
from .async_engine import AsyncLLMEngine
from .config import ConfigError, EngineConfig, ModelConfig, preset
from .errors import ContextLengthError, Overloaded, RequestError
from .llm_engine import LLMEngine
from .sampling import SamplingError, SamplingParams
from .sequence import RequestOutput

__all__ = ["AsyncLLMEngine", "ConfigError", "ContextLengthError", "EngineConfig", "LLMEngine", "ModelConfig", "Overloaded", "RequestError",
           "RequestOutput", "SamplingError", "SamplingParams", "preset"]
