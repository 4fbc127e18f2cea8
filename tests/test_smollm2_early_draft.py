"""The early-exit, trimmed-vocabulary draft trainer (training/train_smollm2_early_draft.py),
on the tiny llama fixture."""

import mlx_engine as me

import argparse
import json
import random

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from training import train_smollm2_early_draft as early

pytestmark = pytest.mark.training  # training/'s early-exit draft recipe, not the engine


@pytest.fixture(scope="module")
def tiny(llama_path):
    kit = me.load_model(llama_path)
    yield kit
    me.unload(kit)


def test_draft_with_every_layer_is_the_target_on_its_subset(tiny):
    ids = np.array([3, 10, 11, 40, 77])
    draft = early.new_draft(tiny, tiny.model.args.num_hidden_layers, ids, frozen=0)
    x = mx.array([[5, 9, 14, 30, 2, 8]])
    full, target = np.array(draft(x)), np.array(tiny.model(x))
    np.testing.assert_allclose(full[..., ids], target[..., ids], rtol=1e-4, atol=1e-4)
    others = np.setdiff1d(np.arange(full.shape[-1]), ids)
    assert np.all(np.isneginf(full[..., others]))  # never proposes a token outside the subset
    assert full.shape[-1] == tiny.vocab_size


def test_the_embedding_and_frozen_layers_do_not_train(tiny):
    draft = early.new_draft(tiny, 2, np.arange(20), frozen=1)
    names = {k for k, _ in nn.utils.tree_flatten(draft.trainable_parameters())}
    assert not any(k.startswith(("model.embed_tokens", "model.layers.0.")) or k == "token_ids" for k in names)
    assert "head.weight" in names and any(k.startswith("model.layers.1.") for k in names)


def _examples():
    rng = random.Random(1)
    out = []
    for i in range(6):
        answer = [rng.randrange(20, 60) for _ in range(30)] + [2]
        top_ids = [[t, 200, (t + 1) % 60] for t in answer]  # 200: outside the subset below
        out.append(
            {
                "index": i,
                "prompt": [1, 5, 6, 7],
                "answer": answer,
                "top_ids": top_ids,
                "top_lp": [[-0.2, -1.0, -2.5]] * len(answer),
            }
        )
    return out


def test_batches_score_only_answer_tokens_the_draft_can_propose():
    ids = np.array(sorted({2, *range(20, 50)}))  # answer tokens 50-59 are left out
    sub_of = np.full(300, -1)
    sub_of[ids] = np.arange(len(ids))
    args = argparse.Namespace(batch=4, seq=24, top_k=3, soft=0.5)
    x, idx, y, _, soft_p, soft_w = early.make_batch(_examples(), random.Random(0), args, sub_of)
    flat_next = np.concatenate([np.array(x)[:, 1:], np.zeros((4, 1), dtype=np.int32)], axis=1).reshape(-1)
    targets = ids[np.array(y)]
    inner = np.array(idx) % 24 < 23  # the last position's next token is past the row
    np.testing.assert_array_equal(targets[inner], flat_next[np.array(idx)][inner])
    assert np.all((targets >= 20) & (targets < 50) | (targets == 2))  # never a prompt token or one outside
    p = np.array(soft_p)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-5)  # renormalised over the subset
    assert np.all(p[:, 1] == 0)  # id 200 is not in the subset: no probability on it
    assert np.all(np.array(soft_w) == 0.5)


def test_training_lowers_the_loss_and_the_draft_reloads(tiny, tmp_path):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "shard-000000.json").write_text(json.dumps(_examples()))
    out = tmp_path / "out"
    argv = [
        "train",
        "--target",
        str(tiny.model_path),
        "--work",
        str(work),
        "--out",
        str(out),
        "--layers",
        "2",
        "--frozen",
        "1",
        "--vocab",
        "48",
        "--total-steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "32",
        "--warmup",
        "1",
    ]
    meta = early.train(early.parse(argv))
    assert meta["steps"] == 3 and meta["vocab"] == 48 and 0 < meta["coverage"] <= 1
    draft = early.load(tiny, out)
    saved = mx.load(str(out / "early_draft.safetensors"))
    np.testing.assert_array_equal(np.array(draft.head.weight), np.array(saved["head.weight"].astype(mx.float32)))
    np.testing.assert_array_equal(
        np.array(draft.model.layers[0].mlp.up_proj.weight), np.array(tiny.model.model.layers[0].mlp.up_proj.weight)
    )  # frozen: the target's

    sub_of = np.full(tiny.vocab_size, -1)
    sub_of[np.array(draft.token_ids)] = np.arange(48)
    batch = early.make_batch(
        _examples(), random.Random(0), argparse.Namespace(batch=2, seq=32, top_k=3, soft=0.7), sub_of
    )
    step = nn.value_and_grad(draft, early.loss_fn)
    opt = optim.Adam(learning_rate=1e-2)
    first, _ = step(draft, *batch)
    for _ in range(8):
        _, grads = step(draft, *batch)
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state)
    assert step(draft, *batch)[0].item() < first.item()


def test_engine_costs_price_the_draft_like_the_engine(tiny):
    draft = early.new_draft(tiny, 1, np.arange(64), frozen=0)
    out = early.engine_costs(tiny, draft, agreement=0.0)
    assert out["draft_chained_step_ms"] > 0 and out["target_step_ms"] > 0
    assert out["at_draft_length"] == 1 and out["predicted_speedup"] < 1  # a draft never accepted only costs
