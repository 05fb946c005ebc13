"""Runtime: the `Engine` API, its configuration, the sampler, the CLI and (later) the HTTP servers."""

from dserve.runtime.output import GenerateResult, StreamChunk
from dserve.scheduler.request import SamplingParams


def __getattr__(
    name,
):  # keep `import dserve.runtime` light: the engine pulls in torch and the models
    if name == "Engine":
        from dserve.runtime.engine import Engine

        return Engine
    if name == "EngineConfig":
        from dserve.runtime.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "SamplingParams", "GenerateResult", "StreamChunk"]
