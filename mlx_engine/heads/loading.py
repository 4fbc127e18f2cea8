"""Head files against a target: which folders are heads, the check against the
target (kind, hidden states read, vocabulary mapping) and loading with every
tensor checked. Putting a head into a kit is ``kits/drafts.py``."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..decode import capture
from ..draft.loading import DraftCompatibility
from ..errors import ModelLoadError
from ..loading.checks import read_safetensors_header
from ..loading.evaluation import eval_piecewise
from . import eagle3, mtp, qwen3_5_mtp
from .model import HeadDraft

logger = logging.getLogger(__name__)


class Target(Protocol):
    """What a head is checked and built against: the target kit's model and its facts."""

    model: Any
    vocab_size: int
    model_path: str
    config: dict


#: The name that asks for the target's own MTP weights (its checkpoint's layer-N head).
OWN_MTP = "mtp"


def read_head_config(path: Path) -> dict | None:
    """A head folder's config.json when the folder holds a head this engine
    loads (an EAGLE-3 config, or tensors of a layer-N MTP head), else None;
    an MTP folder's config gets ``"head_kind": "mtp"``."""
    file = path / "config.json"
    if not path.is_dir() or not file.is_file():
        return None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"config.json in {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        return None
    if eagle3.is_eagle3_config(config):
        return config
    if qwen3_5_mtp.is_split_config(config):
        return {**config, "head_kind": "qwen3_5_mtp"}
    model_type = (config.get("text_config") or config).get("model_type", config.get("model_type"))
    if model_type in qwen3_5_mtp.TARGET_TYPES and _holds(path, "mtp.fc.weight"):
        return {**config, "head_kind": "qwen3_5_mtp", "own_checkpoint": True}
    if _mtp_files(path) is not None:
        return {**config, "head_kind": "mtp"}
    return None


def _tensor_names(file: Path) -> list[str]:
    """The tensors a safetensors file declares; none when its header is bad (a
    folder is then not taken for a head: loading it reports the file)."""
    try:
        return list(read_safetensors_header(file))
    except ModelLoadError:
        return []


def _holds(path: Path, tensor: str) -> bool:
    """Whether a safetensors file of the folder declares ``tensor`` (headers only)."""
    return any(tensor in _tensor_names(f) for f in sorted(path.glob("*.safetensors")))


def _mtp_files(path: Path) -> tuple[str, int, list[Path]] | None:
    """The layout and layer index of an MTP head in the folder's safetensors
    files (by their headers: a tensor named ``...layers.N.eh_proj.weight``, or
    MiMo's ``...mtp_layers.K.input_proj.weight``) and the files."""
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        found = mtp.mtp_layer_index(_tensor_names(file))
        if found is not None:
            return *found, files
    return None


def _mtp_tensors(files: list[Path], layout: str, index: int, read) -> tuple[dict, dict[str, str]]:
    """The head's tensors (``read(file)``: a file's tensors or their header
    entries) under their layer-N names, and the file of each."""
    tensors, where = {}, {}
    for file in files:
        for name, value in read(file).items():
            t = mtp.mtp_tensor(name)
            if t is not None and t[:2] == (layout, index):
                tensors[t[2]], where[t[2]] = value, file.name
    return tensors, where


def own_mtp_path(kit: Target) -> Path:
    """The target's own checkpoint, when it holds an MTP head (``load_draft_model(kit, "mtp")``):
    its folder, or its GGUF file whose ``nextn`` blocks the load kept (``model.mtp``)."""
    path = Path(kit.model_path)
    if _gguf_mtp(kit) is not None:
        return path
    config = read_head_config(path) if path.is_dir() else None
    if config is None or config.get("head_kind") not in ("mtp", "qwen3_5_mtp"):
        raise ModelLoadError(
            f"the model {str(path)!r} has no MTP weights in its checkpoint (no 'mtp.fc', 'layers.N.eh_proj' "
            f"or 'mtp_layers.N.input_proj' tensor, nor a GGUF 'nextn' block); "
            f"{OWN_MTP!r} asks for the target's own MTP head"
        )
    return path


def _gguf_mtp(kit: Target) -> dict | None:
    """The MTP tensors a GGUF target's load kept (Qwen3.5's ``nextn`` blocks,
    under Hugging Face names with the norms' 1 added: loading/gguf/qwen35.MTPHead), or None."""
    kept = getattr(kit.model, "mtp", None)
    weights = getattr(kept, "weights", None)
    return weights if isinstance(weights, dict) and weights else None


