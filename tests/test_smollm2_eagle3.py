"""The EAGLE-3 head's training scripts (training/extract_smollm2_hidden.py,
training/train_smollm2_eagle3.py, training/eval_smollm2_eagle3.py) on a tiny
random llama target: the saved layout, the training-time test's alignment and
the head's proposals against mlx-vlm's drafter."""

import mlx_engine as me  # noqa: F401  (first: loads OpenBLAS before mlx.core)

import argparse
import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

pytestmark = pytest.mark.training

VOCAB, HIDDEN, LAYERS = 96, 64, 4
AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def target():
    mx.random.seed(3)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return SimpleNamespace(model=model, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def head(target):
    from training import train_smollm2_eagle3 as tr

    h = tr.new_head(target, np.arange(0, VOCAB, 2), seed=1, aux_ids=AUX)  # draft vocabulary: the even ids
    for layer in (h.fc, h.layers[0]):  # a trained head's scale: random drafts, no ties
        layer.update(tree_map(lambda w: 3 * w, layer.parameters()))
    return h


def _sequence(target, n=40, seed=0):
    from training.extract_smollm2_hidden import aux_hidden

    ids = np.random.default_rng(seed).integers(3, VOCAB, size=n).astype(np.int32)
    aux = aux_hidden(target.model, mx.array(ids)[None], AUX)[0]
    return ids, aux


def test_aux_hidden_are_the_named_layers_outputs(target):
    from training.extract_smollm2_hidden import aux_hidden

    ids = mx.array([[5, 9, 11, 4]])
    got = aux_hidden(target.model, ids, AUX)
    inner, h, outs = target.model.model, target.model.model.embed_tokens(ids), []
    for layer in inner.layers:
        h = layer(h, "causal", None)
        outs.append(h)
    assert got.shape == (1, 4, 3 * HIDDEN)
    assert mx.allclose(got, mx.concatenate([outs[i - 1] for i in AUX], axis=-1), atol=1e-5)


def test_head_proposals_equal_mlx_vlm_drafter(target, head):
    from training.eval_smollm2_eagle3 import free_chain, mlx_vlm_chain

    ids, aux = _sequence(target)
    draft_ids = np.arange(0, VOCAB, 2)
    for origin in (5, 17, 30):
        ours = free_chain(head, draft_ids, aux, ids, origin, 4)
        theirs = mlx_vlm_chain(head, target, aux, ids, origin, 4)
        assert ours == theirs and all(t % 2 == 0 for t in ours)  # d2t maps into the even ids


def test_saved_layout_loads_back(target, head, tmp_path):
    from training.eval_smollm2_eagle3 import free_chain
    from training.train_smollm2_eagle3 import load_head, save_head

    draft_ids = np.arange(0, VOCAB, 2)
    save_head(head, draft_ids, tmp_path / "f", {"steps": 0})
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert cfg["draft_vocab_size"] == VOCAB // 2 and cfg["transformer_layer_config"]["vocab_size"] == VOCAB
    keys = set(mx.load(str(tmp_path / "f" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "layers.")) for k in keys)  # the target's embedding is used
    loaded, ids_back = load_head(tmp_path / "f", target)
    assert np.array_equal(ids_back, draft_ids)
    ids, aux = _sequence(target, seed=1)
    assert free_chain(loaded, draft_ids, aux, ids, 10, 3) == free_chain(head, draft_ids, aux, ids, 10, 3)
    save_head(head, draft_ids, tmp_path / "q", {"steps": 0}, bits=8)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["bits"] == 8
    quant, _ = load_head(tmp_path / "q", target)
    assert "midlayer.mlp.up_proj.scales" in set(mx.load(str(tmp_path / "q" / "model.safetensors")))
    assert len(free_chain(quant, draft_ids, aux, ids, 10, 3)) == 3


def test_batches_score_answer_tokens_two_ahead():
    from training.train_smollm2_eagle3 import make_batch

    ids = np.arange(10, 40, dtype=np.int32)  # prompt 10..19, answer 20..39
    data = SimpleNamespace(ids=[ids], hidden=[np.zeros((30, 6), np.float16)], prompt=[10])
    t2d = np.full(VOCAB, -1)
    t2d[np.arange(10, 40, 3)] = np.arange(10)  # a sparse draft vocabulary
    args = argparse.Namespace(max_len=64, depths=3)
    aux, tok, idx, cand, y, mask = make_batch(data, [0], t2d, np.array([0, 1]), args)
    idx, targets = np.array(idx), np.array(cand)[np.array(y)]
    predicted = ids[idx + 2]  # entry q predicts token q + 2
    assert np.all(predicted >= 20) and np.array_equal(t2d[predicted], targets)
    assert set(predicted) == {t for t in range(20, 40) if t2d[t] >= 0}
    assert np.array_equal(np.array(mask)[2], (idx >= 2).astype(np.float32))  # depth 2 needs an origin q - 2


def test_training_steps_lower_the_loss(target, head):
    import mlx.nn as nn
    import mlx.optimizers as optim

    from training.train_smollm2_eagle3 import Eagle3DraftModel, freeze_target_parts, loss_fn, make_batch

    h = Eagle3DraftModel(head.config)
    h.update(head.parameters())
    freeze_target_parts(h)
    ids, aux = _sequence(target, n=48, seed=2)
    data = SimpleNamespace(ids=[ids], hidden=[np.array(aux)], prompt=[8])
    t2d = np.full(VOCAB, -1)
    t2d[np.arange(0, VOCAB, 2)] = np.arange(VOCAB // 2)
    batch = make_batch(data, [0], t2d, np.arange(8), argparse.Namespace(max_len=64, depths=3))
    step, opt, losses = nn.value_and_grad(h, loss_fn), optim.Adam(learning_rate=3e-3), []
    for _ in range(12):
        loss, grads = step(h, *batch, 3, 0.8)
        opt.update(h, grads)
        mx.eval(h.parameters(), opt.state)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_recipe_counts_only_whole_right_prefixes_of_chains():
    from training.eagle3_recipe import accepted_chains, agreement_summary

    ids = np.arange(10, 20)  # entries 0..8; entry q's depth-k draft is for token q + 2
    right0 = ids[2:].tolist() + [0]
    right0[3] = -1  # the chain from origin 3 fails at its first draft
    depth1 = np.full(9, -1)
    depth1[[4, 5]] = ids[[6, 7]]  # depth 1 right at entries 4 and 5 (chains from origins 3 and 4)
    table = accepted_chains([np.array(right0), depth1], ids, prompt_len=4)
    # origins 2..6 (the first draft an answer token, the whole chain inside the sequence)
    assert table.tolist() == [[True, False], [False, False], [True, True], [True, False], [True, False]]
    summary = agreement_summary([table])
    assert summary["chain_origins"] == 5 and summary["accepted_by_position"] == [0.8, 0.2]
    assert summary["conditional_by_position"] == [0.8, 0.25] and summary["mean_accepted_of_depth"] == 1.0


def test_recipe_draft_vocabulary_comes_from_training_answers_only():
    from training.eagle3_recipe import (
        d2t_offsets,
        draft_vocabulary,
        frequent_drafts,
        held_out_indices,
        target_to_draft,
        training_indices,
    )

    held = np.array([1, 7, 7, 7, 7, 7, 7])  # sequence 0 is held out: its frequent 7 must not count
    seqs = [held] + [np.array([1, 3, 3, 5, 9, 3, 5])] * 3
    lens = np.array([[1, len(s) - 1] for s in seqs])
    draft = draft_vocabulary(seqs, lens, 3, 12)
    assert draft.tolist() == [3, 5, 9]
    t2d = target_to_draft(draft, 12)
    assert t2d[[3, 5, 9, 7]].tolist() == [0, 1, 2, -1]
    assert (np.arange(3) + d2t_offsets(draft)).tolist() == [3, 5, 9]
    assert frequent_drafts(seqs, lens, draft, 12, 1).tolist() == [0]  # 3, the most frequent
    assert held_out_indices(25, 2) == [0, 10] and 0 not in training_indices(25) and 11 in training_indices(25)
