"""Load a Hugging Face Qwen3 checkpoint folder (safetensors only) into a dict of tensors.

Layout accepted:

    path/config.json                       required (read by ModelConfig.from_pretrained)
    path/generation_config.json            optional (eos ids)
    path/model.safetensors                 single file, or
    path/model.safetensors.index.json      {"weight_map": {tensor name: shard file}} + shards

Nothing is ever unpickled: ``pytorch_model.bin`` checkpoints are refused.

On the CPU the tensors are views of one huge-page arena (``arena.py``), filled tensor by tensor
straight from the files, with the q/k/v and gate/up projections of each layer back to back.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..errors import CheckpointError, InvalidRequestError
from .arena import WeightArena, plan_layout

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Projections the model fuses into one matrix: stored back to back in the arena, in this order.
FUSED_GROUPS = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3 checkpoint must provide, by Hugging Face name, with its shape.

    ``lm_head.weight`` is always listed: for tied embeddings the loader supplies it from
    ``model.embed_tokens.weight`` when the files lack it.
    """
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (cfg.q_size, hidden),
            f"{p}.self_attn.k_proj.weight": (cfg.kv_size, hidden),
            f"{p}.self_attn.v_proj.weight": (cfg.kv_size, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, cfg.q_size),
            f"{p}.self_attn.q_norm.weight": (hd,),
            f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


