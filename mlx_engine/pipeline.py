"""The request pipeline after validation: prompt → the one loop → results.

``Generation`` is the request's driver, a generator conversation with the
scheduler (scheduler.py) or, for a kit serving one generation at a time, with
``Generation.alone()``, the public ``Iterator[GenerationResult]``. Running it: ``_prepare`` expands the prompt (images), brings the
cache to its longest common prefix, checks that the cache can be rewound before
any draft work and builds the drafter; ``_process_prompt`` prefills what the
caches lack, in chunks, with progress and cancellation; ``decode``
(speculative/loop.py) yields tokens; ``_results`` turns them into streamed
results with exactly one final result carrying the stop condition and stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from itertools import zip_longest
from typing import Callable, Iterator, NamedTuple

import mlx.core as mx

from . import worker
from .batch_cache import release_row
from .cache import SequenceCache, common_prefix_length
from .context import prefill_chunk
from .errors import CallbackError
from .model_kit import ExpandedPrompt, ModelKit
from .plan import build_drafter
from .request import Request
from .results import (
    GenerationResult,
    GenerationStats,
    GenerationStopCondition,
    StopReason,
    Token,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from .sampling import Sampler, build_logits_processors, build_sampler
from .speculative.draft_model import DraftModelDrafter
from .speculative.loop import TURN, Decoding, Drafter, Launch, Round, Turn, decode, forward_alone
from .stop_strings import TextStream
from .structured import GrammarConstraint
from .tools import ToolCallStream

logger = logging.getLogger(__name__)

INTERLEAVED_PREFILL_CHUNK = 256  # prompt tokens per step while other requests decode


#: What a request's run yields: results, ``TURN`` between prompt chunks, a
#: ``Launch`` for each forward pass; the caller sends back each launch's round.
Driver = Generator[Launch | Turn | GenerationResult, Round | None, None]


class Generation(Generator[Launch | Turn | GenerationResult, Round | None, None]):
    """One request's run, the internal driver: results, ``TURN`` between prompt
    chunks and a ``Launch`` for each forward pass its loop needs, resumed with
    ``send(round)`` (scheduler.py runs the launches, batched with other
    requests'). ``alone()`` is the public iterator of its results, running the
    launches itself, for a kit that serves one generation at a time. The request id is known to the
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

    def alone(self) -> Iterator[GenerationResult]:
        """The results, running each launch on the request's own cache."""
        return _Alone(self)

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


class _Alone(Iterator[GenerationResult]):
    """A generation driven by its consumer, one launch at a time (max_parallel=1)."""

    def __init__(self, generation: Generation):
        self._generation = generation

    def __next__(self) -> GenerationResult:
        gen = self._generation
        item = next(gen)
        while isinstance(item, Launch) or item is TURN:
            if item is TURN:
                item = next(gen)
                continue
            try:
                rnd = forward_alone(item)
            except BaseException as exc:
                item = gen.throw(exc)  # the request's own cleanup runs; the error reaches the caller
                continue
            item = gen.send(rnd)
        return item

    def close(self) -> None:
        self._generation.close()


class _Prepared(NamedTuple):
    expanded: ExpandedPrompt  # the prompt as the kit expanded it (expand_prompt), handed to its prefill
    prompt: list[int]  # the real ids (a vision kit's images expanded)
    cache: SequenceCache  # the prompt cache's entry this request decodes into
    todo: list[int]  # the part of the prompt that cache lacks (all but the last token)
    drafter: Drafter | None
    draft_drafter: DraftModelDrafter | None  # the draft model inside ``drafter``, to prefill


class _Cancelled(Exception):
    pass


def run(kit: ModelKit, req: Request) -> Driver:
    """Run a validated request on the kit (on its engine thread)."""
    act = kit.activity
    steps = prepared = None
    model_work = False  # whether the caches may hold a half-recorded forward pass
    try:
        act.begin(req.request_id)
        stats = GenerationStats(prompt_tokens=len(req.prompt))
        t_start = time.perf_counter()
        if len(act.active) == 1:
            mx.reset_peak_memory()  # not under another running request's feet
        # The sampler carries its own key (sampling.build_sampler): the request's
        # seed, or one drawn from MLX's global stream here, once per request.
        sampler = build_sampler(req.params)
        prepared = _prepare(kit, req, stats)
        model_work = True
        try:
            yield from _process_prompt(kit, prepared, req.progress_cb, lambda: _stop_requested(kit, req.request_id))
        except _Cancelled:
            stats.total_time = time.perf_counter() - t_start
            yield _final(GenerationResult("", []), "user_cancelled", stats, req.stats_cb)
            return
        steps = _decode(kit, req, prepared, stats, sampler)
        yield from _results(kit, req, steps, stats, t_start, len(prepared.todo))
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


def _prepare(kit: ModelKit, req: Request, stats: GenerationStats) -> _Prepared:
    """Expand the prompt, reuse the cached prefix, plan against the cache and
    build the drafter (timing the cost set-up apart)."""
    expanded = kit.expand_prompt(req.prompt, req.images)  # a vision kit expands its images here
    prompt = expanded.ids
    stats.prompt_tokens = len(prompt)
    entry, hit = kit.prompt_cache.select(expanded.keys[:-1])  # the cached sequence sharing the longest prefix
    try:
        stats.cached_tokens = entry.sync_to(expanded.keys[:-1])
        stats.cache_source = hit.source if stats.cached_tokens else "none"
        stats.cache_entries = len(kit.prompt_cache.entries)
        todo = prompt[stats.cached_tokens : -1]
        decoding = req.plan.for_cache(entry, len(todo))
        t_setup = time.perf_counter()
        drafter, draft_drafter = build_drafter(kit, decoding, prompt, stats, req.request_id)
        stats.setup_time = time.perf_counter() - t_setup
    except BaseException:
        kit.prompt_cache.release(entry)
        raise
    return _Prepared(expanded, prompt, entry, todo, drafter, draft_drafter)


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
        draft_todo = len(prompt) - 1 - common_prefix_length(draft_drafter.cache.tokens, prompt[:-1])
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
    # The draft model's chunks ride along with the main model's, one of each
    # per step (a draft chunk costs a fraction of a main one), so neither
    # stalls the other rows for a whole prompt nor adds steps to this one's.
    draft = () if draft_drafter is None else draft_drafter.prefill_prompt(prompt, chunk_done(draft_weight), chunk)
    for _ in zip_longest(main, draft):
        yield TURN
    report(100.0)


def _decode(kit: ModelKit, req: Request, prepared: _Prepared, stats: GenerationStats, sampler: Sampler) -> Decoding:
    """The one verify/accept/rewind loop for this request."""

    def on_fallback(reason: str) -> None:
        stats.mode_switches.append(f"{stats.decoding_mode} -> plain: {reason}")
        stats.decoding_mode = "plain"

    constraint = None
    if req.grammar is not None:
        constraint = GrammarConstraint(kit, req.grammar, draft_forced=req.structured_drafting)
    return decode(
        prepared.cache,
        list(prepared.prompt),
        req.max_tokens,
        sampler,
        build_logits_processors(req.params),
        req.params.repetition_context_size,
        prepared.drafter,
        stats,
        on_fallback,
        constraint,
    )


def _results(kit, req: Request, steps: Decoding, stats: GenerationStats, t_start: float, processed: int) -> Driver:
    """Streamed results for the loop's tokens, ending with exactly one final
    result: an end token, a stop string, a complete grammar, the token limit or
    cancellation. The loop's launches pass through (their rounds back in)."""
    stream = TextStream(kit.tokenizer.detokenizer, req.stop_strings)
    calls = _ToolCalls(req)
    t_first, n = None, 0

    def finish(text: str, tokens: list[Token], tops, stop) -> GenerationResult:
        stats.generated_tokens = n
        text, made, deltas = calls.split(text, final=True)
        result = GenerationResult(text, tokens, tops, tool_calls=made, tool_call_deltas=deltas)
        return _finish(result, calls.stop_reason(stop, text), stats, req.stats_cb, t_start, t_first, processed)

    rnd = None
    while True:
        try:
            step = steps.send(rnd)
        except StopIteration:
            return
        rnd = None
        if isinstance(step, Launch):
            rnd = yield step  # a forward pass, for the scheduler; its round goes back to the loop
            continue
        t_first = t_first or time.perf_counter()
        if _stop_requested(kit, req.request_id):
            yield finish(stream.finish().text, [], None, "user_cancelled")
            return
        n += 1
        tok = step.token
        if tok in kit.eos_token_ids:
            tail = stream.finish()
            reason = "stop_string" if tail.stop_string else "eos_token"
            yield finish(tail.text, [], None, GenerationStopCondition(reason, tail.stop_string, [tok]))
            return
        token = Token(tok, kit.tokenizer.decode([tok]), step.logprob, step.from_draft)
        tops = [_top_logprobs(kit, step.logprobs, req.params.top_logprobs)] if req.params.top_logprobs else None
        last = n >= req.max_tokens
        event = stream.push(tok, final=last or step.completes_grammar)
        if event.stop_string is not None:
            stop = GenerationStopCondition("stop_string", event.stop_string, event.stop_tokens)
            yield finish(event.text, [token], tops, stop)
            return
        if step.completes_grammar or last:
            yield finish(event.text, [token], tops, "grammar_complete" if step.completes_grammar else "token_limit")
            return
        text, made, deltas = calls.split(event.text)
        result = GenerationResult(text, [token], tops, tool_calls=made, tool_call_deltas=deltas)
        if calls.repeated:  # the model repeated a call of this answer: it has nothing more to add
            stats.generated_tokens = n
            yield _finish(result, "tool_calls", stats, req.stats_cb, t_start, t_first, processed)
            return
        yield result


class _ToolCalls:
    """Tool calls parsed out of a request's text (when it has tools and may
    call them: then the tools' grammar holds every call, so calls stream)."""

    def __init__(self, req: Request):
        spec = req.tools
        self.stream = None
        self.made = 0  # calls completed so far
        self.text_after = False  # text shown after the last call
        if spec is not None and spec.choice != "none":
            self.stream = ToolCallStream(spec.format, spec.names, streamed=True)

    @property
    def repeated(self) -> bool:
        """Whether the answer repeated one of its calls (and so is over)."""
        return self.stream is not None and self.stream.repeated

    def split(self, text: str, final: bool = False) -> tuple[str, list[ToolCall], list[ToolCallDelta]]:
        """``(text to show, calls completed, call deltas)``; ``final`` ends the text."""
        if self.stream is None:
            return text, [], []
        out = self.stream.feed(text)
        if final:
            end = self.stream.finish()
            out = (out.text + end.text, out.calls + end.calls, out.deltas + end.deltas)
        text, made, deltas = out[:3]
        self.made += len(made)
        self.text_after = bool(text.strip()) if made else self.text_after or bool(text.strip())
        return text, made, deltas

    def stop_reason(self, stop, final_text: str):
        """``tool_calls`` for an answer that ended on its complete calls (an end
        token, a complete grammar), else ``stop`` unchanged."""
        reason = stop.stop_reason if isinstance(stop, GenerationStopCondition) else stop
        if self.made and not self.text_after and reason in ("eos_token", "grammar_complete"):
            tokens = stop.stop_tokens if isinstance(stop, GenerationStopCondition) else None
            return GenerationStopCondition("tool_calls", None, tokens)
        return stop


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


def _top_logprobs(kit: ModelKit, logprobs: mx.array, n: int) -> list[TopLogprob]:
    idx = mx.argpartition(-logprobs, kth=n - 1)[:n]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    ids, lps = idx[order].tolist(), vals[order].tolist()
    return [TopLogprob(i, kit.tokenizer.decode([i]), lp) for i, lp in zip(ids, lps)]


def _finish(result, stop, stats, stats_cb, t_start, t_first, processed_prompt) -> GenerationResult:
    now = time.perf_counter()
    t_first = t_first or now
    stats.time_to_first_token = t_first - t_start
    prompt_time = stats.time_to_first_token - stats.setup_time
    stats.prompt_tps = processed_prompt / prompt_time if prompt_time > 0 else 0.0
    if stats.generated_tokens > 1 and now > t_first:
        stats.generation_tps = (stats.generated_tokens - 1) / (now - t_first)
    stats.total_time = now - t_start
    return _final(result, stop, stats, stats_cb)


def _final(result: GenerationResult, stop: StopReason | GenerationStopCondition, stats, stats_cb) -> GenerationResult:
    stats.peak_memory = int(mx.get_peak_memory())
    result.stop_condition = stop if isinstance(stop, GenerationStopCondition) else GenerationStopCondition(stop)
    result.stats = stats
    if stats_cb is not None:
        try:
            stats_cb(stats)
        except Exception as exc:
            raise CallbackError(f"stats_callback raised {type(exc).__name__}: {exc}") from exc
    return result