def head_config_for(kit: Target, path: Path) -> dict | None:
    """``read_head_config``, and for the target's own GGUF file (``own_mtp_path``)
    the config of the head its load kept: a ``qwen3_5_mtp`` head over the target's config."""
    if path.is_file() and path == Path(kit.model_path) and _gguf_mtp(kit) is not None:
        return {**kit.config, "head_kind": "qwen3_5_mtp", "own_checkpoint": True, "from_gguf": True}
    return read_head_config(path)


def _target_facts(kit: Target) -> tuple[int, int] | str:
    """The target's decoder layer count and hidden size, or why hidden states cannot be read from it."""
    try:
        inner = capture.text_model(kit.model)
    except ValueError as exc:
        return str(exc)
    return len(inner.layers), int(inner.embed_tokens.weight.shape[-1])


def check_head(kit: Target, path: Path, config: dict, refusal: str | None = None) -> DraftCompatibility:
    """Check a head against the kit from its config alone (no weights; an MTP
    head from its tensors' headers). ``refusal``: why the caller's kit cannot
    feed any head (it is refused with that reason)."""
    facts = refusal or _target_facts(kit)
    if config.get("head_kind") == "mtp":
        return _check_mtp(kit, path, facts)
    if config.get("head_kind") == "qwen3_5_mtp":
        return _check_qwen3_5_mtp(kit, path, config, facts)
    try:
        cfg = eagle3.eagle3_config(config)
    except (TypeError, ValueError, KeyError) as exc:
        return DraftCompatibility(False, [f"config.json in {str(path)!r} is not a valid EAGLE-3 config: {exc}"])
    if isinstance(facts, str):
        return DraftCompatibility(False, [facts], kind="eagle3")
    layers, hidden = facts
    reasons, notes = [], []
    vocab = int(cfg.transformer_layer_config.vocab_size)
    if vocab != kit.vocab_size:
        reasons.append(f"the head is for a model with {vocab} token ids; this model has {kit.vocab_size}")
    if int(cfg.target_hidden_size) != hidden:
        reasons.append(f"the head reads hidden states of width {cfg.target_hidden_size}; this model's are {hidden}")
    if len(cfg.target_layer_ids) != 3 or not all(0 <= int(i) <= layers for i in cfg.target_layer_ids):
        reasons.append(
            f"eagle_aux_hidden_state_layer_ids {list(cfg.target_layer_ids)} must name 3 of this model's "
            f"hidden states (0..{layers})"
        )
    if not 0 < int(cfg.draft_vocab_size) <= vocab:
        reasons.append(f"draft_vocab_size {cfg.draft_vocab_size} must be between 1 and the vocabulary ({vocab})")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if verifier:
        notes.append(f"trained for {verifier}")
    mapping = (
        "full vocabulary"
        if int(cfg.draft_vocab_size) == vocab
        else f"reduced vocabulary: {cfg.draft_vocab_size} of {vocab} ids, mapped by d2t"
    )
    points = tuple(max(int(i) - 1, 0) for i in cfg.target_layer_ids)
    return DraftCompatibility(not reasons, reasons, notes, kind="eagle3", hidden_states=points, vocabulary=mapping)


def _check_mtp(kit: Target, path: Path, facts: tuple[int, int] | str) -> DraftCompatibility:
    if isinstance(facts, str):
        return DraftCompatibility(False, [facts], kind="mtp")
    _, hidden = facts
    layout, index, files = _mtp_files(path)
    shapes = {k: v.shape for k, v in _mtp_tensors(files, layout, index, read_safetensors_header)[0].items()}
    reasons = []
    eh = shapes.get("eh_proj.weight")
    if eh is not None and tuple(eh) != (hidden, 2 * hidden):
        reasons.append(f"the head reads hidden states of width {eh[-1] // 2}; this model's are {hidden}")
    head = shapes.get("shared_head.head.weight")
    if head is not None and head[0] != kit.vocab_size:
        reasons.append(f"the head is for a model with {head[0]} token ids; this model has {kit.vocab_size}")
    vocab = "its own output layer" if head is not None else "the target's output layer"
    return DraftCompatibility(not reasons, reasons, [], kind="mtp", hidden_states=(capture.FINAL,), vocabulary=vocab)


