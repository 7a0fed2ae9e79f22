"""Stop strings on streamed text: find the first match, never emit text a match could still start in."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds on text deltas; says what may be shown now and whether a stop string was reached.

    Text that ends with a proper prefix of some stop string is held back until the next delta
    decides it. When a stop string appears, the text before it is released and everything from
    the stop string on is dropped (the stop string itself is not part of the output, unless
    ``include`` is set: vLLM's ``include_stop_str_in_output``)::

        m = StopMatcher(["\\n\\n"])
        m.feed("a\\n")   -> ("a", None)        "\\n" held: it may start "\\n\\n"
        m.feed("\\nb")   -> ("", "\\n\\n")      stopped; the output is "a"
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(dict.fromkeys(stops))
        self.include = include
        self._held = ""
        self.matched: str | None = None  # the stop string reached, once one is

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return (text to emit now, the stop string reached or None). Do not feed after a match."""
        assert self.matched is None, "fed after a stop string was reached"
        text = self._held + delta
        if not self.stops:
            return text, None
        first: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self._held = ""
            self.matched = first[1]
            return text[: first[0] + (len(first[1]) if self.include else 0)], first[1]
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """The held-back text, at the end of generation when no stop string came."""
        text, self._held = self._held, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
