"""Safetensors checkpoints with HF DeepSeek names: loading, and writing random-weight ones.

Routed experts are stored per expert on disk (`mlp.experts.{j}.gate_proj.weight`, as
DeepSeek releases them) and stacked into physical slots in memory. DeepSeek's block FP8
weights are dequantized as they are read (engine/fp8_weights.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from wideep_kernels.fp8_blocks import dequantize_fp8_blocks, quantize_fp8_blocks, scale_shape

from .config import ConfigError, ModelConfig, preset
from .fp8_weights import FP8_LINEAR, SCALE_SUFFIX
from .model import DeepseekForCausalLM
from .moe import MoE, expert_fp8_block

_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_FUSED = re.compile(r"^(model\.layers\.(\d+)\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}  # as safetensors names them


class CheckpointError(ValueError):
    """Missing, unexpected or mis-shaped weights, with the tensor named."""


def _targets(model: DeepseekForCausalLM, name: str, inter: int) -> list[tuple[str, tuple]]:
    """Where an on-disk tensor goes: (parameter, index into it) pairs. A routed expert goes to
    every local slot that holds it (none when another rank holds it)."""
    m = _EXPERT.match(name)
    if m:
        prefix, layer, j, kind, scale = m.groups()
        moe = model.model.layers[int(layer)].mlp
        if not isinstance(moe, MoE) or not 0 <= int(j) < model.cfg.n_routed_experts or (scale and moe.fp8_block is None):
            return [(name, ())]  # reported as unexpected
        slots = [s for s, e in enumerate(moe.local_phys2log) if e == int(j)]
        suffix = "_scale" if scale else ""  # FP8 experts kept as they are: the scales fill their own slots
        if kind == "down_proj":
            return [(f"{prefix}.w2{suffix}", (s,)) for s in slots]
        half = moe.w13_scale.shape[1] // 2 if scale else inter  # the gate's rows, then the up's
        rows = slice(0, half) if kind == "gate_proj" else slice(half, 2 * half)
        return [(f"{prefix}.w13{suffix}", (s, rows)) for s in slots]
    m = _FUSED.match(name)
    if m:
        prefix, layer, kind = m.groups()
        moe = model.model.layers[int(layer)].mlp
        local = moe.local_phys2log if isinstance(moe, MoE) else []
        return [(f"{prefix}.{'w13' if kind == 'gate_up_proj' else 'w2'}", ("fused", local))]
    return [(name, ())]


def load_weights(model: DeepseekForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]],
                 total: int | None = None, progress: bool = True) -> None:
    """Copy (HF name, tensor) pairs into the model; every parameter must be filled exactly."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    params.update({n: b for n, b in model.named_buffers()
                   if n.endswith(("e_score_correction_bias", ".w13_scale", ".w2_scale"))})
    filled: dict[str, int] = {}
    # a w13 slot (and its FP8 scales) is filled by its gate and its up projection, a w2 slot by its down projection
    slotted = (".w13", ".w2", ".w13_scale", ".w2_scale")
    expected = {n: (p.shape[0] * (2 if n.endswith(("w13", "w13_scale")) else 1) if n.endswith(slotted) else 1)
                for n, p in params.items()}
    for name, tensor in tqdm(tensors, total=total, desc="loading weights", unit="tensor",
                             disable=not progress, file=sys.stderr):
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # MTP (nextn) layers ship after the main layers; the draft model loads them
        for target, index in _targets(model, name, cfg.moe_intermediate_size):
            if target not in params:
                raise CheckpointError(f"unexpected weight {name!r} for this model config")
            if index and index[0] == "fused":  # [experts, ...] tensor: take the rows of the local slots
                if tensor.shape[0] != cfg.n_routed_experts:
                    raise CheckpointError(f"shape mismatch for {name!r}: {tensor.shape[0]} experts, "
                                          f"model has {cfg.n_routed_experts}")
                tensor, index = tensor[index[1]], ()
            dest = params[target][index] if index else params[target]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise CheckpointError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                      f"model expects {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor.to(dest.dtype))
            filled[target] = filled.get(target, 0) + (1 if index else expected[target])
    if cfg.tie_word_embeddings and "lm_head.weight" not in filled:
        with torch.no_grad():
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        filled["lm_head.weight"] = 1
    missing = [n for n in params if filled.get(n, 0) < expected[n]]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"missing weights: {missing[:5]}{more}")


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def iter_checkpoint(path: str | Path, weight_block_size: list[int] | tuple[int, int] | None = None,
                    num_layers: int | None = None,
                    keep_fp8=None) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """(HF name, tensor) pairs of a checkpoint directory, and how many it yields. An FP8 weight
    comes out dequantized (float32) under its own name, one tensor at a time; its scale
    (`<name>_scale_inv`, anywhere in the directory) is consumed, never yielded, unless
    `keep_fp8(name)` says the weight is kept: then it comes out as stored, followed by its scale.
    weight_block_size: the config's quantization_config block, None for an unquantized model.
    num_layers: tensors of layers past it (DeepSeek's MTP layer, `model.layers.61.*` in V3, about
    2% of the weights) are neither read nor dequantized nor yielded."""
    files = _safetensors_files(Path(path))
    where: dict[str, Path] = {}
    fp8: dict[str, tuple[str, list[int]]] = {}  # name -> (safetensors dtype, shape)
    scales: dict[str, list[int]] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                layer = _LAYER.match(name)
                if layer and num_layers is not None and int(layer.group(1)) >= num_layers:
                    continue
                where[name] = f
                meta = sf.get_slice(name)
                if name.endswith(SCALE_SUFFIX):
                    scales[name] = meta.get_shape()
                elif meta.get_dtype() in _FP8_DTYPES:
                    fp8[name] = (meta.get_dtype(), meta.get_shape())
    # every pairing problem is found before the first tensor is read
    _check_fp8(fp8, scales, where, weight_block_size)

    def gen():
        for f in files:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    if name in scales or name not in where:
                        continue
                    tensor = sf.get_tensor(name)
                    if name in fp8:
                        scale = _read(sf, f, where, name + SCALE_SUFFIX)
                        if keep_fp8 is not None and keep_fp8(name):
                            yield name, tensor
                            yield name + SCALE_SUFFIX, scale
                            continue
                        tensor = dequantize_fp8_blocks(tensor, scale, weight_block_size)
                    yield name, tensor
    kept = sum(1 for name in fp8 if keep_fp8 is not None and keep_fp8(name))
    return gen(), len(where) - len(scales) + kept


