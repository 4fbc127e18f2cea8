"""The output stage: the loop's tokens become streamed results.

``results`` turns each ``Step`` into a ``GenerationResult`` (whole characters,
stop strings held back and cut, tool calls taken out of the text, top logprobs)
and ends with exactly one final result carrying the stop condition and the
request's ``GenerationStats``. The stats are built once, at the end, from
values: what the prompt stage found (``PromptFacts``), the rounds the loop
reported on its steps (``SpeculationTally``), the router's report, the token
count and the times. Nothing writes into them afterwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import mlx.core as mx

from ..decode.protocol import Decoding, Launch, Round, Step
from ..drafters.router import AutoRouter
from ..errors import CallbackError
from ..kits.text import ModelKit
from ..results import (
    GenerationResult,
    GenerationStats,
    GenerationStopCondition,
    StopReason,
    Token,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from ..tools import ToolCallStream, ToolText
from .stop_strings import TextStream
from .validate import Request


class PromptFacts(NamedTuple):
    """What the prompt stage found, for the stats: the prompt's length, the
    cached prefix reused (and from where), the plan's mode and reason, and the
    one-off cost measurement's time (``setup_time``)."""

    prompt_tokens: int
    cached_tokens: int = 0
    cache_source: str = "none"
    cache_entries: int = 0
    setup_time: float = 0.0
    decoding_mode: str = "plain"
    mode_reason: str = ""


@dataclass
class SpeculationTally:
    """The speculation counts of one request, from the round outcomes its loop
    put on its steps (``Step.outcome``, ``Step.fallback``). ``router``: the auto
    router whose report names the mode, if the request has one."""

    mode: str = "plain"
    reason: str = ""
    router: AutoRouter | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    grammar_drafted: int = 0
    grammar_accepted: int = 0
    fallback: str | None = None
    tries: list[int] = field(default_factory=list)  # rounds that drafted position i
    hits: list[int] = field(default_factory=list)  # ... and had it accepted

    def add(self, step: Step) -> None:
        if step.fallback is not None and self.fallback is None:
            self.fallback = step.fallback
        o = step.outcome
        if o is None:
            return
        if o.forced:
            self.grammar_drafted += o.drafted
            self.grammar_accepted += o.accepted
            return
        self.rounds += 1
        self.drafted += o.drafted
        self.accepted += o.accepted
        while len(self.tries) < o.drafted:
            self.tries.append(0)
            self.hits.append(0)
        for i in range(o.drafted):
            self.tries[i] += 1
            self.hits[i] += i < o.accepted

    def fields(self) -> dict:
        """The speculation fields of ``GenerationStats``."""
        mode, reason, switches = self.mode, self.reason, []
        if self.router is not None:
            mode, reason, switches = self.router.decoding_mode, self.router.mode_reason, list(self.router.mode_switches)
        if self.fallback is not None:
            switches.append(f"{mode} -> plain: {self.fallback}")
            mode = "plain"
        return dict(
            decoding_mode=mode,
            mode_reason=reason,
            mode_switches=switches,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            rejected_tokens=self.drafted - self.accepted,
            verify_rounds=self.rounds,
            acceptance_by_position=[h / t for h, t in zip(self.hits, self.tries)],
            grammar_drafted_tokens=self.grammar_drafted,
            grammar_accepted_tokens=self.grammar_accepted,
        )


def build_stats(
    facts: PromptFacts,
    tally: SpeculationTally,
    generated: int,
    t_start: float,
    t_first: float | None,
    first_round: int = 1,
) -> GenerationStats:
    """The request's stats, once, at its end (``perf_counter`` times; ``t_first``
    None: it ended before its first token; ``first_round``: the tokens that came
    with the first, which the time to first token covers).

    Rates are taken only over work that was timed: ``prompt_tps`` over the prompt
    tokens processed (None when the whole prompt came from the cache), and
    ``generation_tps`` over the tokens after the first round, from the first
    token on (None when the first round brought them all: a short answer, or a
    draft that was accepted whole, has no interval to rate)."""
    now = time.perf_counter()
    first = t_first or now
    ttft = 0.0 if t_first is None else first - t_start
    processed = facts.prompt_tokens - facts.cached_tokens - 1  # the last prompt token is fed with the first round
    prompt_time = ttft - facts.setup_time
    later = generated - first_round
    return GenerationStats(
        prompt_tokens=facts.prompt_tokens,
        cached_tokens=facts.cached_tokens,
        cache_source=facts.cache_source,
        cache_entries=facts.cache_entries,
        time_to_first_token=ttft,
        prompt_tps=processed / prompt_time if processed > 0 and prompt_time > 0 else None,
        setup_time=facts.setup_time,
        generated_tokens=generated,
        generation_tps=later / (now - first) if later > 0 and now > first else None,
        total_time=now - t_start,
        peak_memory=int(mx.get_peak_memory()),
        **tally.fields(),
    )


def final_result(
    text: str,
    tokens: list[Token],
    tops,
    stop: StopReason | GenerationStopCondition,
    stats: GenerationStats,
    stats_cb: Callable | None,
    calls: tuple[list[ToolCall], list[ToolCallDelta]] = ([], []),
) -> GenerationResult:
    """The one final result, built whole; ``stats_cb`` sees its stats first."""
    if stats_cb is not None:
        try:
            stats_cb(stats)
        except Exception as exc:
            raise CallbackError(f"stats_callback raised {type(exc).__name__}: {exc}") from exc
    condition = stop if isinstance(stop, GenerationStopCondition) else GenerationStopCondition(stop)
    return GenerationResult(text, tokens, tops, condition, stats, tool_calls=calls[0], tool_call_deltas=calls[1])


