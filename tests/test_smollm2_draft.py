"""The draft model shipped for the default model (models/smollm2-135m-draft) and
the script that trains it (training/train_smollm2_draft.py)."""

import mlx_engine as me
from mlx_engine.loading import catalog

import argparse
import json
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_or_near_tie, generate_ids, requires_default_model

import demo

ROOT = Path(__file__).resolve().parents[1]
DRAFT_DIR = ROOT / "models" / "smollm2-135m-draft"
requires_draft = pytest.mark.skipif(not (DRAFT_DIR / "model.safetensors").exists(), reason="draft not present")


@requires_draft
def test_draft_is_a_small_quantized_catalog_model():
    assert catalog.lookup("smollm2-135m-draft") == DRAFT_DIR
    assert catalog.draft_for(me.DEFAULT_MODEL) == "smollm2-135m-draft"  # the head loads by name
    cfg = json.loads((DRAFT_DIR / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["vocab_size"] == 49152
    assert (DRAFT_DIR / "model.safetensors").stat().st_size <= 8 * 2**20
    assert (DRAFT_DIR / "README.md").exists() and (DRAFT_DIR / "eval.json").exists()


def test_missing_repository_model_is_explained(tmp_path):
    with pytest.raises(me.ModelLoadError, match="ships in the mlx-engine repository"):
        catalog.lookup("smollm2-135m-draft", repo_models=tmp_path)


@requires_default_model
@requires_draft
@pytest.mark.slow
def test_draft_serves_the_default_model_with_plain_greedy_output(smollm):
    assert me.is_draft_model_compatible(smollm, "smollm2-135m-draft")
    prompt = me.apply_chat_template(smollm, [{"role": "user", "content": "Write a short poem about the sea."}])
    plain, _ = generate_ids(smollm, prompt, max_tokens=32, temp=0.0)
    me.load_draft_model(smollm, "smollm2-135m-draft")
    try:
        # a fixed draft length makes the drafts, and so the acceptances, deterministic
        ids, last = generate_ids(smollm, prompt, max_tokens=32, temp=0.0, num_draft_tokens=2)
        assert last.stats.decoding_mode == "draft_model"
        assert last.stats.accepted_tokens > 0  # a trained draft agrees with the target somewhere
        assert_same_or_near_tie(smollm, prompt, plain, ids)
    finally:
        me.unload_draft_model(smollm)


def test_demo_draft_flag_picks_the_catalog_draft():
    assert demo.parse_args(["--draft"]).draft_model == "smollm2-135m-draft"
    with pytest.raises(SystemExit):
        demo.parse_args(["--model", "some/dir", "--draft"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--draft", "--draft-model", "d"])


@pytest.mark.training
def test_training_batches_score_answers_and_copy_windows():
    from training.train_smollm2_draft import make_batch, pca_embedding

    soft = {"top_ids": [[t, 7000] for t in range(100, 140)], "top_lp": [[-0.1, -2.5]] * 40}
    examples = [{"prompt": list(range(1, 11)), "answer": list(range(100, 140)), **soft}]
    args = argparse.Namespace(batch=4, seq=128, copy_frac=0.5, negatives=8, top_k=2, soft=0.5)
    x, idx, cand, y, soft_idx, soft_p, soft_w = make_batch(examples, random.Random(0), args, np.arange(10))
    cand, y, flat = np.array(cand), np.array(y), np.array(x).reshape(-1)
    assert x.shape == (4, 128)
    targets = cand[y]
    assert set(targets.tolist()) <= set(range(100, 140))  # only answer tokens are scored
    assert set(range(10)) <= set(cand.tolist())  # the frequent tokens are always candidates
    inputs = flat[np.array(idx)]
    inside = (inputs >= 100) & (inputs < 139)  # within an answer: the next answer token is the target
    assert inside.any() and np.all(inputs[inside] + 1 == targets[inside])
    w = np.array(soft_w)
    assert 0 < (w > 0).sum() < len(w)  # answer rows carry soft targets, copy windows do not
    assert np.all(cand[np.array(soft_idx)][w > 0, 0] == targets[w > 0])  # the top soft id is the greedy token
    assert np.allclose(np.array(soft_p).sum(1), 1.0)
    emb = pca_embedding(np.random.default_rng(0).normal(size=(50, 12)).astype(np.float32), 4)
    assert emb.shape == (50, 4) and abs(float(np.sqrt((emb**2).sum(1)).mean()) - 1.0) < 0.5


HEAD_DIR = ROOT / "models" / "smollm2-135m-eagle3"


def test_head_is_the_default_models_small_eagle3_drafter():
    assert catalog.lookup("smollm2-135m-eagle3") == HEAD_DIR
    cfg = json.loads((HEAD_DIR / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["draft_vocab_size"] == 16384 and cfg["quantization"]["bits"] == 4
    assert sum(f.stat().st_size for f in HEAD_DIR.iterdir()) <= 10 * 10**6
    assert (HEAD_DIR / "eval.json").exists() and (HEAD_DIR / "README.md").exists()


@requires_default_model
@pytest.mark.slow
def test_head_serves_the_default_model_with_plain_greedy_output(smollm):
    report = me.check_draft_model(smollm, "smollm2-135m-eagle3")
    assert report.compatible and report.kind == "eagle3"
    prompt = me.apply_chat_template(smollm, [{"role": "user", "content": "Write a short poem about the sea."}])
    plain, _ = generate_ids(smollm, prompt, max_tokens=24, temp=0.0)
    me.load_draft_model(smollm, "smollm2-135m-eagle3")
    try:
        ids, last = generate_ids(smollm, prompt, max_tokens=24, temp=0.0, num_draft_tokens=2)
        assert last.stats.decoding_mode == "draft_model" and last.stats.drafted_tokens > 0
        assert_same_or_near_tie(smollm, prompt, plain, ids)
    finally:
        me.unload_draft_model(smollm)