def _read(sf, f: Path, where: dict[str, Path], name: str) -> torch.Tensor:
    """A tensor from the open shard when it is there, else from the shard that holds it."""
    if where[name] == f:
        return sf.get_tensor(name)
    with safe_open(where[name], framework="pt") as other:
        return other.get_tensor(name)


def _check_fp8(fp8: dict[str, tuple[str, list[int]]], scales: dict[str, list[int]], where: dict[str, Path],
               block: list[int] | tuple[int, int] | None) -> None:
    for name, (dtype, shape) in fp8.items():
        if block is None:
            raise CheckpointError(f"{name!r} is FP8 but config.json has no quantization_config (DeepSeek's FP8 "
                                  "checkpoints declare quant_method 'fp8' and weight_block_size there)")
        if dtype != "F8_E4M3":
            raise CheckpointError(f"{name!r} is {dtype}; only float8 e4m3 weights (fmt 'e4m3') are supported")
        if len(shape) != 2:
            raise CheckpointError(f"FP8 tensor {name!r} has shape {tuple(shape)}: only 2-D Linear weights are")
        scale = name + SCALE_SUFFIX
        if scale not in scales:
            raise CheckpointError(f"FP8 weight {name!r} has no scale {scale!r} in the checkpoint")
        if tuple(scales[scale]) != scale_shape(shape, block):
            raise CheckpointError(f"scale {scale!r} has shape {tuple(scales[scale])}, expected "
                                  f"{scale_shape(shape, block)} for {name!r} {tuple(shape)} in blocks of {list(block)}")
    for scale in scales:
        weight = scale[:-len(SCALE_SUFFIX)]
        if weight not in where:
            raise CheckpointError(f"scale {scale!r} has no weight {weight!r} in the checkpoint")
        if weight not in fp8:
            raise CheckpointError(f"scale {scale!r} belongs to {weight!r}, which is not FP8")