def results(
    kit: ModelKit,
    req: Request,
    steps: Decoding,
    facts: PromptFacts,
    router: AutoRouter | None,
    t_start: float,
    stop_requested: Callable[[], bool],
) -> Generator:
    """Streamed results for the loop's tokens, ending with exactly one final
    result: an end token, a stop string, a complete grammar, the token limit or
    cancellation. The loop's launches pass through (their rounds back in)."""
    out = _Output(kit, req, facts, router, t_start)
    rnd: Round | None = None
    while True:
        try:
            step = steps.send(rnd)
        except StopIteration:
            return
        rnd = None
        if isinstance(step, Launch):
            out.launched()
            rnd = yield step  # a forward pass, for the scheduler; its round goes back to the loop
            continue
        out.t_first = out.t_first or time.perf_counter()
        if stop_requested():
            yield out.finish(out.stream.finish().text, [], None, "user_cancelled")
            return
        result, final = out.on_step(step)
        yield result
        if final:
            return


class _Output:
    """One request's output state: its text stream, tool calls, speculation
    tally, token count and times; ``finish`` builds the final result."""

    def __init__(self, kit: ModelKit, req: Request, facts: PromptFacts, router: AutoRouter | None, t_start: float):
        self.kit, self.req, self.facts, self.t_start = kit, req, facts, t_start
        self.stream = TextStream(kit.tokenizer.detokenizer, req.stop_strings)
        self.calls = _ToolCalls(req)
        self.tally = SpeculationTally(facts.decoding_mode, facts.mode_reason, router)
        self.n, self.t_first = 0, None
        self.first_round: int | None = None  # tokens before the first launch after the first token

    def launched(self) -> None:
        if self.t_first is not None and self.first_round is None:
            self.first_round = self.n

    def stats(self) -> GenerationStats:
        first_round = self.n if self.first_round is None else self.first_round
        return build_stats(self.facts, self.tally, self.n, self.t_start, self.t_first, first_round)

    def finish(self, text: str, tokens: list[Token], tops, stop) -> GenerationResult:
        text, made, deltas = self.calls.split(text, final=True)
        stop = self.calls.stop_reason(stop)
        return final_result(text, tokens, tops, stop, self.stats(), self.req.stats_cb, (made, deltas))

    def on_step(self, step: Step) -> tuple[GenerationResult, bool]:
        """The result for one token, and whether it is the final one."""
        kit, req = self.kit, self.req
        self.n += 1
        self.tally.add(step)
        tok = step.token
        if tok in kit.eos_token_ids:
            tail = self.stream.finish()
            reason = "stop_string" if tail.stop_string else "eos_token"
            return self.finish(tail.text, [], None, GenerationStopCondition(reason, tail.stop_string, [tok])), True
        token = Token(tok, kit.tokenizer.decode([tok]), step.logprob, step.from_draft)
        tops = [_top_logprobs(kit, step.logprobs, req.top_logprobs)] if req.top_logprobs else None
        last = step.at_limit  # the loop counts max_tokens; this stage only ends the text there
        event = self.stream.push(tok, final=last or step.completes_grammar)
        if event.stop_string is not None:
            stop = GenerationStopCondition("stop_string", event.stop_string, event.stop_tokens)
            return self.finish(event.text, [token], tops, stop), True
        if step.completes_grammar or last:
            stop = "grammar_complete" if step.completes_grammar else "token_limit"
            return self.finish(event.text, [token], tops, stop), True
        text, made, deltas = self.calls.split(event.text)
        if self.calls.repeated:  # the model repeated a call of this answer: it has nothing more to add
            return final_result(text, [token], tops, "tool_calls", self.stats(), req.stats_cb, (made, deltas)), True
        return GenerationResult(text, [token], tops, tool_calls=made, tool_call_deltas=deltas), False


class _ToolCalls:
    """Tool calls parsed out of a request's text (when it has tools and may
    call them: then the tools' grammar holds every call, so calls stream)."""

    def __init__(self, req: Request):
        spec = req.tools
        self.stream = None
        self.made = 0  # calls completed so far
        self.text_after = False  # whether text was shown after the last call
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
            out = ToolText(out.text + end.text, out.calls + end.calls, out.deltas + end.deltas)
        self.made += len(out.calls)
        self.text_after = bool(out.text.strip()) if out.calls else self.text_after or bool(out.text.strip())
        return out.text, out.calls, out.deltas

    def stop_reason(self, stop: StopReason | GenerationStopCondition) -> StopReason | GenerationStopCondition:
        """``tool_calls`` for an answer that ended on its complete calls (an end
        token, a complete grammar), else ``stop`` unchanged."""
        reason = stop.stop_reason if isinstance(stop, GenerationStopCondition) else stop
        if self.made and not self.text_after and reason in ("eos_token", "grammar_complete"):
            tokens = stop.stop_tokens if isinstance(stop, GenerationStopCondition) else None
            return GenerationStopCondition("tool_calls", None, tokens)
        return stop


def _top_logprobs(kit: ModelKit, logprobs: mx.array, n: int) -> list[TopLogprob]:
    """The ``n`` likeliest tokens at a position. Tokens a constraint (or a
    logit bias) masked out have a logprob of -inf: they are not alternatives and
    are left out, so the list can be shorter than ``n``, never non-finite."""
    idx = mx.argpartition(-logprobs, kth=n - 1)[:n]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    ids, lps = idx[order].tolist(), vals[order].tolist()
    return [TopLogprob(i, kit.tokenizer.decode([i]), lp) for i, lp in zip(ids, lps) if math.isfinite(lp)]
