"""The one exception tree of Stratus.

Every error a caller can act on derives from :class:`StratusError` and names the gRPC
status it becomes; the mapping to a wire status happens once, in
:mod:`stratus.serving.interceptor`, so servicers raise domain errors and never build statuses.
"""

from __future__ import annotations

from typing import ClassVar


class StratusError(Exception):
    """Root of every error Stratus raises on purpose."""

    status_name: ClassVar[str] = "INTERNAL"


class InvalidInput(StratusError):
    """The request itself is wrong: a tensor's shape, type, size, or a parameter."""

    status_name = "INVALID_ARGUMENT"


class NotFound(StratusError):
    """A model family, variant or agent that nothing here knows."""

    status_name = "NOT_FOUND"


class ConfigError(StratusError):
    """A configuration file or setting is malformed; the message names file, key and problem."""

    status_name = "FAILED_PRECONDITION"


class Conflict(StratusError):
    """A change made on a state someone else changed first (a version or revision read before
    it is not the latest any more); the message names the one it lost to. Read again, retry."""

    status_name = "FAILED_PRECONDITION"


class RuntimeUnavailable(StratusError):
    """An inference runtime cannot run here (library missing, no GPU); the message says why."""

    status_name = "FAILED_PRECONDITION"


class ModelLoadError(StratusError):
    """A model file exists but its runtime refused to load or run it."""

    status_name = "INTERNAL"


class Unavailable(StratusError):
    """Nothing that could serve the request is reachable right now."""

    status_name = "UNAVAILABLE"


class Overloaded(StratusError):
    """A bounded queue is full; the message names which one."""

    status_name = "RESOURCE_EXHAUSTED"


class AlreadyHeld(StratusError):
    """An id another live link holds: asking again once that link is gone may succeed, so an
    agent retries it (where a refused credential, PERMISSION_DENIED, never changes by retrying)."""

    status_name = "ALREADY_EXISTS"


class DeadlineExceeded(StratusError):
    """The request's budget or deadline ran out before an answer."""

    status_name = "DEADLINE_EXCEEDED"


class Unauthenticated(StratusError):
    """Missing or wrong credentials."""

    status_name = "UNAUTHENTICATED"


class PermissionDenied(StratusError):
    """Credentials are valid but do not allow this call."""

    status_name = "PERMISSION_DENIED"


def drop_frames(exc: BaseException) -> None:
    """Forget the frames an error answered to a client was raised through.

    Called where an error has become its wire answer: a traceback holds every frame it
    passed, and a frame that holds the error back (a failed task it awaited, the error in a
    local) makes a reference cycle, so the request in those frames (megabytes, parsed)
    waited for a garbage collection; protobuf's memory does not count towards when one runs.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
