"""How one request ended, as the observer records it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.Enum):
    """What the client got from one attempt on one replica."""

    ANSWERED = "answered"
    """The replica's answer (any HTTP status the replica chose)."""
    FAILED = "failed"
    """A 502, or a stream ended by an error event: the replica failed the request."""
    CLIENT_GONE = "client_gone"
    """The client left first; the upstream request was dropped on purpose."""
    TRY_ANOTHER = "try_another"
    """Nothing reached the client: another replica may still answer. Not a finished request."""


@dataclass(slots=True)
class Finished:
    """One finished request, as metrics and stats record it."""

    pool: str
    replica: str
    traffic_class: str
    status: str
    """HTTP status the client got ('499' when it left first)."""
    duration_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    decode_s: float = 0.0
