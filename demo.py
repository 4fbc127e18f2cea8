#!/usr/bin/env python
"""Command-line demo of mlx-engine: stream an answer with statistics.

python demo.py                                   # SmolLM2-135M-Instruct answers a question
python demo.py --chat                            # multi-turn chat; the prompt cache grows each turn
python demo.py --prompt "Name three rivers in Europe."
python demo.py --model path/to/model.gguf --prompt "Hello"
python demo.py --prompt-lookup-num-tokens 8      # prompt-lookup decoding
python demo.py --auto-speculative                # let the engine choose
python demo.py --draft                           # speculation with the default model's drafter (its EAGLE-3 head)
python demo.py --json-schema person.json --prompt "Describe a person as JSON."
python demo.py --model path/to/vlm --images a.png b.jpg --prompt "Compare them"
python demo.py --parallel 4                      # four questions at once, decoded in one batch
python demo.py --tools examples/tools.json       # a tool call, the tool's result, then the answer
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse
import ast
import json
import logging
import math
import operator
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."
DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly and accurately."
# Base models (no chat template), like the bundled toy model, continue this text.
DEFAULT_BASE_PROMPT = (
    'import os\n\n\ndef list_python_files(root):\n    """Return the paths of all .py files under root."""\n'
)
PARALLEL_QUESTIONS = (
    DEFAULT_QUESTION,
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "What is 12 times 12?",
    "Give one tip for writing clear code.",
    "Which planet is closest to the sun?",
    "Translate 'good morning' into French.",
)
DEFAULT_TOOL_QUESTION = "What is 23 times 19?"
LMSTUDIO_DIRS = (Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models")


def resolve_model(name: str | None) -> str | Path:
    """A path, a catalog name (default: SmolLM2-135M-Instruct), or a model
    name under the LM Studio models folders."""
    if name is None:
        return me.DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.exists() or name.lower() in me.CATALOG:
        return path if path.exists() else name
    for root in LMSTUDIO_DIRS:
        if (root / name).exists():
            return root / name
    return path  # load_model reports it clearly


class OneLineParser(argparse.ArgumentParser):
    """argparse with each mistake as one line on stderr (``demo.py: error: ...``), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description="Stream text from a local model with mlx-engine.")
    p.add_argument(
        "--model",
        help=f"model directory, .gguf file, catalog name, or a name under the LM Studio models folders (default: {me.DEFAULT_MODEL})",
    )
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat (an empty line or EOF ends it)")
    p.add_argument("--prompt", default=None, help="prompt text; '-' reads standard input")
    p.add_argument(
        "--system",
        default=None,
        help=f"system message for the chat template (default: {DEFAULT_SYSTEM!r}; '' for none)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1] (default: off)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="e.g. 1.2; small models loop without one")
    p.add_argument("--max-tokens", type=int, default=200, help="most tokens to generate (default: %(default)s)")
    p.add_argument("--stop-strings", nargs="*", default=None, help="stop at any of these strings (default: none)")
    p.add_argument(
        "--top-logprobs", type=int, default=None, help="print this many alternatives per token, 0-20 (default: none)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: none)")
    p.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="a rotating KV window of this many tokens (default: the model's context)",
    )
    p.add_argument("--print-prompt-progress", action="store_true", help="show a prompt-processing progress bar")
    p.add_argument(
        "--draft-model", default=None, help="draft model for speculative decoding (a path or a catalog name)"
    )
    p.add_argument(
        "--draft",
        action="store_true",
        help="use the drafter the catalog lists for --model (smollm2-135m-draft for the default model)",
    )
    p.add_argument("--num-draft-tokens", type=int, default=None, help="fixed draft length (default: adaptive)")
    p.add_argument(
        "--prompt-lookup-num-tokens", type=int, default=None, help="prompt-lookup decoding with this many draft tokens"
    )
    p.add_argument(
        "--auto-speculative",
        action="store_true",
        help="let the engine pick plain, prompt lookup or draft model per request",
    )
    p.add_argument(
        "--json-schema", default=None, metavar="FILE", help="constrain the answer to this JSON schema (a .json file)"
    )
    p.add_argument("--regex", default=None, help="constrain the answer to this regular expression")
    p.add_argument("--grammar", default=None, metavar="FILE", help="constrain the answer to this Lark grammar file")
    p.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="OpenAI tool definitions (a .json list, e.g. examples/tools.json): the model calls one, the demo "
        "runs it and the model answers from its result",
    )
    p.add_argument(
        "--tool-choice",
        default="required",
        metavar="CHOICE",
        help="auto, required (default: a 135M model seldom calls on its own) or a tool's name",
    )
    p.add_argument(
        "--images", nargs="+", default=None, metavar="FILE", help="image files for a vision model (sent base64-encoded)"
    )
    p.add_argument("--verbose", action="store_true", help="log engine decisions")
    p.add_argument(
        "--parallel",
        type=int,
        default=None,
        metavar="N",
        help="answer N prompts at once (built-in questions, or --prompt N times) and print the aggregate throughput",
    )
    p.add_argument(
        "--sharded",
        action="store_true",
        help="shard the model over the ranks of an mlx.launch job (implied under mlx.launch; docs/distributed.md)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.draft:
        if args.draft_model:
            parser.error("--draft picks the catalog's draft model; pass it or --draft-model, not both")
        args.draft_model = me.catalog.draft_for(args.model or me.DEFAULT_MODEL)
        if args.draft_model is None:
            parser.error(f"--draft: the catalog lists no draft model for {args.model!r}; pass --draft-model")
    if args.prompt_lookup_num_tokens is not None and args.draft_model and not args.auto_speculative:
        parser.error(
            "--prompt-lookup-num-tokens and --draft-model are two different drafters; pick one, or add --auto-speculative"
        )
    if args.num_draft_tokens is not None and not args.draft_model:
        parser.error("--num-draft-tokens needs --draft-model")
    if args.max_tokens <= 0:
        parser.error("--max-tokens must be positive")
    if sum(x is not None for x in (args.json_schema, args.regex, args.grammar)) > 1:
        parser.error("--json-schema, --regex and --grammar are alternatives; pass one")
    if args.tools and (args.chat or args.parallel or args.images or args.json_schema or args.regex or args.grammar):
        parser.error("--tools runs one tool-calling exchange; it takes no --chat, --parallel, --images or constraint")
    if args.chat and (args.images or args.prompt is not None):
        parser.error("--chat reads the messages from the terminal; it takes no --prompt or --images")
    if args.parallel is not None and not 1 <= args.parallel <= 64:
        parser.error("--parallel must be from 1 to 64")
    if args.parallel is not None and (args.chat or args.images or args.sharded):
        parser.error("--parallel runs independent prompts on one process; it takes no --chat, --images or --sharded")
    for name in args.images or []:  # before any model loads
        if not Path(name).expanduser().is_file():
            parser.error(f"--images: {name!r} is not a file")
    try:
        check_values(args)
    except ValueError as exc:
        parser.error(" ".join(str(exc).split()))
    return args


def check_values(args: argparse.Namespace) -> None:
    """What can be checked without a model, checked before one loads
    (``ValueError`` naming the flag): numbers, files, constraints, the draft."""
    from mlx_engine.structured import validate_constraint

    for flag, value, ok, allowed in (
        ("--temp", args.temp, lambda x: x >= 0, ">= 0 (0 is greedy)"),
        ("--top-p", args.top_p, lambda x: 0 < x <= 1, "in (0, 1]"),
        ("--repetition-penalty", args.repetition_penalty, lambda x: x > 0, "> 0"),
    ):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {allowed}, got {value}")
    if args.top_logprobs is not None and not 0 <= args.top_logprobs <= 20:
        raise ValueError(f"--top-logprobs must be from 0 to 20, got {args.top_logprobs}")
    if args.stop_strings is not None and "" in args.stop_strings:
        raise ValueError("--stop-strings: a stop string must not be empty")
    if args.tools:
        read_tools(args.tools)
    files = {flag: read_file(getattr(args, flag), flag) for flag in ("json_schema", "grammar")}
    if files["json_schema"] is not None:
        try:
            json.loads(files["json_schema"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema: {args.json_schema!r} is not JSON: {exc}") from None
    try:
        validate_constraint(json_schema=files["json_schema"], regex=args.regex, grammar=files["grammar"])
    except me.InvalidArgument as exc:
        raise ValueError(f"--{exc.param.replace('_', '-')}: {exc}") from None
    if args.draft_model:
        found = resolve_model(args.draft_model)
        if isinstance(found, Path) and not found.exists():
            raise ValueError(
                f"--draft-model: {args.draft_model!r} was not found: not a path, a catalog name "
                f"({', '.join(me.CATALOG)}) or a name under {', '.join(str(d) for d in LMSTUDIO_DIRS)}"
            )


def read_file(name: str | None, flag: str) -> str | None:
    """The text of the file a flag names (None when not given); ``ValueError`` naming the flag."""
    if name is None:
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"--{flag.replace('_', '-')}: {name!r} is not a file")
    return path.read_text(encoding="utf-8")


def uses_chat(kit: me.ModelKit, args: argparse.Namespace) -> bool:
    return bool(getattr(kit.tokenizer, "chat_template", None)) and not args.no_chat_template


def read_prompt(kit: me.ModelKit, args: argparse.Namespace) -> str:
    if args.prompt == "-":
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("--prompt -: standard input was empty")
        return text
    if args.prompt is not None:
        return args.prompt
    return DEFAULT_QUESTION if uses_chat(kit, args) else DEFAULT_BASE_PROMPT


def system_messages(args: argparse.Namespace) -> list[dict]:
    system = DEFAULT_SYSTEM if args.system is None else args.system
    return [{"role": "system", "content": system}] if system else []


def build_prompt(kit: me.ModelKit, args: argparse.Namespace, text: str, history: list[dict]) -> list[int]:
    """Token ids for the next request: the chat so far plus ``text`` under the
    chat template, or the raw text for a base model."""
    n_images = len(args.images or [])
    if n_images and isinstance(kit, me.VisionModelKit) and not uses_chat(kit, args):
        # One image placeholder per image, before the text.
        return [kit.placeholder_id] * n_images + me.tokenize(kit, text)
    if uses_chat(kit, args):
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}] if n_images else text
        messages = (history or system_messages(args)) + [{"role": "user", "content": content}]
        return me.apply_chat_template(kit, messages)
    if args.system:
        text = f"{args.system}\n\n{text}"
    return me.tokenize(kit, text)


