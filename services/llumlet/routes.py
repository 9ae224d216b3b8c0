"""Where a llumlet publishes each request's output: the gateway's reply subject, by request id.

A route opens when the request is admitted here or migrates in, and closes when it finishes,
fails, is aborted, or migrates out (its destination publishes from then on). The llumlet and its
migration hooks change routes only through these methods, so each transition is checked once.
"""

from __future__ import annotations


class OutputRoutes:
    def __init__(self) -> None:
        self._subjects: dict[str, str] = {}
        self._offsets: dict[str, int] = {}  # a resumed request's output so far (GenerateRequest.resume_from)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._subjects

    def __len__(self) -> int:
        return len(self._subjects)

    def open(self, request_id: str, subject: str, offset: int = 0) -> None:
        """Publish the request's output to `subject` from now on (it must not be routed here),
        its output indices shifted by `offset` (a resumed request's tokens delivered before)."""
        assert request_id not in self._subjects, f"request {request_id} is routed here already"
        self._subjects[request_id] = subject
        if offset:
            self._offsets[request_id] = offset

    def offset(self, request_id: str) -> int:
        return self._offsets.get(request_id, 0)

    def subject(self, request_id: str) -> str | None:
        """Where its output goes; None: not (or no longer) published from here."""
        return self._subjects.get(request_id)

    def close(self, request_id: str) -> str | None:
        """Stop publishing for the request; the subject it had, None if it had none."""
        self._offsets.pop(request_id, None)
        return self._subjects.pop(request_id, None)

    def routed_to(self, subject: str) -> list[str]:
        """The requests whose output goes to `subject` (one gateway's)."""
        return [request_id for request_id, to in self._subjects.items() if to == subject]

    def close_all(self) -> list[tuple[str, str]]:
        """Every route, closed: (request id, subject) pairs."""
        routes = list(self._subjects.items())
        self._subjects.clear()
        self._offsets.clear()
        return routes
