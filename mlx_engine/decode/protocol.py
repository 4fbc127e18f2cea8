"""What the loop (loop.py) exchanges with its caller and its drafter.

With its caller (the scheduler, or ``forward_alone`` for a row on its own):
``decode`` yields a ``Launch`` per verify round and is sent back the queued
``Round``; it yields a ``Step`` per token (a request yields ``TURN`` between
its prompt chunks).
With its drafter: the ``Drafter`` interface, drafts as ids or ``PendingDrafts``
(computed together with other rows'), and ``DrafterUnavailable`` to drop it.
"""

from __future__ import annotations

from typing import Callable, Generator, NamedTuple, Protocol

import mlx.core as mx

from ..caches.sequence import SequenceCache
from . import capture
from .capture import HiddenSpec


class RoundOutcome(NamedTuple):
    """What one verify round did with its drafts: ``drafted`` proposed,
    ``accepted`` of them equal to the target's choices; ``forced``: the drafts
    were the tokens a grammar forces, not a drafter's."""

    drafted: int
    accepted: int
    forced: bool = False


class Step(NamedTuple):
    """One token of the loop's output. The first token of a round that drafted
    carries the round's ``outcome``; ``fallback`` is set on the first token after
    the drafter became unavailable (the reason), so the output stage counts
    speculation from the tokens alone."""

    token: int
    logprob: float  # log-probability of ``token`` under the distribution it was sampled from
    logprobs: mx.array  # (vocab,) that distribution, for top-logprobs
    from_draft: bool
    completes_grammar: bool = False  # the request's grammar allows nothing after this token
    at_limit: bool = False  # the loop's last token: ``max_new`` reached
    outcome: RoundOutcome | None = None
    fallback: str | None = None


class Turn:
    """The type of ``TURN``."""

    def __repr__(self) -> str:
        return "TURN"


#: Yielded by a request between prompt chunks: the other requests take a step.
TURN = Turn()


class Launch(NamedTuple):
    """A row's request for a forward pass, yielded by ``decode``: ``known`` ids
    then ``lazy`` ones (not evaluated yet; ``PendingDrafts`` not even built)
    after what ``cache`` holds. The caller runs every row's launch of a step as
    one batched forward pass, calls ``finish(logits, start, ids)`` (start: the
    position of the first lazy id; ids: the lazy ids, resolved) and sends the
    ``Round`` it returns back into the generator that yielded the launch.
    ``hidden``: the hidden states a head drafter reads (None: none), which the
    caller records during the pass and puts on the round (``with_hidden``)."""

    cache: SequenceCache
    known: list[int]
    lazy: mx.array | PendingDrafts | None
    finish: Callable[[mx.array, int, mx.array | None], Round]
    hidden: HiddenSpec | None = None


class PendingDrafts:
    """Drafts a drafter computes together with the other requests' drafts of the
    same step (the scheduler runs ``run_together`` before the verify pass);
    ``materialize`` returns them (computing them alone when ``run_together``
    did not)."""

    k: int

    @property
    def size(self) -> int:
        return self.k

    def materialize(self) -> mx.array:
        raise NotImplementedError

    @staticmethod
    def run_together(pending: list[PendingDrafts]) -> None:
        raise NotImplementedError


def lazy_ids(launch: Launch) -> mx.array | None:
    """The launch's lazy ids, its pending drafts computed alone if need be."""
    return launch.lazy.materialize() if isinstance(launch.lazy, PendingDrafts) else launch.lazy


def resolve_pending(launches: list[Launch]) -> list[mx.array | None]:
    """Compute the launches' pending drafts together; returns each launch's lazy ids."""
    pending = [l.lazy for l in launches if isinstance(l.lazy, PendingDrafts)]
    if pending:
        type(pending[0]).run_together(pending)
    return [lazy_ids(launch) for launch in launches]


def forward_alone(launch: Launch, ids: mx.array | None = None) -> Round:
    """Run a launch on its own cache (a row outside any batch); returns its
    queued round. ``ids``: its lazy ids when already resolved."""
    if ids is None:
        ids = lazy_ids(launch)
    with capture.collecting(launch.hidden) as sink:
        if ids is not None:
            logits, start = launch.cache.feed_lazy(launch.known, ids)
        else:
            logits = launch.cache.feed(launch.known)
            start = len(launch.cache)
    return with_hidden(launch.finish(logits, start, ids), launch, sink, 0, logits.shape[0], start)


def with_hidden(rnd: Round, launch: Launch, sink: dict | None, row: int, n: int, start: int) -> Round:
    """The round with the hidden states its launch asked for: row ``row``'s
    ``n`` positions of the pass, the first at the cache position where the
    launch's known ids began (``start`` is its first lazy id's)."""
    if launch.hidden is None or sink is None:
        return rnd
    return rnd._replace(hidden=capture.rows(sink, launch.hidden, row, n), hidden_at=start - len(launch.known))


class DrafterUnavailable(Exception):
    """Raised by a drafter that can no longer draft for this request (for example
    its cache cannot be rewound); the loop continues with plain decoding."""


Drafts = list[int] | mx.array


class Drafter(Protocol):
    name: str

    def propose(self, history: list[int], limit: int) -> Drafts:
        """Up to ``limit`` tokens that may follow ``history`` (whose last token the
        main model has not processed yet). A lazy ``mx.array`` of ids lets the loop
        build the verify pass before the drafts are computed and evaluate both at
        once, as mlx-lm's speculative loop does."""

    def observe(self, drafted: int, accepted: int, seconds: float | None) -> None:
        """Feedback after each verify round: drafts verified and accepted, and the
        round's wall time (from the previous round's result to this one's, so it
        includes drafting and the caller's overlapped work; None for the first)."""

    # Optional, for drafters that read the target's hidden states (heads/):
    # ``hidden_spec`` (a HiddenSpec or None: which ones each launch records)
    # and ``take_hidden(at, rows)`` (each read round's, ``at`` the cache
    # position of its first row).
    # Optional: ``plain_ahead(history) -> bool``, True when the round after
    # ``history`` and one more token (whichever it is) drafts nothing; the loop
    # then queues that round before the previous one is read, as plain decoding
    # does. Drafters without it are asked every round.


#: ``decode``'s generator: steps and launches out, each launch's ``Round`` in.
Decoding = Generator["Step | Launch", "Round | None", None]


class Round(NamedTuple):
    """A verify round queued on the device: what ``Launch.finish`` returns."""

    drafts: Drafts
    start: int  # cache position of the ids fed lazily (UNKNOWN there until read)
    tokens: mx.array  # the target's choice at each position
    chosen: mx.array  # their log-probabilities
    logprobs: mx.array
    forced: bool = False  # the drafts are tokens the grammar forced, not the drafter's
    hidden: mx.array | None = None  # (positions fed, width): the hidden states the launch asked for
    hidden_at: int = 0  # the cache position of ``hidden``'s first row
