"""Chat prompts for distilling a draft from SmolLM2-135M-Instruct.

Deterministic and offline: templates crossed with topics (free chat: stories,
explanations, lists, advice), plus tasks on text found on every machine
(docstrings and short functions of the Python standard library: summarise,
explain, quote, edit and return whole). The prompts of ``bench.chat`` are
excluded, so the benchmark measures the draft on prompts it never saw."""

from __future__ import annotations

import ast
import random
from pathlib import Path

from .corpus import HELDOUT_FILES, _all_files, stdlib_root

HELDOUT_EVERY = 25  # prompt i with i % 25 == 0 is held out for evaluation

TOPICS = (
    "a lighthouse keeper",
    "a lost cat",
    "the ocean",
    "a small village",
    "friendship",
    "a dragon",
    "the moon",
    "a busy city",
    "a forest at night",
    "a young inventor",
    "time travel",
    "a library",
    "a garden",
    "winter",
    "a train journey",
    "a baker",
    "the desert",
    "a mountain climber",
    "a space station",
    "an old clock",
    "a river",
    "a musician",
    "a teacher",
    "a storm",
    "a farmer",
    "a detective",
    "a birthday party",
    "a ghost",
    "a wizard",
    "a puppy",
    "the stars",
    "a football match",
    "a pirate ship",
    "an island",
    "a snowman",
    "a castle",
    "a scientist",
    "a bicycle",
    "a volcano",
    "autumn leaves",
    "a coffee shop",
    "a market",
    "a rainy day",
    "a bridge",
    "a fox",
    "an astronaut",
    "a sailor",
    "a school",
    "a treasure map",
    "a forest fire",
    "the internet",
    "electricity",
    "recycling",
    "healthy eating",
    "sleep",
    "exercise",
    "learning a language",
    "saving money",
    "climate change",
    "volcanoes",
    "the solar system",
    "gravity",
    "rainbows",
    "bees",
    "the human heart",
    "vaccines",
    "photosynthesis in algae",
    "the water cycle",
    "earthquakes",
    "black holes",
    "the printing press",
    "ancient Rome",
    "the pyramids",
    "democracy",
    "the stock market",
    "inflation",
    "machine learning",
    "databases",
    "computer networks",
    "encryption",
    "open source software",
    "version control",
    "the Python language",
    "recursion",
    "sorting algorithms",
    "cloud computing",
    "smartphones",
    "solar panels",
    "electric cars",
    "coffee",
    "tea",
    "chocolate",
    "bread",
    "cheese",
    "pizza",
    "chess",
    "music",
    "painting",
    "photography",
    "poetry",
    "dinosaurs",
    "whales",
    "elephants",
    "penguins",
    "tigers",
    "honey",
    "rain forests",
    "glaciers",
    "deserts",
    "oceans",
    "islands",
    "maps",
    "compasses",
    "telescopes",
    "microscopes",
    "bicycles",
)
TEMPLATES = (
    "Write a short story about {t}.",
    "Tell me a story about {t}.",
    "Write a poem about {t}.",
    "Write a haiku about {t}.",
    "Explain {t} to a ten-year-old.",
    "What is interesting about {t}?",
    "Give me five facts about {t}.",
    "List three pros and three cons of {t}.",
    "Describe {t} in a few sentences.",
    "Write a short essay about {t}.",
    "What should I know about {t}?",
    "Why do people like {t}?",
    "Write a dialogue between two friends about {t}.",
    "Give me some tips related to {t}.",
    "Write a product description for something inspired by {t}.",
    "Summarise what you know about {t}.",
    "Write a letter to a friend about {t}.",
    "Write a news headline and a short article about {t}.",
    "Can you tell me about {t}?",
    "How would you explain {t} in one paragraph?",
    "Write a children's story about {t}.",
    "Write a funny story about {t}.",
    "Write a sad story about {t}.",
    "Write a blog post introduction about {t}.",
    "What questions do people often ask about {t}?",
    "Write a short story in which {t} learns something new.",
    "Describe a day in the life of {t}.",
)
QUESTIONS = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "What is 12 times 7?",
    "Who wrote Hamlet?",
    "How do airplanes fly?",
    "Why is the sky blue?",
    "What is a prime number?",
    "How do I make a cup of tea?",
    "What is the difference between weather and climate?",
    "How can I improve my sleep?",
    "What is a function in programming?",
    "How many continents are there?",
    "What causes the seasons?",
    "Name three rivers in Europe.",
    "How do I write a for loop in Python?",
    "What is a noun?",
    "Give me a recipe for pancakes.",
    "How do I stay focused while studying?",
    "What is the speed of light?",
    "How do plants grow?",
    "What is a good name for a pet goldfish?",
    "How do I start running?",
)
PASSAGE_TASKS = (
    "Summarise this passage in three sentences.\n\n{p}",
    "Explain this text in simple words.\n\n{p}",
    "Document:\n{p}\n\nQuote the first sentence of the document.",
    "What is the main point of this text?\n\n{p}",
    "Rewrite this passage in plain English.\n\n{p}",
    "Repeat this text exactly, then give it a title.\n\n{p}",
)
CODE_TASKS = (
    "Explain what this function does.\n\n```python\n{c}```",
    "Add a docstring to this function and return the whole function.\n\n```python\n{c}```",
    "Rename the function to `{n}_v2` and return the whole function, unchanged otherwise.\n\n```python\n{c}```",
    "Add type hints to this function. Return the whole function.\n\n```python\n{c}```",
    "Is there a bug in this function?\n\n```python\n{c}```",
)
BENCH_PROMPT_STARTS = ("Write a short story about a robot who learns to paint.",)


def _stdlib_snippets(limit: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Docstring paragraphs and short functions (source, name) from non-held-out stdlib files."""
    root, held = stdlib_root(), set(HELDOUT_FILES)
    passages: list[str] = []
    functions: list[tuple[str, str]] = []
    for path in _all_files(root):
        if str(Path(path).relative_to(root)) in held:
            continue
        try:
            source = Path(path).read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                para = " ".join(doc.split("\n\n")[0].split())
                if 200 <= len(para) <= 900:
                    passages.append(para)
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0:
                seg = ast.get_source_segment(source, node) or ""
                if 150 <= len(seg) <= 1100:
                    functions.append((seg + "\n", node.name))
        if len(passages) >= limit and len(functions) >= limit:
            break
    return passages, functions


def chat_prompts(seed: int = 0, n_snippets: int = 1500) -> list[str]:
    """User messages, shuffled deterministically."""
    rng = random.Random(seed)
    out = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    out += list(QUESTIONS)
    passages, functions = _stdlib_snippets(n_snippets)
    out += [rng.choice(PASSAGE_TASKS).format(p=p) for p in passages]
    out += [rng.choice(CODE_TASKS).format(c=c, n=n) for c, n in functions]
    out = [p for p in dict.fromkeys(out) if p not in BENCH_PROMPT_STARTS]
    rng.shuffle(out)
    return out
