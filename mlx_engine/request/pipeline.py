"""The request pipeline after validation: prompt → the one loop → results.

``Generation`` is the request's driver, a generator conversation with the
kit's scheduler (runtime/scheduler.py, one row for a kit serving one
generation at a time). Running it: ``_prepare`` expands the prompt (images), brings the
cache to its longest common prefix, checks that the cache can be rewound before
any draft work and builds the drafter; ``_process_prompt`` prefills what the
caches lack, in chunks, with progress and cancellation; ``decode``
(decode/loop.py) yields tokens; ``_results`` turns them into streamed
results with exactly one final result carrying the stop condition and stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from functools import partial
from itertools import zip_longest
from typing import Callable, Iterator, NamedTuple

import mlx.core as mx

from ..caches.ragged import release_row
from ..caches.sequence import SequenceCache
from ..decode import capture
from ..decode.loop import decode
from ..decode.protocol import TURN, Decoding, Drafter, Launch, Round, Turn
from ..decode.sampling import Sampler, build_logits_processors, build_sampler
from ..drafters.draft_model import DraftModelDrafter
from ..drafters.head import HeadDrafter
from ..drafters.router import AutoRouter
from ..errors import CallbackError
from ..kits.text import ExpandedPrompt, ModelKit
from ..loading.memory import prefill_chunk
from ..results import (
    GenerationResult,
)
from ..runtime import worker
from ..structured import GrammarConstraint
from .drafters import build_drafter
from .output import PromptFacts, SpeculationTally, build_stats, final_result, results
from .validate import Request

logger = logging.getLogger(__name__)

INTERLEAVED_PREFILL_CHUNK = 256  # prompt tokens per step while other requests decode


#: What a request's run yields: results, ``TURN`` between prompt chunks, a
#: ``Launch`` for each forward pass; the caller sends back each launch's round.
Driver = Generator[Launch | Turn | GenerationResult, Round | None, None]


class Generation(Generator[Launch | Turn | GenerationResult, Round | None, None]):
    """One request's run, the internal driver: results, ``TURN`` between prompt
    chunks and a ``Launch`` for each forward pass its loop needs, resumed with
    ``send(round)`` (scheduler.py runs the launches, batched with other
    requests'). The request id is known to the
    kit from creation until the run ends or is closed, started or not, so a
    generator that is dropped unstarted never leaves its id behind."""

    def __init__(self, kit: ModelKit, request: Request):
        self._kit, self._request = kit, request
        self._started = True  # nothing to end (``__del__``) unless registered
        kit.activity.register(request.request_id, kit.max_parallel)
        self._gen: Driver = run(kit, request)
        self._started = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def send(self, rnd: Round | None):
        """Resume the run (with the round of the launch it last yielded)."""
        self._started = True  # from here on, run() ends the request itself
        return self._gen.send(rnd)

    def throw(self, exc, *args):
        """Raise ``exc`` where the request waits for its forward pass (which failed)."""
        return self._gen.throw(exc, *args)

    def close(self) -> None:
        self._gen.close()
        if not self._started:
            self._started = True
            self._kit.activity.end(self._request.request_id)

    def __del__(self) -> None:
        """An unstarted generation nobody holds any more (its creator was
        interrupted before receiving it) frees its slot; nothing else runs
        (no MLX work: a finalizer may run on any thread)."""
        if not self._started:
            self._started = True
            self._kit.activity.end(self._request.request_id)


class _Prepared(NamedTuple):
    expanded: ExpandedPrompt  # the prompt as the kit expanded it (expand_prompt), handed to its prefill
    prompt: list[int]  # the real ids (a vision kit's images expanded)
    cache: SequenceCache  # the prompt cache's entry this request decodes into
    todo: list[int]  # the part of the prompt that cache lacks (all but the last token)
    drafter: Drafter | None
    draft_drafter: DraftModelDrafter | HeadDrafter | None  # the draft model (or head) inside ``drafter``, to prefill
    facts: PromptFacts  # what this stage found, for the stats


class _Cancelled(Exception):
    pass


def run(kit: ModelKit, req: Request) -> Driver:
    """Run a validated request on the kit (on its engine thread)."""
    act = kit.activity
    steps = prepared = None
    model_work = False  # whether the caches may hold a half-recorded forward pass
    try:
        act.begin(req.request_id)
        t_start = time.perf_counter()
        if len(act.active) == 1:
            mx.reset_peak_memory()  # not under another running request's feet
        # The sampler carries its own key (sampling.build_sampler): the request's
        # seed, or one drawn from MLX's global stream here, once per request.
        sampler = build_sampler(req.params)
        prepared = _prepare(kit, req)
        model_work = True
        stop_requested = partial(_stop_requested, kit, req.request_id)
        try:
            yield from _process_prompt(kit, prepared, req.progress_cb, stop_requested)
        except _Cancelled:
            nothing = SpeculationTally(prepared.facts.decoding_mode, prepared.facts.mode_reason)
            stats = build_stats(prepared.facts, nothing, 0, t_start, None)
            yield final_result("", [], None, "user_cancelled", stats, req.stats_cb)
            return
        steps = _decode(kit, req, prepared, sampler)
        yield from results(kit, req, steps, prepared.facts, _router_of(prepared), t_start, stop_requested)
    except CallbackError:
        raise  # raised between prompt chunks or at the end: caches are consistent
    except Exception:
        # An unexpected failure during model work may have left a forward pass
        # half-recorded; start the next request from clean caches rather than
        # risk reusing a bad one. A failure before it leaves the caches as they were.
        if model_work:
            _reset_caches(kit, prepared)
        raise
    finally:
        _clean_up(kit, req.request_id, steps, prepared)


def _clean_up(kit: ModelKit, request_id: str, steps, prepared: _Prepared | None) -> None:
    """Close the loop, take the request's row out of the batch, return its
    caches (the prompt cache may write evicted entries to disk) and end the
    request. Each step runs whatever failed before it, a failure is logged,
    not raised (the answer was delivered, or another error is on its way), and
    the request always ends: a failed clean-up never holds a ``max_parallel``
    slot or blocks ``unload``."""
    jobs: list[Callable[[], None]] = [] if steps is None else [steps.close]
    if prepared is not None:
        # Every request teaches suffix drafting (plain ones too), before the row's cache is released.
        jobs.append(lambda: kit.remember_sequence(request_id, prepared.cache.tokens))
        jobs.append(lambda: kit.drafting_rows.forget(request_id))
        jobs.append(lambda: release_row(kit.batch, prepared.cache))
        # The next turn resumes from the end of this answer (recurrent layers; a no-op otherwise).
        jobs.append(prepared.cache.checkpoint)
        if prepared.draft_drafter is not None:
            jobs.append(lambda: kit.draft.give_back(prepared.draft_drafter.cache))
        if kit.prompt_cache is not None:
            jobs.append(lambda: kit.prompt_cache.release(prepared.cache))
    try:
        for job in jobs:
            try:
                job()
            except Exception:
                logger.exception("request %r: a clean-up step failed", request_id)
    finally:
        kit.activity.end(request_id)


def _prepare(kit: ModelKit, req: Request) -> _Prepared:
    """Expand the prompt, reuse the cached prefix, plan against the cache and
    build the drafter (timing the cost set-up apart)."""
    expanded = kit.expand_prompt(req.prompt, req.images)  # a vision kit expands its images here
    prompt = expanded.ids
    entry, hit = kit.prompt_cache.select(expanded.keys[:-1])  # the cached sequence sharing the longest prefix
    try:
        cached = entry.sync_to(expanded.keys[:-1])
        todo = prompt[cached:-1]
        decoding = req.plan.for_cache(entry, len(todo))
        t_setup = time.perf_counter()
        drafter, draft_drafter = build_drafter(kit, decoding, prompt, req.request_id)
        setup = time.perf_counter() - t_setup
    except BaseException:
        kit.prompt_cache.release(entry)
        raise
    source = hit.source if cached else "none"
    facts = PromptFacts(
        len(prompt), cached, source, len(kit.prompt_cache.entries), setup, decoding.mode_name, decoding.reason
    )
    return _Prepared(expanded, prompt, entry, todo, drafter, draft_drafter, facts)


def _router_of(prepared: _Prepared) -> AutoRouter | None:
    """The request's auto router, whose report names its mode in the stats."""
    return prepared.drafter if isinstance(prepared.drafter, AutoRouter) else None


def _process_prompt(
    kit: ModelKit, prepared: _Prepared, progress_cb: Callable | None, cancelled: Callable[[], bool]
) -> Iterator:
    """Prefill the main (and draft) caches with the prompt's uncached part,
    reporting progress from 0 to 100 over both models' work (the draft's weighted
    by its size) and yielding ``TURN`` after each step's chunks (one of each
    model's). Raises _Cancelled between chunks when asked to stop."""
    prompt, draft_drafter = prepared.prompt, prepared.draft_drafter
    draft_todo, draft_weight = 0, 0.0
    if draft_drafter is not None:
        draft_todo = draft_drafter.prefill_todo(prompt)
        draft_weight = kit.draft.num_params / kit.num_params
    total = len(prepared.todo) + draft_weight * draft_todo
    done = 0.0

    def report(percent: float) -> None:
        if progress_cb is None:
            return
        try:
            keep_going = progress_cb(percent)
        except Exception as exc:
            raise CallbackError(f"prompt_progress_callback raised {type(exc).__name__}: {exc}") from exc
        if keep_going is False:
            raise _Cancelled()

    def chunk_done(weight: float) -> Callable[[int], None]:
        def on_chunk(n: int) -> None:
            nonlocal done
            done += n * weight
            if cancelled():
                raise _Cancelled()
            if done < total:
                report(100.0 * done / total)

        return on_chunk

    report(0.0)
    hidden = int(kit.config.get("text_config", kit.config).get("hidden_size", 4096) or 4096)
    chunk = prefill_chunk(kit.vocab_size, hidden)
    if len(kit.activity.active) > 1:
        # Other requests decode between our chunks: smaller chunks keep their
        # stalls short, at a small cost in prefill speed.
        chunk = min(chunk, INTERLEAVED_PREFILL_CHUNK)
    main = kit.prefill_prompt(prepared.expanded, prepared.cache, prepared.todo, chunk_done(1.0), chunk)
    main = _recording(main, prepared.cache, prepared.drafter)
    # The draft model's chunks ride along with the main model's, one of each
    # per step (a draft chunk costs a fraction of a main one), so neither
    # stalls the other rows for a whole prompt nor adds steps to this one's.
    draft = () if draft_drafter is None else draft_drafter.prefill_prompt(prompt, chunk_done(draft_weight), chunk)
    for _ in zip_longest(main, draft):
        yield TURN
    # A regenerated answer or an edited next message resumes here (recurrent layers).
    prepared.cache.checkpoint()
    report(100.0)


def _recording(chunks: Iterator, cache, drafter) -> Iterator:
    """The prompt's chunks, each handing the drafter the hidden states it reads
    (a head: decode/capture.py) at the positions the chunk fed; the chunks
    themselves when the drafter reads none."""
    spec = None if drafter is None else getattr(drafter, "hidden_spec", None)
    if spec is None:
        yield from chunks
        return
    chunks = iter(chunks)
    while True:
        at = len(cache.tokens)
        with capture.collecting(spec) as sink:
            if next(chunks, _DONE) is _DONE:
                return
        if len(cache.tokens) > at:
            drafter.take_hidden(at, capture.rows(sink, spec, 0, len(cache.tokens) - at))
        yield


_DONE = object()


def _decode(kit: ModelKit, req: Request, prepared: _Prepared, sampler: Sampler) -> Decoding:
    """The one verify/accept/rewind loop for this request."""
    constraint = None
    if req.grammar is not None:
        constraint = GrammarConstraint(
            kit, req.grammar, draft_forced=req.structured_drafting, source=req.grammar_source
        )
    return decode(
        prepared.cache,
        list(prepared.prompt),
        req.max_tokens,
        sampler,
        build_logits_processors(req.params),
        req.params.repetition_context_size,
        prepared.drafter,
        constraint,
    )


def _stop_requested(kit: ModelKit, request_id: str) -> bool:
    """Cancelled by stop_generation, or the process is exiting."""
    return kit.activity.is_cancelled(request_id) or worker.shutting_down.is_set()


def _reset_caches(kit: ModelKit, prepared: _Prepared | None) -> None:
    """Empty the request's caches (main and draft), out of their batches. Never
    raises: the request's own error is on its way."""
    if prepared is None:
        return
    caches = [(kit.batch, prepared.cache)]
    if prepared.draft_drafter is not None:
        caches.append((kit.draft.batch, prepared.draft_drafter.cache))
    for batch, cache in caches:
        try:
            release_row(batch, cache)
        except Exception:
            logger.exception("a failed request's row could not leave its batch")
        cache.reset()
