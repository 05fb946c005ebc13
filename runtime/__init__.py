"""Runtime: the `Engine` API and its configuration, the step pipeline between the front and the
ranks, the CLI, the HTTP servers and the router (docs/architecture.md maps it)."""

from dserve.runtime.output import GenerateResult, StreamChunk
from dserve.scheduler.request import SamplingParams


# keep `import dserve.runtime` light: the engine pulls in torch and the models
def __getattr__(name):
    if name == "Engine":
        from dserve.runtime.engine import Engine

        return Engine
    if name == "EngineConfig":
        from dserve.runtime.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "SamplingParams", "GenerateResult", "StreamChunk"]