def read_images(paths: list[str]) -> list[str]:
    """Base64-encode image files (the engine decodes and checks them)."""
    import base64

    encoded = []
    for name in paths:
        path = Path(name).expanduser()
        encoded.append(base64.b64encode(path.read_bytes()).decode("ascii"))
    return encoded


def constraints(args: argparse.Namespace) -> dict:
    """Structured-output arguments from --json-schema / --regex / --grammar."""
    out = {"regex": args.regex} if args.regex is not None else {}
    for flag in ("json_schema", "grammar"):
        text = read_file(getattr(args, flag), flag)
        if text is not None:
            out[flag] = text
    return out


# -- tools -------------------------------------------------------------------------
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def arithmetic(expression: str) -> float:
    """Evaluate + - * / % ** and parentheses over numbers (nothing else is run)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return value(ast.parse(expression.replace("^", "**"), mode="eval").body)


def run_tool(call: me.ToolCall) -> dict:
    """The example tools of examples/tools.json. get_weather makes the weather up
    from the city's name (a demo without network access); other tools are unknown here."""
    try:
        if call.name == "calculator":
            return {"result": arithmetic(str(call.arguments.get("expression", "")))}
        if call.name == "get_weather":
            city = str(call.arguments.get("city", ""))
            celsius = 5 + sum(map(ord, city)) % 25
            unit = call.arguments.get("unit", "celsius")
            temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
            return {"city": city, "temperature": temperature, "unit": unit, "note": "made up by the demo"}
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
        return {"error": str(exc)}
    return {"error": f"the demo has no implementation of {call.name!r}"}


