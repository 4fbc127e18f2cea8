"""The PyTorch path of the EAGLE-3 recipe (training/torch_eagle3_head.py,
training/torch_eagle3.py) against the MLX one (training/train_smollm2_eagle3.py,
training/eval_smollm2_eagle3.py): the same head computes the same outputs and
loss, the evaluations count the same chains, each loads the other's checkpoint,
and a tiny training run on the real default model writes a head the engine
loads. torch is not a CI dependency: skipped without it."""

import mlx_engine as me  # noqa: F401  (first: loads OpenBLAS before mlx.core)

import argparse
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_same_or_near_tie, generate_ids
from test_smollm2_eagle3 import AUX, HIDDEN, VOCAB, head, target  # noqa: F401  (the tiny target and its head)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.training
DRAFT = np.arange(0, VOCAB, 2)  # the tiny head's draft vocabulary: the even ids


@pytest.fixture(scope="module")
def torch_head(head, tmp_path_factory):  # noqa: F811
    """The tiny MLX head saved by the MLX trainer and loaded by the torch code."""
    from training.torch_eagle3_head import load_head
    from training.train_smollm2_eagle3 import save_head

    path = tmp_path_factory.mktemp("mlx_head")
    save_head(head, DRAFT, path, {"steps": 0})
    th, ids = load_head(path, torch.from_numpy(np.array(head.embed_tokens.weight)))
    assert np.array_equal(ids, DRAFT)
    return th


def _close(ours, theirs):
    """Equal within 1e-4 of the tensor's scale (float32 sums in another order)."""
    a, b = ours.detach().numpy(), np.array(theirs)
    assert a.shape == b.shape and np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())


def test_torch_head_outputs_and_loss_equal_the_mlx_head(target, head, torch_head):  # noqa: F811
    from training import torch_eagle3_head as th
    from training import train_smollm2_eagle3 as tr

    rng = np.random.default_rng(0)
    aux = rng.standard_normal((2, 24, 3 * HIDDEN)).astype(np.float32)
    tok = rng.integers(0, VOCAB, (2, 24)).astype(np.int32)
    ours = th.ttt_forward(torch_head, torch.from_numpy(aux), torch.from_numpy(tok), 3)
    theirs = tr.ttt_forward(head, mx.array(aux), mx.array(tok), 3)
    assert len(ours) == 3 and float(mx.abs(theirs[2] - theirs[0]).max()) > 0.1  # the depths differ
    for a, b in zip(ours, theirs):
        _close(a, b)
    _close(torch_head.lm_head(torch_head.norm(ours[1])), head.lm_head(head.norm(theirs[1])))
    t2d = np.full(VOCAB, -1)
    t2d[DRAFT] = np.arange(len(DRAFT))
    data = argparse.Namespace(ids=[tok[0], tok[1]], hidden=list(aux), prompt=[4, 6])
    batch = tr.make_batch(data, [0, 1], t2d, np.arange(6), argparse.Namespace(max_len=64, depths=3))
    mlx_loss = tr.loss_fn(head, *batch, 3, 0.8)
    torch_loss = th.loss_fn(torch_head, *(torch.from_numpy(np.array(b)) for b in batch), 3, 0.8)
    assert abs(torch_loss.item() - mlx_loss.item()) < 1e-4 * max(1.0, mlx_loss.item())


def _head_following_sequence(target, head, n=48, seed=0):  # noqa: F811
    """Token ids that mostly follow the head's own first drafts (so chains are
    sometimes accepted), with the target's aux states for them."""
    from training.eval_smollm2_eagle3 import draft_ids_at
    from training.extract_smollm2_hidden import aux_hidden
    from training.train_smollm2_eagle3 import ttt_forward

    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(3, VOCAB, size=2)]
    while len(ids) < n:
        aux = aux_hidden(target.model, mx.array(ids)[None], AUX)
        h = ttt_forward(head, aux, mx.array(ids)[None], 1)[0][0, -1:]
        follow = rng.random() < 0.8
        ids.append(int(draft_ids_at(head, DRAFT, h)[0]) if follow else int(rng.integers(3, VOCAB)))
    ids = np.array(ids, dtype=np.int32)
    return ids, aux_hidden(target.model, mx.array(ids)[None], AUX)[0]