def _check_qwen3_5_mtp(kit: Target, path: Path, config: dict, facts: tuple[int, int] | str) -> DraftCompatibility:
    if isinstance(facts, str):
        return DraftCompatibility(False, [facts], kind="qwen3_5_mtp")
    try:
        text = qwen3_5_mtp.head_config(config).text_config
    except (TypeError, ValueError, KeyError) as exc:
        return DraftCompatibility(False, [f"config.json in {str(path)!r} is not a valid qwen3_5_mtp config: {exc}"])
    reasons = []
    if int(text.hidden_size) != facts[1]:
        reasons.append(f"the head reads hidden states of width {text.hidden_size}; this model's are {facts[1]}")
    if int(text.vocab_size) != kit.vocab_size:
        reasons.append(f"the head is for a model with {text.vocab_size} token ids; this model has {kit.vocab_size}")
    notes = ["the target's own mtp.* weights"] if config.get("own_checkpoint") else []
    return DraftCompatibility(
        not reasons,
        reasons,
        notes,
        kind="qwen3_5_mtp",
        hidden_states=(capture.FINAL,),
        vocabulary="the target's output layer",
    )


def _load_file(file: Path) -> dict[str, mx.array]:
    """A safetensors file's tensors; a file MLX cannot read is a ``ModelLoadError`` naming it."""
    try:
        return mx.load(str(file))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"weight file {str(file)!r} could not be read: {exc}") from exc


def _read_weights(path: Path, rename: bool = True) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Every tensor of the folder's safetensors files (headers checked first),
    and the file of each; ``rename``: EAGLE-3's names onto mlx-vlm's."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"head {str(path)!r} has no .safetensors file")
    weights, where = {}, {}
    for file in files:
        read_safetensors_header(file)
        loaded = _load_file(file)
        for name, value in (eagle3.rename_weights(loaded) if rename else loaded).items():
            weights[name], where[name] = value, file.name
    return weights, where


def _check_tensors(
    net: nn.Module,
    weights: dict,
    where: dict,
    path: Path,
    optional: set[str],
    shown: Callable[[str], str] = str,
    kind: str = "an EAGLE-3 head",
) -> None:
    """Every tensor the head needs is there with its shape, and nothing else
    (``shown(name)``: the name as the files name it, ``block.`` dropped)."""
    expected = dict(tree_flatten(net.parameters()))
    named = shown

    def shown(name: str) -> str:
        return named(name.removeprefix("block."))

    for name, value in weights.items():
        if name not in expected:
            raise ModelLoadError(f"{where[name]} in {str(path)!r}: tensor {shown(name)!r} is not part of {kind}")
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ModelLoadError(
                f"{where[name]} in {str(path)!r}: tensor {shown(name)!r} has shape {tuple(value.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    missing = sorted(set(expected) - set(weights) - optional)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"head {str(path)!r} lacks tensor {shown(missing[0])!r}{more}")


def _quantize_as_stored(net: nn.Module, config: dict, weights: dict) -> None:
    """Quantize the Linear layers the checkpoint stores quantized (those with
    ``.scales``), as its config's ``quantization`` says."""
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            net,
            q["group_size"],
            q["bits"],
            class_predicate=lambda p, m: isinstance(m, nn.Linear) and f"{p}.scales" in weights,
        )


def _build_eagle3(kit: Target, path: Path, config: dict) -> eagle3.Eagle3Head:
    cfg = eagle3.eagle3_config(config)
    net = eagle3.Eagle3DraftModel(cfg)
    weights, where = _read_weights(path)
    weights = net.sanitize(weights)
    _quantize_as_stored(net, config, weights)
    target_embed = capture.text_model(kit.model).embed_tokens
    _check_tensors(net, weights, where, path, optional={"embed_tokens.weight"})
    if "d2t" in weights:
        d2t = weights["d2t"].astype(mx.int32)
        mapped = mx.arange(d2t.shape[0]) + d2t
        if int(mapped.min().item()) < 0 or int(mapped.max().item()) >= kit.vocab_size:
            raise ModelLoadError(
                f"{where['d2t']} in {str(path)!r}: tensor 'd2t' maps draft ids outside the target's vocabulary"
            )
    dtype = (
        target_embed.weight.dtype if target_embed.weight.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float16
    )
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and k != "d2t" else v for k, v in weights.items()
    }
    net.load_weights(list(weights.items()), strict=False)
    if "embed_tokens.weight" not in weights and tuple(net.embed_tokens.weight.shape) != tuple(
        target_embed.weight.shape
    ):
        raise ModelLoadError(
            f"head {str(path)!r} lacks tensor 'embed_tokens.weight' and cannot use the target's embedding"
        )
    if tuple(net.embed_tokens.weight.shape) == tuple(target_embed.weight.shape):
        net.embed_tokens = target_embed  # as mlx-vlm binds it: the head reads the target's own embedding
    eval_piecewise(net.parameters())
    return eagle3.Eagle3Head(net, cfg, net.embed_tokens)