def read_tools(name: str) -> list[dict]:
    try:
        return json.loads(read_file(name, "tools"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--tools: {name!r} is not JSON: {exc}") from exc


def tool_choice(args: argparse.Namespace):
    return args.tool_choice if args.tool_choice in ("auto", "required", "none") else {"name": args.tool_choice}


def tools_exchange(kit: me.ModelKit, args: argparse.Namespace) -> int:
    """Ask with tools, run the calls the model makes, and stream its answer from their results."""
    tools = read_tools(args.tools)
    text = args.prompt or DEFAULT_TOOL_QUESTION
    messages = system_messages(args) + [{"role": "user", "content": text}]
    print(f"> {text}\n", flush=True)
    options = {**request_options(args), "tools": tools, "tool_choice": tool_choice(args), "parallel_tool_calls": False}
    final, answer, calls = generate(kit, args, me.apply_chat_template(kit, messages, tools=tools), None, options)
    if not calls:
        print_stats(final.stats, final.stop_condition)
        return 0
    messages.append(
        {
            "role": "assistant",
            "content": answer or None,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in calls
            ],
        }
    )
    for call in calls:
        result = json.dumps(run_tool(call))
        print(f"[tool call] {call.name}({call.arguments_json}) -> {result}", flush=True)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print()
    options["tool_choice"] = "none"  # the answer, in words, from the results
    final, _, _ = generate(kit, args, me.apply_chat_template(kit, messages, tools=tools), None, options)
    print_stats(final.stats, final.stop_condition)
    return 0


def progress_bar():
    from tqdm import tqdm

    bar = tqdm(total=100, desc="prompt", unit="%", leave=False, file=sys.stderr)

    def update(percent: float) -> bool:
        bar.update(percent - bar.n)
        if percent >= 100:
            bar.close()
        return True

    return update


def print_stats(s: me.GenerationStats, stop: me.GenerationStopCondition) -> None:
    lines = [
        f"Time to first token: {s.time_to_first_token:.2f}s",
        f"Prompt: {s.prompt_tokens} tokens ({s.cached_tokens} reused from cache), {rate(s.prompt_tps)}",
        f"Generated: {s.generated_tokens} tokens, {rate(s.generation_tps)}",
        f"Total time: {s.total_time:.2f}s",
        f"Stop reason: {stop.stop_reason}" + (f" ({stop.stop_string!r})" if stop.stop_string else ""),
        decoding_line(s),
    ]
    if s.setup_time >= 0.005:
        lines.insert(2, f"Cost set-up: {s.setup_time:.2f}s (in the time to first token, not the prompt rate)")
    if s.drafted_tokens:
        lines += [
            f"Drafted/accepted tokens: {s.drafted_tokens}/{s.accepted_tokens}",
            f"Acceptance rate: {s.acceptance_rate:.1%}",
            f"Mean accepted per round: {s.mean_accepted_per_round:.2f} over {s.verify_rounds} rounds",
        ]
    if s.grammar_drafted_tokens:
        lines.append(f"Grammar-forced tokens drafted/accepted: {s.grammar_drafted_tokens}/{s.grammar_accepted_tokens}")
    lines += [f"Mode switch: {m}" for m in s.mode_switches]
    lines.append(f"Peak memory: {s.peak_memory / 2**20:.1f} MiB")
    print("\n\nGeneration stats:", *(f" - {line}" for line in lines), sep="\n")


def rate(tps: float | None) -> str:
    """A rate for the statistics lines; None (nothing was timed) says so."""
    return "rate n/a" if tps is None else f"{tps:.1f} tok/s"


def decoding_line(s: me.GenerationStats) -> str:
    """The final mode; the reason given is for the first decision, so name it as such
    when the mode changed since (the switches follow)."""
    if not s.mode_reason:
        return f"Decoding: {s.decoding_mode}"
    if s.mode_switches:
        first = s.mode_switches[0].split(" -> ")[0]
        return f"Decoding: {s.decoding_mode}; started as {first} - {s.mode_reason}"
    return f"Decoding: {s.decoding_mode} - {s.mode_reason}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="[%(name)s] %(message)s")
    try:
        return run(args)
    except (
        ValueError,
        me.ShardedKitError,
    ) as exc:  # bad arguments, model folders, a failed rank: one line, like argparse
        if args.verbose:
            raise
        print(f"{Path(sys.argv[0]).name}: error: {error_line(exc, args)}", file=sys.stderr)
        return 2


def error_line(exc: ValueError, args: argparse.Namespace) -> str:
    """The error, naming the folders searched when a model name was not found."""
    message = " ".join(str(exc).split())
    if isinstance(exc, me.ModelLoadError) and "does not exist" in message:
        names = [n for n in (args.model, args.draft_model) if n and not Path(n).expanduser().exists()]
        if names:
            message += f" (also looked for {names[0]!r} under {', '.join(str(d) for d in LMSTUDIO_DIRS)})"
    return message


def request_options(args: argparse.Namespace) -> dict:
    """create_generator's arguments from the command line."""
    return dict(
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop_strings=args.stop_strings,
        top_logprobs=args.top_logprobs,
        prompt_progress_callback=progress_bar() if args.print_prompt_progress and not args.parallel else None,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        auto_speculative=args.auto_speculative,
        **constraints(args),
    )


def generate(
    kit: me.ModelKit, args: argparse.Namespace, prompt: list[int], images_b64, options: dict | None = None
) -> tuple[me.GenerationResult, str, list[me.ToolCall]]:
    """Stream one answer to stdout; returns the final result, the whole text and the tool calls."""
    final, pieces, calls = None, [], []
    for result in me.create_generator(kit, prompt, images_b64=images_b64, **(options or request_options(args))):
        calls += result.tool_calls
        sys.stdout.write(result.text)
        sys.stdout.flush()
        pieces.append(result.text)
        if args.top_logprobs and result.top_logprobs:
            for tok, tops in zip(result.tokens, result.top_logprobs):
                alts = ", ".join(f"{t.text!r}:{t.logprob:.2f}" for t in tops)
                print(f"\n    [{tok.text!r} {tok.logprob:.2f}] {alts}", file=sys.stderr)
        final = result
    return final, "".join(pieces), calls


def chat(kit: me.ModelKit, args: argparse.Namespace) -> int:
    """Multi-turn chat: each turn sends the whole conversation, and the kit's
    prompt cache reuses everything but the newest message."""
    if not uses_chat(kit, args):
        raise ValueError("--chat needs a model with a chat template")
    history = system_messages(args)
    print("Chat with the model; an empty line or end of input ends it.", file=sys.stderr)
    while True:
        try:
            text = input("\n> ")
        except EOFError:
            return 0
        if not text.strip():
            return 0
        prompt = build_prompt(kit, args, text, history)
        final, answer, _ = generate(kit, args, prompt, None)
        history = history + [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        print_stats(final.stats, final.stop_condition)


def parallel(kit: me.ModelKit, args: argparse.Namespace) -> int:
    """Answer N prompts at once, each consumed by its own thread; print each
    answer and the aggregate throughput."""
    n = args.parallel
    texts = (
        [args.prompt] * n
        if args.prompt is not None
        else [PARALLEL_QUESTIONS[i % len(PARALLEL_QUESTIONS)] for i in range(n)]
    )
    prompts = [build_prompt(kit, args, t, []) for t in texts]
    answers: list = [None] * n

    def answer(i: int) -> None:
        pieces, final = [], None
        try:
            for final in me.create_generator(kit, prompts[i], **request_options(args)):
                pieces.append(final.text)
            answers[i] = ("".join(pieces), final)
        except Exception as exc:  # shown with the others
            answers[i] = (f"error: {exc}", None)

    start = time.perf_counter()
    threads = [threading.Thread(target=answer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    total = 0
    for i, (text, (out, final)) in enumerate(zip(texts, answers)):
        print(f"[{i + 1}] > {text}\n{out.strip()}")
        if final is not None:
            total += final.stats.generated_tokens
            s = final.stats
            print(
                f"    ({s.generated_tokens} tokens, {rate(s.generation_tps)}, first token after {s.time_to_first_token:.2f} s; {decoding_line(s)})\n"
            )
    print(f"{n} requests, {total} tokens in {seconds:.2f} s: {total / seconds:.1f} tok/s aggregate", file=sys.stderr)
    return 0 if all(a[1] is not None for a in answers) else 1


def run(args: argparse.Namespace) -> int:
    if args.sharded or "MLX_RANK" in os.environ:  # rank 0 runs the demo, the other ranks serve it
        kit = me.load_sharded_model(resolve_model(args.model), max_kv_size=args.max_kv_size, seed=args.seed)
        if isinstance(kit, me.Follower):
            return 0 if kit.serve().reason == "stopped" else 1
    else:
        kit = me.load_model(
            resolve_model(args.model),
            max_kv_size=args.max_kv_size,
            seed=args.seed,
            max_parallel=max(args.parallel or 1, 4) if not args.images else None,
        )
    if args.draft_model:
        me.load_draft_model(kit, resolve_model(args.draft_model))
    if args.chat:
        return chat(kit, args)
    if args.parallel:
        return parallel(kit, args)
    if args.tools:
        return tools_exchange(kit, args)
    images_b64 = read_images(args.images) if args.images else None
    text = read_prompt(kit, args)
    prompt = build_prompt(kit, args, text, [])
    if uses_chat(kit, args):
        print(f"> {text}\n", flush=True)
    else:
        sys.stdout.write(kit.tokenizer.decode(prompt))  # a base model continues the text: show it
    final, _, _ = generate(kit, args, prompt, images_b64)
    print_stats(final.stats, final.stop_condition)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