def load_model(path: str | Path, device="cpu", dtype=torch.float32, progress: bool = True,
               local_phys2log: list[list[int]] | None = None, fp8_experts: bool = False) -> DeepseekForCausalLM:
    """local_phys2log (expert parallelism): per MoE layer, the experts of this rank's slots.
    fp8_experts (EngineConfig.expert_dtype 'fp8_e4m3'): an FP8 checkpoint's routed experts load as
    they are stored, weights and scales, never dequantized (other checkpoints' experts are
    quantized by the engine after loading)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg = ModelConfig.from_file(path)
    quant = cfg.quantization_config
    block = expert_fp8_block(cfg) if fp8_experts and quant is not None else None
    # Built in the serving dtype (not in fp32 and then cast): the model's bytes are allocated once.
    with torch.device(device), _default_dtype(dtype):
        model = DeepseekForCausalLM(cfg, device=device, local_phys2log=local_phys2log, expert_fp8_block=block)
    _restore_fp32_router(model)
    keep = _EXPERT.match if block is not None else None
    tensors, total = iter_checkpoint(path, quant.weight_block_size if quant else None, cfg.num_hidden_layers, keep)
    load_weights(model, tensors, total, progress)
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _restore_fp32_router(model: DeepseekForCausalLM) -> None:
    # Routing decisions are sensitive; like the reference implementation keep the router in fp32.
    for moe in model.moe_layers():
        moe.gate.float()


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02, device="cpu",
                   dtype=torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Random tensors under HF names (experts split per expert), deterministic by seed."""
    with torch.device("meta"):
        shapes = DeepseekForCausalLM(cfg, device="meta")
    gen = torch.Generator(device=device).manual_seed(seed)
    inter = cfg.moe_intermediate_size
    state = dict(shapes.named_parameters())
    state.update({n: b for n, b in shapes.named_buffers() if n.endswith("e_score_correction_bias")})
    for name, p in state.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            yield name, torch.ones(p.shape, dtype=dtype, device=device)
        elif name.endswith("e_score_correction_bias"):
            yield name, torch.rand(p.shape, generator=gen, device=device) * 0.1
        elif name.endswith((".w13", ".w2")):
            prefix = name.rsplit(".", 1)[0]
            w = torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * std
            for j in range(p.shape[0]):
                if name.endswith(".w13"):
                    yield f"{prefix}.experts.{j}.gate_proj.weight", w[j, :inter]
                    yield f"{prefix}.experts.{j}.up_proj.weight", w[j, inter:]
                else:
                    yield f"{prefix}.experts.{j}.down_proj.weight", w[j]
        else:
            yield name, torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * std


RANDOM_MARKER = "random_weights.json"
# What a preset's random checkpoint holds; one written by an older format is written again:
# 1 masked output rows, 2 the tokenizer's tool-call markers, 3 its think markers, 4 its fill-in-the-middle
# markers.
RANDOM_FORMAT = 4


