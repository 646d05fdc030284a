"""The wire between the front end and the engine core process: message types, and the structs only the
transport sends. The data itself (requests, outputs, stats) is `llmserve/contracts.py`'s.
"""

from __future__ import annotations

import enum

import msgspec


class EngineCoreRequestType(enum.Enum):
    """Front end → core. The payload type is named on each member."""

    ADD = b"\x00"  # EngineCoreRequest
    ABORT = b"\x01"  # list[str]: request ids
    UTILITY = b"\x02"  # UtilityCall
    SHUTDOWN = b"\x03"  # nothing (an empty payload)


# The longest the core stays silent once READY: its output thread sends a HEARTBEAT after this long
# without a message. Shorter detects a hung core sooner; each beat wakes an idle front end once.
HEARTBEAT_INTERVAL_S = 0.5


class EngineCoreEventType(enum.Enum):
    """Core → front end. READY or STARTUP_FAILED comes first and once; ERROR comes last. After READY,
    HEARTBEAT comes whenever nothing else was sent for `HEARTBEAT_INTERVAL_S`, from a thread that a long
    step does not block: a core that sends nothing at all is stopped or wedged, not busy."""

    READY = b"\x00"  # ResolvedLimits
    STARTUP_FAILED = b"\x01"  # EngineCoreFailure; the process then exits
    OUTPUTS = b"\x02"  # EngineCoreOutputs
    UTILITY_RESULT = b"\x03"  # UtilityResult
    ERROR = b"\x04"  # EngineCoreFailure from the busy loop; the process then exits
    HEARTBEAT = b"\x05"  # nothing (msgpack nil)


class UtilityCall(msgspec.Struct, array_like=True):
    """Run `method` (a name the core publishes, such as "get_scheduler_stats") between two steps."""

    call_id: int
    method: str


class UtilityResult(msgspec.Struct, array_like=True):
    """The answer to the `UtilityCall` of the same id; `result` is msgpack the caller decodes."""

    call_id: int
    result: msgspec.Raw


class EngineCoreFailure(msgspec.Struct, array_like=True):
    """Why the core could not start, or why its busy loop stopped. `is_value_error` marks a bad
    configuration (the front end raises `ValueError` with `message`)."""

    error_type: str
    message: str
    is_value_error: bool = False
