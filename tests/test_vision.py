"""Vision-language models: images through the engine's own cache and loop.

The reference for correctness is mlx-vlm's own one-shot computation (its
``get_input_embeddings`` over the whole sequence, then the language model
without a cache): every greedy token the engine produces must be the
reference's argmax at that position, up to near-ties."""

import mlx_engine as me
from mlx_engine.kits.images import decode_images
from mlx_engine.loading.vision import process_image

import base64
import struct
import zlib

import mlx.core as mx
import pytest
from helpers import NEAR_TIE_TOLERANCE, first_divergence, generate_ids, round_robin

from fixtures.tiny_vlm import image_b64, make_gemma3, make_llava, make_qwen2_vl, make_text_draft

RED = image_b64((255, 0, 0))
BLUE = image_b64((0, 0, 255))
GREEN = image_b64((0, 200, 0), size=(80, 48))


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vlm")


@pytest.fixture(scope="session")
def qwen_vl_path(vlm_dir):
    return make_qwen2_vl(vlm_dir / "qwen2_vl")


@pytest.fixture(scope="session")
def gemma_path(vlm_dir):
    return make_gemma3(vlm_dir / "gemma3", sliding_window=256)


@pytest.fixture(scope="session")
def gemma_small_window_path(vlm_dir):
    return make_gemma3(vlm_dir / "gemma3_w8", sliding_window=8)


@pytest.fixture(scope="session")
def vlm_draft_path(vlm_dir, qwen_vl_path):
    return make_text_draft(vlm_dir / "qwen_draft", qwen_vl_path)


@pytest.fixture(scope="session")
def qwen_kit(qwen_vl_path):
    return me.load_model(qwen_vl_path)


@pytest.fixture(scope="session")
def gemma_kit(gemma_path):
    return me.load_model(gemma_path)


@pytest.fixture(params=["qwen2_vl", "gemma3"])
def any_kit(request, qwen_kit, gemma_kit):
    kit = qwen_kit if request.param == "qwen2_vl" else gemma_kit
    kit.cache.reset()
    return kit