def mask_output_rows(weight: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """`weight` ([vocab, hidden], the output projection) with every row but `keep` zeroed.

    The offline tokenizer of a random checkpoint knows far fewer ids than the model's vocab
    (578 of 32,000 for `bench`), and some of those it knows decode to no text (special
    tokens, lone UTF-8 bytes). With random weights every id is as likely as any other, so the
    model would mostly emit ids that stream no text. A zero row gives a logit of exactly 0 in
    any dtype, while the kept rows' logits are spread around 0 (N(0, std^2 * hidden) for the
    final RMSNorm's unit-weight output), so greedy decoding picks a kept id unless all of them
    are negative at once (probability 2^-len(keep)). Sampling at temperature 1 is only
    partly helped: the zero logits still share the mass (about len(keep) / vocab of it for
    `bench`); top-k or top-p sampling keeps to the kept ids."""
    mask = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    mask[torch.tensor(keep, dtype=torch.long, device=weight.device)] = True
    return weight * mask.unsqueeze(1).to(weight.dtype)


def write_random_checkpoint(cfg: ModelConfig, out: str | Path, seed: int = 0, dtype=torch.float32,
                            shard_bytes: int = 2 << 30, progress: bool = True, device="cpu",
                            fp8_block: tuple[int, int] | None = None) -> Path:
    """config.json + sharded safetensors + an offline-built tokenizer. device="cuda" draws the
    weights on the GPU (a few billion parameters in seconds rather than minutes). The output
    projection only has non-zero rows for ids the tokenizer decodes to text (see
    mask_output_rows), so generated tokens stream as text.

    fp8_block [rows, cols] (or a quantization_config in cfg) writes DeepSeek's FP8 layout: the
    Linear weights DeepSeek quantizes become float8 e4m3 with per-block scales
    (`<name>_scale_inv`), and config.json declares it."""
    from .tokenizer import build_tokenizer, text_token_ids

    if fp8_block is not None:
        cfg = ModelConfig.from_dict(dict(cfg.model_dump(), quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block)}))
    block = cfg.quantization_config.weight_block_size if cfg.quantization_config else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(cfg.vocab_size)
    keep = [i for i in text_token_ids(tokenizer) if i < cfg.vocab_size]
    # the output projection: lm_head, or the embedding when they are tied
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    weight_map = {}

    def flush():
        nonlocal shard, size, index
        if shard:
            fname = f"model-{index:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard, size, index = {}, 0, index + 1

    for name, t in tqdm(random_weights(cfg, seed, device=device, dtype=dtype), desc="writing random weights",
                        unit="tensor", disable=not progress, file=sys.stderr):
        if name == head:
            t = mask_output_rows(t, keep)
        written = {name: t}
        if block is not None and FP8_LINEAR.search(name):
            written = dict(zip((name, name + SCALE_SUFFIX), quantize_fp8_blocks(t, block)))
        for n, w in written.items():
            shard[n] = w.contiguous().to("cpu", copy=True)
            size += w.numel() * w.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    total_size = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    tokenizer.save_pretrained(str(out))
    # marks a random checkpoint written with the masked output rows (older ones lack it)
    (out / RANDOM_MARKER).write_text(json.dumps({"seed": seed, "output_rows_kept": len(keep),
                                                 "format": RANDOM_FORMAT}) + "\n")
    return out


def _random_format(path: Path) -> int:
    marker = path / RANDOM_MARKER
    if not marker.exists():
        return 0  # from before the output rows were masked
    return json.loads(marker.read_text()).get("format", 1)


def ensure_checkpoint(name_or_path: str, root: str | Path = "checkpoints") -> Path:
    """A checkpoint directory for a path, or for a preset name (written on first use)."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    target = Path(root) / name_or_path
    if not (target / "config.json").exists() or _random_format(target) < RANDOM_FORMAT:
        try:
            cfg = preset(name_or_path)
        except ConfigError:
            raise CheckpointError(f"{name_or_path!r} is neither a checkpoint directory nor a preset") from None
        write_random_checkpoint(cfg, target)
    return target


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight checkpoint (config, safetensors, tokenizer).")
    ap.add_argument("--preset", default="tiny", help="named model config (engine.config.PRESETS)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="override config fields")
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: much faster)")
    ap.add_argument("--fp8-block", type=int, nargs=2, metavar=("ROWS", "COLS"),
                    help="store the Linear weights in DeepSeek's block FP8 layout, ROWS x COLS blocks (e.g. 128 128)")
    args = ap.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = preset(args.preset, **overrides)
    path = write_random_checkpoint(cfg, args.out, seed=args.seed, dtype=getattr(torch, args.dtype), device=args.device,
                                   fp8_block=tuple(args.fp8_block) if args.fp8_block else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