def test_eval_paths_count_the_same_chains(target, head, torch_head):  # noqa: F811
    from training.eval_smollm2_eagle3 import chain_agreement as mlx_chains
    from training.torch_eagle3 import chain_agreement

    accepted = 0
    for seed in range(3):
        ids, aux = _head_following_sequence(target, head, seed=seed)
        theirs = mlx_chains(head, DRAFT, aux, ids, 6, 4)
        ours = chain_agreement(torch_head, DRAFT, torch.from_numpy(np.array(aux)), ids, 6, 4)
        assert ours.shape == theirs.shape == (48 - 6 - 3, 4)
        assert np.array_equal(ours, theirs)
        accepted += int(theirs[:, 0].sum())
    assert accepted > 10  # the tables are not trivially empty


def test_torch_checkpoint_loads_in_the_mlx_trainer(target, tmp_path):  # noqa: F811
    from training import torch_eagle3_head as th
    from training import train_smollm2_eagle3 as tr

    embed = torch.from_numpy(np.array(target.model.model.embed_tokens.weight))
    norm = torch.from_numpy(np.array(target.model.model.norm.weight))
    args = {**vars(target.model.args), "max_position_embeddings": 512}
    ours = th.new_head(args, embed, norm, DRAFT, seed=4, aux_ids=AUX)
    th.save_head(ours, DRAFT, tmp_path, {"steps": 0})
    theirs, ids = tr.load_head(tmp_path, target)
    assert np.array_equal(ids, DRAFT)
    rng = np.random.default_rng(1)
    aux = rng.standard_normal((1, 16, 3 * HIDDEN)).astype(np.float32)
    tok = rng.integers(0, VOCAB, (1, 16)).astype(np.int32)
    a = th.ttt_forward(ours, torch.from_numpy(aux), torch.from_numpy(tok), 2)
    b = tr.ttt_forward(theirs, mx.array(aux), mx.array(tok), 2)
    for x, y in zip(a, b):
        _close(x, y)


def test_tiny_training_run_lowers_loss_and_the_engine_loads_its_head(smollm, tmp_path):
    from training import torch_eagle3 as te
    from training.eagle3_recipe import DATA, load_sequences

    if te.default_gguf() is None or not DATA.is_file():
        pytest.skip("needs the default model's GGUF and ../shared/data/smollm2-answers")
    seqs, lens = load_sequences(DATA)
    # six sequences (0 held out), each the end of its prompt and 20 answer tokens: a target pass is slow here
    keep = [s[max(0, p - 12) : p + 20] for s, p in zip(seqs[:6], lens[:6, 0])]
    prompts = [min(12, p) for p in lens[:6, 0]]
    np.savez(
        tmp_path / "answers.npz",
        ids=np.concatenate(keep).astype(np.uint16),
        lens=np.array([[p, len(k) - p] for p, k in zip(prompts, keep)], dtype=np.int32),
    )
    out = tmp_path / "head"
    argv = ["--data", str(tmp_path / "answers.npz"), "--out", str(out), "--device", "cpu", "--steps", "12"]
    argv += ["--draft-vocab", "512", "--candidates", "128", "--lr", "3e-3", "--warmup", "2", "--max-len", "64"]
    losses = te.train(te.parse(argv + ["--eval-sequences", "1", "--eval-depth", "3", "--log-every", "4"]))
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.8 * losses[0]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["held_out_sequences"] == 1 and len(ev["accepted_by_position"]) == 3
    assert json.loads((out / "training.json").read_text())["steps"] == 12
    prompt = me.tokenize(smollm, "The capital of France is")
    want, _ = generate_ids(smollm, prompt, max_tokens=12)
    me.load_draft_model(smollm, str(out))
    try:
        ids, final = generate_ids(smollm, prompt, max_tokens=12, num_draft_tokens=3)
        assert final.stats.decoding_mode == "draft_model" and final.stats.drafted_tokens > 0
    finally:
        me.unload_draft_model(smollm)
    assert_same_or_near_tie(smollm, prompt, want, ids)