def chat(kit, *turns, images_per_turn=None):
    """Token ids of a chat prompt: each turn is (role, text, n_images)."""
    messages = []
    for role, text, n_images in turns:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        messages.append({"role": role, "content": content})
    return list(kit.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def user(kit, text, n_images=1):
    return chat(kit, ("user", text, n_images))


def expanded(kit, prompt, images_b64):
    """The prompt with its image placeholders expanded (a fresh computation)."""
    imgs = iter(decode_images(images_b64))
    out = []
    for t in prompt:
        out.extend(_process(kit, next(imgs)).expansion if t == kit.placeholder_id else [t])
    return out


def _process(kit, img):
    """The processor's entry for one decoded image, computed afresh (not the kit's cached one)."""
    return process_image(kit.processor, kit.tokenizer, kit.image_tokens, img.image)


def reference_logits(kit, prompt, images_b64, continuation=()):
    """mlx-vlm's one-shot logits for prompt + continuation (no cache)."""
    decoded = decode_images(images_b64 or [])
    entries = [_process(kit, i) for i in decoded]
    ids = mx.array(expanded(kit, prompt, images_b64 or []) + list(continuation))[None]
    vlm = kit.vlm
    if entries:
        pv = mx.concatenate([e.pixel_values for e in entries], axis=0)
        extras = {k: mx.concatenate([e.extras[k] for e in entries], axis=0) for k in entries[0].extras}
        f = vlm.get_input_embeddings(ids, pv, mask=mx.ones(ids.shape, dtype=mx.int32), **extras)
    else:
        f = vlm.get_input_embeddings(ids, None, mask=mx.ones(ids.shape, dtype=mx.int32))
    kw = {k: v for k, v in f.to_dict().items() if v is not None and k not in ("inputs_embeds", "attention_mask_4d")}
    lm = vlm.language_model
    if hasattr(lm, "_rope_deltas"):
        lm._rope_deltas = lm._position_ids = None
    return lm(ids, inputs_embeds=f.inputs_embeds, **kw).logits[0]


# The reference batches the vision tower over all images and runs the whole
# sequence at once, so it rounds differently from the engine's per-image features
# and chunked, cached passes; a wrong position or a misplaced image row changes
# logits by far more than this.
REFERENCE_TOLERANCE = 1e-2


def assert_matches_reference(kit, prompt, images_b64, ids):
    """Every greedy token is the reference argmax at its position (or a near-tie)."""
    logits = reference_logits(kit, prompt, images_b64, ids)
    n_prompt = logits.shape[0] - len(ids)
    for i, tok in enumerate(ids):
        row = logits[n_prompt - 1 + i]
        gap = (row.max() - row[tok]).item()
        assert gap < REFERENCE_TOLERANCE, f"token {i} ({tok}) is {gap:.3g} below the reference argmax"


def assert_same_or_near_tie_vision(kit, prompt, images_b64, plain_ids, other_ids):
    """Greedy outputs are equal, or diverge only at a near-tie of the reference."""
    pos = first_divergence(plain_ids, other_ids)
    if pos is None:
        return
    row = reference_logits(kit, prompt, images_b64, plain_ids[:pos])[-1]
    gap = abs((row[plain_ids[pos]] - row[other_ids[pos]]).item()) if pos < min(len(plain_ids), len(other_ids)) else 0.0
    assert gap < NEAR_TIE_TOLERANCE, f"outputs diverge at {pos} where the logit gap is {gap:.2e}"


def run(kit, prompt, images=None, **kw):
    kw.setdefault("max_tokens", 12)
    return generate_ids(kit, prompt, images_b64=images, **kw)


# -- loading ------------------------------------------------------------------
def test_load_gives_vision_kit_and_vocab_only(qwen_vl_path, qwen_kit):
    assert isinstance(qwen_kit, me.VisionModelKit) and isinstance(qwen_kit, me.ModelKit)
    assert qwen_kit.vocab_size == len(qwen_kit.tokenizer.get_vocab())
    vocab_kit = me.load_model(qwen_vl_path, vocab_only=True)
    assert isinstance(vocab_kit, me.VisionModelKit) and vocab_kit.model is None
    assert me.tokenize(vocab_kit, "What colour?") == me.tokenize(qwen_kit, "What colour?")
    with pytest.raises(ValueError, match="vocab_only"):
        me.create_generator(vocab_kit, user(vocab_kit, "hi"), images_b64=[RED])
    with pytest.raises(ValueError, match="max_image_pixels"):
        me.load_model(qwen_vl_path, max_image_pixels=0)
    with pytest.raises(ValueError, match="kv_bits"):
        me.load_model(qwen_vl_path, kv_bits=4)


# -- generation -----------------------------------------------------------------
def test_image_and_text_only_generation_match_mlx_vlm(any_kit):
    kit = any_kit
    prompt = user(kit, "What colour is this?")
    ids, final = run(kit, prompt, [RED], max_tokens=16)
    assert final.stop_condition.stop_reason in ("token_limit", "eos_token")
    assert final.stats.prompt_tokens == len(expanded(kit, prompt, [RED])) > len(prompt)
    assert final.stats.cached_tokens == 0 and ids
    assert_matches_reference(kit, prompt, [RED], ids)

    # The image matters: another image gives other first-token logprobs.
    def tops(img):
        first = next(iter(me.create_generator(kit, prompt, images_b64=[img], max_tokens=1, top_logprobs=5)))
        return [(t.id, round(t.logprob, 4)) for t in first.top_logprobs[0]]

    assert tops(RED) != tops(BLUE)
    # Text-only prompts work on a vision kit (no placeholders, no images).
    text = user(kit, "Hello world, how are you today?", n_images=0)
    ids, final = run(kit, text, None, max_tokens=16)
    assert final.stats.prompt_tokens == len(text)
    assert_matches_reference(kit, text, [], ids)
    ids2, _ = run(kit, text, [], max_tokens=16)
    assert ids2 == ids


def test_several_images(any_kit):
    kit = any_kit
    prompt = chat(kit, ("user", "Compare the two images.", 2))
    ids, final = run(kit, prompt, [RED, GREEN], max_tokens=16)
    assert final.stats.prompt_tokens == len(expanded(kit, prompt, [RED, GREEN]))
    assert_matches_reference(kit, prompt, [RED, GREEN], ids)
    swapped, _ = run(kit, prompt, [GREEN, RED], max_tokens=16)
    assert_matches_reference(kit, prompt, [GREEN, RED], swapped)


def test_stop_strings_and_stats_as_for_text(qwen_kit):
    prompt = user(qwen_kit, "Describe the picture.")
    ids, _ = run(qwen_kit, prompt, [RED], max_tokens=12)
    text = qwen_kit.tokenizer.decode(ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("degenerate output")
    results = list(me.create_generator(qwen_kit, prompt, images_b64=[RED], max_tokens=12, stop_strings=[stop]))
    final = results[-1]
    assert final.stop_condition.stop_reason == "stop_string"
    assert stop not in "".join(r.text for r in results)
    assert final.stats.generated_tokens <= 12 and final.stats.time_to_first_token > 0


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_more_architectures_with_reuse(vlm_dir, arch):
    if arch == "llava":
        path = make_llava(vlm_dir / "llava")
    else:
        path = make_qwen2_vl(vlm_dir / arch, model_type=arch)
    kit = me.load_model(path)
    prompt = chat(kit, ("user", "Compare the two images.", 2))
    ids, _ = run(kit, prompt, [RED, GREEN], max_tokens=10)
    assert_matches_reference(kit, prompt, [RED, GREEN], ids)
    follow = prompt + ids + me.tokenize(kit, " The picture")
    ids2, final = run(kit, follow, [RED, GREEN], max_tokens=10)
    assert final.stats.cached_tokens >= len(expanded(kit, prompt, [RED, GREEN]))
    assert_matches_reference(kit, follow, [RED, GREEN], ids2)


def test_max_kv_size_bounds_a_vision_kit(qwen_vl_path):
    kit = me.load_model(qwen_vl_path, max_kv_size=16)
    prompt = user(kit, "Describe the picture in one sentence.")
    ids, final = run(kit, prompt, [RED], max_tokens=6, prompt_lookup_num_tokens=3)
    assert len(ids) == 6 or final.stop_condition.stop_reason == "eos_token"
    assert final.stats.decoding_mode == "plain" and "window of 16 tokens" in final.stats.mode_reason


# -- bad images -----------------------------------------------------------------
def _zero_size_png() -> str:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    "images, match",
    [
        (["not base64 at all!!"], r"images_b64\[0\] is not valid base64"),
        ([base64.b64encode(b"hello, I am text, not a picture").decode()], r"images_b64\[0\] is not an image"),
        ([_zero_size_png()], r"images_b64\[0\] has zero size"),
        ([image_b64(size=(300, 300))], r"images_b64\[0\] has too many pixels"),
        ([RED, RED], r"images_b64 has 2 image\(s\) but prompt_tokens has 1 image placeholder"),
        ([], r"images_b64 has 0 image\(s\) but prompt_tokens has 1"),
        ([RED, ""], r"images_b64\[1\] is empty"),
        ([RED, 5], r"images_b64\[1\] must be a base64 string"),
        (RED, r"images_b64 must be a list"),
    ],
)
def test_bad_images_are_refused_before_model_work(qwen_vl_path, images, match):
    kit = me.load_model(qwen_vl_path, max_image_pixels=200 * 200)
    prompt = user(kit, "What colour is this?")
    with pytest.raises(ValueError, match=match):
        me.create_generator(kit, prompt, images_b64=images)
    assert kit.cache.tokens == [] and not kit.activity.active
    ids, final = run(kit, prompt, [RED], max_tokens=3)
    assert final.stats.generated_tokens == 3 or final.stop_condition.stop_reason == "eos_token"


def test_text_kit_refuses_images(llama_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "hello")
    with pytest.raises(ValueError, match="images_b64: this is a text-only model"):
        me.create_generator(kit, prompt, images_b64=[RED])
    assert generate_ids(kit, prompt, max_tokens=2, images_b64=[])[1].stats.generated_tokens == 2


def test_data_url_and_jpeg_accepted(qwen_kit):
    jpeg = image_b64((10, 200, 30), fmt="JPEG")
    prompt = user(qwen_kit, "What colour is this?")
    ids, _ = run(qwen_kit, prompt, ["data:image/jpeg;base64," + jpeg], max_tokens=4)
    assert ids == run(qwen_kit, prompt, [jpeg], max_tokens=4)[0]


# -- prompt cache -----------------------------------------------------------------
@pytest.mark.slow
def test_cache_reuse_with_same_image_equals_fresh_kit(qwen_vl_path, gemma_path):
    for path in (qwen_vl_path, gemma_path):
        kit = me.load_model(path)
        calls = _count_vision_calls(kit)
        prompt = user(kit, "What colour is this?")
        ids, first = run(kit, prompt, [RED], max_tokens=8)
        n1 = first.stats.prompt_tokens
        assert calls["n"] == 1
        follow = chat(
            kit,
            ("user", "What colour is this?", 1),
            ("assistant", kit.tokenizer.decode(ids), 0),
            ("user", "And now?", 0),
        )
        ids2, second = run(kit, follow, [RED], max_tokens=8)
        assert second.stats.cached_tokens >= n1 - 8  # the whole first prompt, image included
        assert calls["n"] == 1  # the image's features were not recomputed
        fresh = me.load_model(path)
        assert ids2 == run(fresh, follow, [RED], max_tokens=8)[0]
        # The same request again reuses everything but the last prompt token.
        ids3, third = run(kit, follow, [RED], max_tokens=8)
        assert third.stats.cached_tokens == third.stats.prompt_tokens - 1 and ids3 == ids2
        # Other text before the image: the KV cache stops before the image, but
        # the image's features come from the kit's feature cache.
        other = chat(kit, ("system", "Be brief.", 0), ("user", "What colour is this?", 1))
        ids4, fourth = run(kit, other, [RED], max_tokens=8)
        assert fourth.stats.cached_tokens < len(other) and calls["n"] == 1
        assert ids4 == run(me.load_model(path), other, [RED], max_tokens=8)[0]


def test_changed_image_invalidates_from_its_position(qwen_vl_path, gemma_path):
    for path in (qwen_vl_path, gemma_path):
        kit = me.load_model(path)
        prompt = chat(kit, ("user", "Compare the two images.", 2))
        run(kit, prompt, [RED, GREEN], max_tokens=4)
        expanded = kit.expand_prompt(prompt, decode_images([RED, BLUE]))
        first_row_of_second = expanded.images[1][0] + expanded.images[1][1].rows[0]
        ids, final = run(kit, prompt, [RED, BLUE], max_tokens=10)
        assert final.stats.cached_tokens == first_row_of_second
        fresh = me.load_model(path)
        assert ids == run(fresh, prompt, [RED, BLUE], max_tokens=10)[0]
        # Changing the first image keeps only the text before it.
        _, final = run(kit, prompt, [BLUE, BLUE], max_tokens=2)
        assert final.stats.cached_tokens == expanded.images[0][0] + expanded.images[0][1].rows[0]


def test_mrope_positions_after_image_survive_reuse_and_trims(qwen_vl_path):
    """Qwen2-VL's text positions after an image are offset by the image's grid
    (rope delta); reused prefixes, trims and text-only follow-ups must keep them."""
    kit = me.load_model(qwen_vl_path)
    prompt = user(kit, "Describe the picture.")
    ids, _ = run(kit, prompt, [GREEN], max_tokens=6)
    # A text-only request in between resets the delta; then the image prompt returns.
    run(kit, user(kit, "Hello world", n_images=0), None, max_tokens=3)
    follow = prompt + ids + me.tokenize(kit, " The picture shows")
    ids2, final = run(kit, follow, [GREEN], max_tokens=10)
    assert final.stats.cached_tokens > 0
    assert_matches_reference(kit, follow, [GREEN], ids2)
    assert kit.prompt_cache.active.position_shift != 0


def _count_vision_calls(kit):
    calls = {"n": 0}
    original = kit.vlm.get_input_embeddings

    def counting(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    kit.vlm.get_input_embeddings = counting
    return calls


# -- cancellation -----------------------------------------------------------------
def test_cancellation_then_correct_generation(qwen_vl_path):
    kit = me.load_model(qwen_vl_path)
    prompt = user(kit, "Describe the picture in one sentence.")
    gen = me.create_generator(kit, prompt, images_b64=[RED], max_tokens=20)
    next(gen)
    next(gen)
    gen.close()
    assert not kit.activity.active
    rid = "vision-cancel"
    results = []
    for r in me.create_generator(kit, prompt, images_b64=[BLUE], max_tokens=20, request_id=rid):
        results.append(r)
        if len(results) == 2:
            assert me.stop_generation(kit, rid)
    assert results[-1].stop_condition.stop_reason == "user_cancelled"
    ids, final = run(kit, prompt, [RED], max_tokens=10)
    assert final.stats.cached_tokens > 0
    assert ids == run(me.load_model(qwen_vl_path), prompt, [RED], max_tokens=10)[0]
    # Cancelling from the progress callback during the image prefill.
    _, final = run(kit, prompt, [GREEN], max_tokens=5, prompt_progress_callback=lambda p: p < 1)
    assert final.stop_condition.stop_reason == "user_cancelled"
    ids, _ = run(kit, prompt, [GREEN], max_tokens=10)
    assert ids == run(me.load_model(qwen_vl_path), prompt, [GREEN], max_tokens=10)[0]


# -- speculation --------------------------------------------------------------------
def test_prompt_lookup_and_auto_are_exact_on_image_prompts(qwen_kit):
    kit = qwen_kit
    kit.cache.reset()
    # A repetitive prompt so lookup has something to copy.
    text = "def add(a, b):\n    return a + b\n\n" * 6
    prompt = user(kit, text)
    plain, _ = run(kit, prompt, [RED], max_tokens=24)
    kit.cache.reset()
    ids, final = run(kit, prompt, [RED], max_tokens=24, prompt_lookup_num_tokens=4)
    assert final.stats.decoding_mode == "prompt_lookup"
    assert final.stats.drafted_tokens > 0
    assert_same_or_near_tie_vision(kit, prompt, [RED], plain, ids)
    kit.cache.reset()
    ids, final = run(kit, prompt, [RED], max_tokens=24, auto_speculative=True)
    assert final.stats.decoding_mode.startswith("auto:")
    assert_same_or_near_tie_vision(kit, prompt, [RED], plain, ids)


def test_lookup_drafter_sees_real_token_ids(qwen_kit):
    from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter

    seen = []
    original = PromptLookupDrafter.match  # every lookup drafter's match (suffix drafting's too) goes through it

    def spy(self, history, n):
        seen.append(min(history))
        out = original(self, history, n)
        assert all(t >= 0 for t in out.drafts)
        return out

    PromptLookupDrafter.match = spy
    try:
        run(qwen_kit, user(qwen_kit, "What colour is this?"), [RED], max_tokens=6, prompt_lookup_num_tokens=3)
    finally:
        PromptLookupDrafter.match = original
    assert seen and min(seen) >= 0


def test_text_draft_model_drafts_for_image_prompts(qwen_vl_path, vlm_draft_path, cheap_draft):
    kit = me.load_model(qwen_vl_path)
    report = me.check_draft_model(kit, vlm_draft_path)
    assert report.compatible, report.reasons
    vocab_report = me.check_draft_model(me.load_model(qwen_vl_path, vocab_only=True), vlm_draft_path)
    assert vocab_report.compatible
    assert not me.check_draft_model(kit, qwen_vl_path).compatible  # a vision model is no draft
    prompt = user(kit, "Describe the picture in one sentence.")
    plain, _ = run(kit, prompt, [RED], max_tokens=20)
    me.load_draft_model(kit, vlm_draft_path)
    for k in (None, 3):
        kit.cache.reset()
        ids, final = run(kit, prompt, [RED], max_tokens=20, num_draft_tokens=k)
        assert final.stats.decoding_mode == "draft_model"
        assert final.stats.drafted_tokens > 0
        assert_same_or_near_tie_vision(kit, prompt, [RED], plain, ids)
    # A follow-up with a changed image: the main cache stops at the image; still exact.
    ids, final = run(kit, prompt, [BLUE], max_tokens=20, num_draft_tokens=3)
    plain_blue, _ = run(me.load_model(qwen_vl_path), prompt, [BLUE], max_tokens=20)
    assert 0 < final.stats.cached_tokens < final.stats.prompt_tokens - 1
    assert_same_or_near_tie_vision(kit, prompt, [BLUE], plain_blue, ids)


def test_unrewindable_cache_falls_back_with_reason(gemma_small_window_path):
    """gemma3 with an 8-token sliding window and a longer prompt: its rotating
    cache has wrapped and cannot be rewound, so speculation falls back."""
    kit = me.load_model(gemma_small_window_path)
    prompt = user(kit, "Describe the picture in one sentence. " * 2)
    plain, _ = run(kit, prompt, [RED], max_tokens=12)
    assert_matches_reference(kit, prompt, [RED], plain)
    ids, final = run(kit, prompt, [RED], max_tokens=12, prompt_lookup_num_tokens=4)
    assert final.stats.decoding_mode == "plain"
    assert "fell back" in final.stats.mode_reason and "cannot be rewound" in final.stats.mode_reason
    assert final.stats.cached_tokens == 0  # nor can a cached prefix be trimmed
    assert ids == plain


# -- demo -----------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_with_images(qwen_vl_path, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = []
    for name, data in (("a.png", RED), ("b.jpg", image_b64((0, 0, 255), fmt="JPEG"))):
        (tmp_path / name).write_bytes(base64.b64decode(data))
        files.append(str(tmp_path / name))
    cmd = [
        sys.executable,
        str(root / "demo.py"),
        "--model",
        str(qwen_vl_path),
        "--images",
        *files,
        "--prompt",
        "Compare the two images.",
        "--max-tokens",
        "6",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "Generation stats:" in out.stdout and "Stop reason:" in out.stdout


@pytest.mark.parametrize("size", [(3000, 1), (1, 3000)])
def test_image_the_processor_refuses_fails_early_and_keeps_the_cache(qwen_kit, size):
    """An extreme aspect ratio is refused by the model's image processor: in
    create_generator, naming the item, and the prompt cache survives."""
    prompt = user(qwen_kit, "describe")
    generate_ids(qwen_kit, prompt, max_tokens=2, images_b64=[RED])
    cached = list(qwen_kit.cache.tokens)
    with pytest.raises(ValueError, match=r"images_b64\[1\] was refused by the model's image processor"):
        me.create_generator(qwen_kit, chat(qwen_kit, ("user", "two", 2)), images_b64=[RED, image_b64(size=size)])
    assert qwen_kit.cache.tokens == cached
    stats = generate_ids(qwen_kit, prompt, max_tokens=2, images_b64=[RED])[1].stats
    assert stats.cached_tokens == stats.prompt_tokens - 1  # all but the last prompt token reused


def test_image_requests_run_as_rows_of_one_batch_and_equal_their_solo_runs(qwen_vl_path, qwen_kit):
    """M-RoPE's position shift belongs to each request's cached sequence, so
    requests with different images (and none) decode as rows of one batch,
    a prompt-lookup row among them, each as it runs alone; a long image prompt
    prefills in chunks between the others' steps."""
    kit = me.load_model(qwen_vl_path, max_parallel=4)
    seen = []
    jobs = [
        (user(kit, "Describe the picture in detail. " * 50), [GREEN], {}),
        (user(kit, "What colour is it?"), [BLUE], {"prompt_lookup_num_tokens": 4}),
        (user(kit, "Hello world", n_images=0), None, {}),
        (user(kit, "Compare the two.", n_images=2), [GREEN, BLUE], {}),
    ]
    want = [run(qwen_kit, p, imgs, max_tokens=10, **kw)[0] for p, imgs, kw in jobs]
    gens = [me.create_generator(kit, p, images_b64=imgs, max_tokens=10, **kw) for p, imgs, kw in jobs[1:]]
    first = [t.id for t in next(gens[0]).tokens]  # open while the long image prompt prefills
    p, imgs, kw = jobs[0]
    gens.insert(0, me.create_generator(kit, p, images_b64=imgs, max_tokens=10, prompt_progress_callback=seen.append))
    widths = []
    got, _ = round_robin(gens, lambda: widths.append(kit.worker.call(lambda: len(kit.batch.rows) if kit.batch else 0)))
    got[1] = first + got[1]
    assert max(widths) >= 2
    assert len([p for p in seen if 0 < p < 100]) >= 2  # the image prompt prefilled in chunks between steps
    for (p, imgs, _), w, ids in zip(jobs, want, got):
        assert_same_or_near_tie_vision(kit, p, imgs, w, ids)
