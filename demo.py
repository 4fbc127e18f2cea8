#!/usr/bin/env python
"""Command-line demo of mlx-engine: stream a completion with statistics.

    python demo.py                                   # bundled demo model
    python demo.py --model path/to/model --prompt "Hello"
    python demo.py --draft-model models/pystd-draft  # speculative decoding
    python demo.py --prompt-lookup-num-tokens 8      # prompt-lookup decoding
    python demo.py --auto-speculative                # let the engine choose
    python demo.py --model path/to/vlm --images a.png b.jpg --prompt "Compare them"
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = ROOT / "models" / "pystd-target"
DEFAULT_PROMPT = "import os\n\n\ndef list_python_files(root):\n    \"\"\"Return the paths of all .py files under root.\"\"\"\n"
LMSTUDIO_DIRS = (Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models")


def resolve_model(name: str | None) -> Path:
    """A path, or a model name under the LM Studio models folders."""
    if name is None:
        if not (DEFAULT_MODEL / "config.json").exists():
            sys.exit(
                f"The bundled demo model is missing at {DEFAULT_MODEL}.\n"
                "Pass --model /path/to/model (a Hugging Face-layout MLX model directory), "
                "or train the demo models with: python scripts/train_demo_models.py"
            )
        return DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.exists():
        return path
    for root in LMSTUDIO_DIRS:
        if (root / name).exists():
            return root / name
    return path  # load_model reports it clearly


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Stream text from a local model with mlx-engine.")
    p.add_argument("--model", help="model directory, or a name under the LM Studio models folders (default: bundled demo model)")
    p.add_argument("--prompt", default=None, help="prompt text; '-' reads standard input")
    p.add_argument("--system", default=None, help="system message (used with the chat template)")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None, help="e.g. 1.2; small models loop without one")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--stop-strings", nargs="*", default=None)
    p.add_argument("--top-logprobs", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-kv-size", type=int, default=None)
    p.add_argument("--print-prompt-progress", action="store_true", help="show a prompt-processing progress bar")
    p.add_argument("--draft-model", default=None, help="draft model for speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="fixed draft length (default: adaptive)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=None, help="prompt-lookup decoding with this many draft tokens")
    p.add_argument("--auto-speculative", action="store_true", help="let the engine pick plain, prompt lookup or draft model per request")
    p.add_argument("--images", nargs="+", default=None, metavar="FILE", help="image files for a vision model (sent base64-encoded)")
    p.add_argument("--verbose", action="store_true", help="log engine decisions")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_lookup_num_tokens is not None and args.draft_model and not args.auto_speculative:
        parser.error("--prompt-lookup-num-tokens and --draft-model are two different drafters; pick one, or add --auto-speculative")
    if args.num_draft_tokens is not None and not args.draft_model:
        parser.error("--num-draft-tokens needs --draft-model")
    if args.max_tokens <= 0:
        parser.error("--max-tokens must be positive")
    for name in args.images or []:  # before any model loads
        if not Path(name).expanduser().is_file():
            parser.error(f"--images: {name!r} is not a file")
    return args


def build_prompt(kit: me.ModelKit, args: argparse.Namespace) -> list[int]:
    text = args.prompt
    if text == "-":
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("--prompt -: standard input was empty")
    if text is None:
        text = DEFAULT_PROMPT
    template = getattr(kit.tokenizer, "chat_template", None)
    n_images = len(args.images or [])
    if n_images and isinstance(kit, me.VisionModelKit) and (not template or args.no_chat_template):
        # One image placeholder per image, before the text.
        return [kit.placeholder_id] * n_images + me.tokenize(kit, text)
    if template and not args.no_chat_template:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}] if n_images else text
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": content}]
        return list(kit.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
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
        f"Prompt: {s.prompt_tokens} tokens ({s.cached_tokens} reused from cache), {s.prompt_tps:.1f} tok/s",
        f"Generated: {s.generated_tokens} tokens, {s.generation_tps:.1f} tok/s",
        f"Total time: {s.total_time:.2f}s",
        f"Stop reason: {stop.stop_reason}" + (f" ({stop.stop_string!r})" if stop.stop_string else ""),
        decoding_line(s),
    ]
    if s.setup_time >= 0.005:
        lines.insert(2, f"One-off cost measurement: {s.setup_time:.2f}s (in the time to first token, not the prompt rate)")
    if s.drafted_tokens:
        lines += [
            f"Drafted/accepted tokens: {s.drafted_tokens}/{s.accepted_tokens}",
            f"Acceptance rate: {s.acceptance_rate:.1%}",
            f"Mean accepted per round: {s.mean_accepted_per_round:.2f} over {s.verify_rounds} rounds",
        ]
    lines += [f"Mode switch: {m}" for m in s.mode_switches]
    lines.append(f"Peak memory: {s.peak_memory / 2**20:.1f} MiB")
    print("\n\nGeneration stats:", *(f" - {line}" for line in lines), sep="\n")


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
    except ValueError as exc:  # bad arguments and model folders (ModelLoadError): one line, like argparse
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


def run(args: argparse.Namespace) -> int:
    kit = me.load_model(resolve_model(args.model), max_kv_size=args.max_kv_size, seed=args.seed)
    if args.draft_model:
        me.load_draft_model(kit, resolve_model(args.draft_model))
    images_b64 = read_images(args.images) if args.images else None
    prompt = build_prompt(kit, args)
    if args.no_chat_template or not getattr(kit.tokenizer, "chat_template", None):
        sys.stdout.write(kit.tokenizer.decode(prompt))  # a base model continues the text: show it
    final = None
    for result in me.create_generator(
        kit,
        prompt,
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop_strings=args.stop_strings,
        top_logprobs=args.top_logprobs,
        prompt_progress_callback=progress_bar() if args.print_prompt_progress else None,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        auto_speculative=args.auto_speculative,
        images_b64=images_b64,
    ):
        sys.stdout.write(result.text)
        sys.stdout.flush()
        if args.top_logprobs and result.top_logprobs:
            for tok, tops in zip(result.tokens, result.top_logprobs):
                alts = ", ".join(f"{t.text!r}:{t.logprob:.2f}" for t in tops)
                print(f"\n    [{tok.text!r} {tok.logprob:.2f}] {alts}", file=sys.stderr)
        final = result
    print_stats(final.stats, final.stop_condition)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