def resolve_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig) -> torch.dtype:
    """``None`` -> the checkpoint's dtype (config ``torch_dtype``/``dtype``); a name or a torch.dtype
    among float32, float16, bfloat16 -> that dtype."""
    if dtype is None:
        name = cfg.torch_dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise CheckpointError(f"config.json: dtype {cfg.torch_dtype!r} is not supported; "
                                  f"pass dtype= one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidRequestError(f"dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_checkpoint(path: str | Path, *, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu", arena: bool = True
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Qwen3 checkpoint folder: its ModelConfig and its tensors by Hugging Face name.

    Contract:
      - the dict holds exactly the names of ``expected_shapes(cfg)``, each with that shape,
        converted to ``dtype`` (see ``resolve_dtype``) and placed on ``device``; extra tensors in
        the files are not read;
      - ``lm_head.weight`` comes from the files when present (as transformers does, even for a tied
        config); otherwise, with ``tie_word_embeddings``, it *is* the embedding tensor (same object);
      - the returned ModelConfig is the one read from config.json (``torch_dtype`` unchanged);
      - on the CPU with ``arena`` (the default), every tensor read from the files is a view of one
        ``WeightArena`` (from ``arena.MIN_ARENA_BYTES`` of weights, where Linux lets huge pages be
        asked for; ordinary tensors otherwise), and the members of each ``FUSED_GROUPS`` group of
        a layer lie back to back in it; peak memory is the arena plus one tensor being read.
    Raises CheckpointError naming the file (and the tensor) for a missing or invalid config, a
    pickle-only checkpoint, a corrupt or truncated safetensors file, an index naming a missing shard,
    a missing tensor, a tensor of the wrong shape, or tensors of layers beyond ``num_hidden_layers``.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint folder (no such directory)")
    cfg = ModelConfig.from_pretrained(root)
    target = resolve_dtype(dtype, cfg)
    shapes = expected_shapes(cfg)
    sources = _tensor_sources(root)                     # tensor name -> file holding it
    listing = root / (INDEX_FILE if (root / INDEX_FILE).is_file() else SINGLE_FILE)

    _check_no_extra_layers(sources, cfg, listing)
    wanted = [n for n in shapes if n in sources]
    missing = [n for n in shapes if n not in sources]
    if missing == ["lm_head.weight"] and cfg.tie_word_embeddings:
        missing = []
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        hint = (" (tie_word_embeddings is false in config.json, so lm_head.weight must be stored)"
                if missing[0] == "lm_head.weight" else "")
        raise CheckpointError(f"{listing}: missing tensor {missing[0]!r}{more}{hint}")

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(sources[name], []).append(name)
    into = _arena_views(wanted, shapes, target) if arena and torch.device(device).type == "cpu" else None
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        tensors.update(_read_file(file, names, shapes, listing, into))

    out = {name: tensors[name].to(device=device, dtype=target) for name in shapes if name in tensors}
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return cfg, out


def _check_no_extra_layers(sources: dict[str, Path], cfg: ModelConfig, listing: Path) -> None:
    """Refuse files that hold layers past ``num_hidden_layers``: config.json and the weights disagree,
    and running the first layers alone would silently compute another model."""
    extra = sorted({int(m.group(1)) for n in sources if (m := _LAYER.match(n))
                    and int(m.group(1)) >= cfg.num_hidden_layers})
    if extra:
        example = next(n for n in sources if n.startswith(f"model.layers.{extra[0]}."))
        raise CheckpointError(f"{listing}: holds tensors of layers {extra[0]}..{extra[-1]} (e.g. {example!r}), "
                              f"but config.json says num_hidden_layers={cfg.num_hidden_layers}; fix "
                              f"num_hidden_layers in config.json to the number of layers stored")


def arena_groups(names: list[str]) -> list[list[str]]:
    """Split ``names`` (in order) into groups to be packed back to back: each run of one layer's
    ``FUSED_GROUPS`` members in their order is one group; every other tensor is alone."""
    groups: list[list[str]] = []
    for name in names:
        if groups and _follows(groups[-1][-1], name):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _follows(prev: str, name: str) -> bool:
    for group in FUSED_GROUPS:
        for before, after in zip(group, group[1:]):
            if prev.endswith("." + before) and name == prev[:-len(before)] + after:
                return True
    return False


def _arena_views(names: list[str], shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Views of a fresh huge-page arena for ``names`` (None where no arena can be had)."""
    layout = plan_layout([[(n, shapes[n]) for n in g] for g in arena_groups(names)], dtype)
    arena = WeightArena.allocate(layout.nbytes)
    return None if arena is None else arena.views(layout, dtype)


def _tensor_sources(root: Path) -> dict[str, Path]:
    """Map each stored tensor name to its safetensors file (single file or sharded index)."""
    index = root / INDEX_FILE
    single = root / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e}); "
                                  f"expected {{\"weight_map\": {{tensor name: shard file}}}}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor name -> shard file")
        sources = {}
        for name, shard in weight_map.items():
            file = root / str(shard)
            if not file.is_file():
                raise CheckpointError(f"{index}: shard {shard!r} (holding tensor {name!r}) not found "
                                      f"in {root}")
            sources[name] = file
        return sources
    if single.is_file():
        names = _open_keys(single)
        return dict.fromkeys(names, single)
    pickles = [f for f in _PICKLE_FILES if (root / f).is_file()]
    if pickles:
        raise CheckpointError(f"{root / pickles[0]}: only safetensors checkpoints are supported (pickle "
                              f"files are never loaded); convert it to {SINGLE_FILE}")
    raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _open_keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            return list(fh.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def _read_file(file: Path, names: list[str], shapes: dict[str, tuple[int, ...]], listing: Path,
               into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read ``names`` from one safetensors file, checking presence and shape before reading data.

    Every name is checked first; then each tensor is read (with ``into``: copied, converting its
    dtype, into ``into[name]``) through a handle of its own: the file's mapping, and the pages of
    it that the read made resident, go with the handle, so besides the tensors read at most one
    tensor's worth of the file is resident at a time."""
    out: dict[str, torch.Tensor] = {}
    name = "<header>"
    try:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            stored = set(fh.keys())
            for name in names:
                if name not in stored:
                    raise CheckpointError(f"{file}: missing tensor {name!r} (listed in {listing.name})")
                found = tuple(fh.get_slice(name).get_shape())
                if found != shapes[name]:
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {list(found)}, expected "
                                          f"{list(shapes[name])} (from config.json)")
        for name in names:
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                out[name] = fh.get_tensor(name) if into is None else into[name].copy_(fh.get_tensor(name))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?) "
                              f"while reading tensor {name!r}: {e}") from None
    return out
