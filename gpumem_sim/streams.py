"""Streams, simulated work and events of :class:`~gpumem_sim.device.SimDevice`.

Streams are ints (0 is the default stream). Work is simulated: :meth:`SimStreams.submit`
queues work items on a stream, :meth:`SimStreams.complete` finishes them,
:meth:`SimStreams.stream_idle` reports whether any remain; an event is done once the work
submitted to its stream before it has finished. Tests drive the queues; nothing runs.

:class:`SimStreams` is a mixin of SimDevice: it uses that device's lock, call log, cost meter
and counters (``synchronize_calls``, ``stream_query_calls``).
"""
from __future__ import annotations

from typing import Any

from gpumem.errors import InvalidInputError
from gpumem_sim._common import SimCall, _int_arg

__all__ = ["SimStreams"]


class SimStreams:
    """The stream and event half of SimDevice's Device protocol (see the module docstring)."""

    def _streams_init(self) -> None:
        # submitted and completed work-item counts per stream; 0 is the default stream
        self._submitted: dict[int, int] = {0: 0}
        self._completed: dict[int, int] = {0: 0}
        self._next_stream = 1
        self._events: dict[int, tuple[int, int]] = {}
        self._next_event = 1

    def create_stream(self) -> int:
        """A new stream; handles are 1, 2, 3... and never reused on this device."""
        with self._lock:
            s = self._next_stream
            self._next_stream += 1
            self._submitted[s] = 0
            self._completed[s] = 0
            return s

    def destroy_stream(self, stream: int) -> None:
        """Forget a stream; its pending work counts as finished (as a driver drains it). The
        default stream 0 cannot be destroyed."""
        with self._lock:
            s = self._stream(stream)
            if s == 0:
                raise InvalidInputError("the default stream 0 cannot be destroyed")
            del self._submitted[s]
            del self._completed[s]
        self._stream_destroyed(s)

    def stream_idle(self, stream: int) -> bool:
        with self._lock:
            s = self._stream(stream)
            self.stream_query_calls += 1
            if self._meter is not None:
                self._meter.charge("stream_query")
            return self._completed[s] == self._submitted[s]

    def synchronize(self) -> None:
        """Finish all work on every stream (logged as a ``"synchronize"`` call)."""
        with self._lock:
            for s in self._submitted:
                self._completed[s] = self._submitted[s]
            self.synchronize_calls += 1
            self._record(SimCall("synchronize", 0, None, "ok"))

    # --- simulated work (tests drive it) -----------------------------------------------------
    def submit(self, stream: int, n: int = 1) -> int:
        """Queue ``n`` work items on ``stream`` (as launching kernels would); returns the number
        of items submitted to it so far."""
        k = _int_arg(n, "n", minimum=1)
        with self._lock:
            s = self._stream(stream)
            self._submitted[s] += k
            return self._submitted[s]

    def pending(self, stream: int) -> int:
        """Work items submitted to ``stream`` and not yet completed."""
        with self._lock:
            s = self._stream(stream)
            return self._submitted[s] - self._completed[s]

    def complete(self, stream: int | None = None, n: int | None = None) -> int:
        """Finish the oldest ``n`` pending items of ``stream`` (all of them when ``n`` is None),
        or all pending work on every stream when ``stream`` is None. Returns how many items
        finished. Asking for more items than are pending is an error."""
        with self._lock:
            if stream is None:
                if n is not None:
                    raise InvalidInputError("complete(): n needs a stream")
                done = 0
                for s in self._submitted:
                    done += self._submitted[s] - self._completed[s]
                    self._completed[s] = self._submitted[s]
                return done
            s = self._stream(stream)
            left = self._submitted[s] - self._completed[s]
            k = left if n is None else _int_arg(n, "n")
            if k > left:
                raise InvalidInputError(
                    f"complete(): stream {s} has {left} pending work item(s), asked for {k}")
            self._completed[s] += k
            return k

    def record_event(self, stream: int = 0) -> int:
        """An event that is done once the work submitted to ``stream`` so far has finished."""
        with self._lock:
            s = self._stream(stream)
            e = self._next_event
            self._next_event += 1
            self._events[e] = (s, self._submitted[s])
            if self._meter is not None:
                self._meter.charge("event_record")
            return e

    def event_done(self, event: int) -> bool:
        """True when the work before the event has finished (or its stream was destroyed)."""
        with self._lock:
            try:
                s, ticket = self._events[event]
            except (KeyError, TypeError):
                raise InvalidInputError(f"unknown event {event!r} on {self.device_string}") from None
            if self._meter is not None:
                self._meter.charge("event_query")
            if s not in self._completed:
                return True
            return self._completed[s] >= ticket

    def destroy_event(self, event: int) -> None:
        """Forget an event from :meth:`record_event` (done or not)."""
        with self._lock:
            if isinstance(event, bool) or self._events.pop(event, None) is None:
                raise InvalidInputError(f"unknown event {event!r} on {self.device_string}")

    @property
    def live_events(self) -> int:
        """Events recorded and not yet destroyed (tests check that none leak)."""
        with self._lock:
            return len(self._events)

    # --- helpers (call with the lock held) ---------------------------------------------------
    def _stream(self, stream: Any) -> int:
        if isinstance(stream, bool) or not isinstance(stream, int) or stream not in self._submitted:
            known = ", ".join(str(s) for s in self._submitted)
            raise InvalidInputError(
                f"unknown stream {stream!r} on {self.device_string}; streams: {known}")
        return stream