def _build_qwen3_5_mtp(kit: Target, path: Path, config: dict) -> qwen3_5_mtp.Qwen35MTPHead:
    """A Qwen3.5 MTP head: a split folder's tensors, or the ``mtp.*`` ones of the target's own checkpoint."""
    net = qwen3_5_mtp.build_net(config)
    if config.get("from_gguf"):
        # Stored as mlx-vlm holds them (the converter added the norms' 1): no "mtp." prefix, so
        # mlx-vlm's sanitize adds nothing.
        weights = {k.removeprefix("mtp."): v for k, v in _gguf_mtp(kit).items()}
        where = {k: path.name for k in weights}
    else:
        weights, where = _read_weights(path, rename=False)
    if config.get("own_checkpoint") and not config.get("from_gguf"):
        weights = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    weights = net.sanitize(weights)
    where = {k: where.get(k, where.get("mtp." + k, "model.safetensors")) for k in weights}
    _quantize_as_stored(net, config, weights)
    _check_tensors(net, weights, where, path, optional=set(), kind="a qwen3_5_mtp head")
    net.load_weights(list(weights.items()), strict=False)
    eval_piecewise(net.parameters())
    return qwen3_5_mtp.Qwen35MTPHead(net, kit.model, kit.vocab_size)


def _build_mtp(kit: Target, path: Path) -> mtp.LayerNMTPHead:
    """A layer-N (or MiMo) MTP head from the folder's tensors of that layer, every one checked."""
    layout, index, files = _mtp_files(path)
    tensors, where = _mtp_tensors(files, layout, index, _load_file)
    tensors = mtp.fusion_order(layout, tensors)
    block, template = mtp.build_block(kit.model)
    hidden = int(capture.text_model(kit.model).embed_tokens.weight.shape[-1])
    eps = float(kit.config.get("text_config", kit.config).get("rms_norm_eps", 1e-6))
    own = tensors.get("shared_head.head.weight")
    net = mtp.MTPNet(block, hidden, eps, None if own is None else int(own.shape[0]))
    weights = mtp.head_weights(kit.model, tensors, template)
    files_of = {k: where.get(k.removeprefix("block."), files[0].name) for k in weights}
    shown = partial(mtp.file_name, layout, index)
    _check_tensors(net, weights, files_of, path, optional=set(), shown=shown, kind="an MTP head")
    net.load_weights(list(weights.items()), strict=False)
    eval_piecewise(net.parameters())
    return mtp.LayerNMTPHead(net, kit.model, kit.vocab_size)


def load_head(kit: Target, path: Path, config: dict) -> HeadDraft:
    """Build and check the head (every tensor) and run it once; ``HeadDraft.attach`` then installs it."""
    builders = {"mtp": lambda: _build_mtp(kit, path), "qwen3_5_mtp": lambda: _build_qwen3_5_mtp(kit, path, config)}
    head = builders.get(config.get("head_kind"), lambda: _build_eagle3(kit, path, config))()
    try:
        cache = head.new_cache()
        width = capture.hidden_width(kit.model, head.spec)
        out = head.forward(cache, mx.zeros((1, 2), dtype=mx.uint32), mx.zeros((1, 2, width)), 0)
        mx.eval(head.logits(out))
    except Exception as exc:
        raise ModelLoadError(f"head {str(path)!r} failed a test pass: {type(exc).__name__}: {exc}") from exc
    own = [
        v
        for k, v in tree_flatten(head.net.parameters())
        if not (k.startswith("embed_tokens.") and head.embed is capture.text_model(kit.model).embed_tokens)
    ]
    params = sum(v.size for v in own if mx.issubdtype(v.dtype, mx.floating))
    what = {"eagle3": f"EAGLE-3 head reading layers {list(head.spec.points)}", "mtp": "layer-N MTP head"}.get(
        head.kind, "Qwen3.5 MTP head"
    )
    return HeadDraft(path, head, int(params), description=what)
