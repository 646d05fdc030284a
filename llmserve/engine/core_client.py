"""How the front end reaches the engine core. One interface; the transport is the implementation's."""

from __future__ import annotations

from abc import ABC, abstractmethod

from llmserve.config import EngineConfig, ResolvedLimits
from llmserve.engine.core import EngineCore
from llmserve.engine.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """Contract: `limits` is known once constructed; `get_output()` returns the next step's outputs;
    `shutdown()` releases the core and everything it holds."""

    limits: ResolvedLimits

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The core in this process: `get_output()` runs one step. For tests and debugging."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self.limits = self.engine_core.limits

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def shutdown(self) -> None:
        pass
