"""The workbench's C++ kernels: prefill attention, decode attention, KV-cache quantization.

Module-level functions run the process's build: the host-native one, or the variant that
$WORKBENCH_KERNELS_BUILD names (_build.process_build). `KernelSet(variant)` gives the same
API on another build (the tests run every instruction-set path the host can execute).

Layouts (all tensors contiguous, on the CPU):

    q [B, H, N, D], k / v [B, Hkv, Nk, D]         prefill; H a multiple of Hkv (GQA)
    q [B, H, D], caches [B, Hkv, Lmax, D]          decode, one new token per sequence
    int8 scales [B, Hkv, Lmax] fp32                one per head per token

Inputs are fp32 or bf16; every kernel accumulates in fp32 and returns q's dtype.
Shapes, dtypes and values are checked before any pointer is touched; a mistake raises
ValueError or TypeError naming the argument.
"""

from __future__ import annotations

import torch

from workbench.kernels._build import (KernelBuildError, build_info, load_extension, process_build, runnable_variants,
                                     variant_isa)
from workbench.hw.machine import machine_info

__all__ = [
    "KernelBuildError",
    "KernelSet",
    "build_info",
    "decode_attention",
    "dequantize_kv_int8",
    "flash_attention",
    "kv_cache_append",
    "linear",
    "quantize_kv_int8",
    "quantize_weight_int8",
    "random_normal",
    "runnable_variants",
    "slim_attention",
    "variant_isa",
]

# FlashAttention tile defaults: the best of the block sweep in bench/prefill_attention.py
# on the 2-core Zen development host at Llama-2-7B shapes; overridable per call.
FLASH_BLOCK_M = 192
FLASH_BLOCK_N = 512
# SlimAttention's query block is capped here (the sweep flattens out beyond it).
SLIM_MAX_BLOCK_M = 384


def _round_down(x: int, m: int) -> int:
    return max(m, x // m * m)


class KernelSet:
    """The kernel API bound to one build variant ("native", "avx2", "scalar", or the test build
    "emulated")."""

    def __init__(self, variant: str = "native"):
        self.variant = variant

    @property
    def ext(self):
        return load_extension(self.variant)

    @property
    def isa(self) -> str:
        return self.ext.isa()

    # -- prefill ---------------------------------------------------------------------

    def default_block_m(self, n_queries: int, n_keys: int, head_dim: int, tasks_per_block: int,
                        tiles: bool = False) -> int:
        """SlimAttention's query block, from the detected L2 size (`tiles`: for bf16 inputs on a
        bf16 engine, _tile_block_m).

        Each task streams the K and V rows its block can see, so its arithmetic intensity
        grows with block_m; its score buffer (block_m x n_keys fp32) grows too. The sweep in
        bench/prefill_attention.py shows K/V streaming dominating long before the buffer
        leaves L2, so the budget is eight L2s of scores (the buffer is walked row by row, and
        the hardware prefetcher keeps up), capped at SLIM_MAX_BLOCK_M rows, a multiple of the
        micro-kernel's row tile, and small enough to leave four tasks per thread
        (tasks_per_block = B * H tasks for each query block)."""
        if tiles:
            return self._tile_block_m(n_queries, tasks_per_block)
        mr = self.ext.gemm_mr()
        budget = 8 * machine_info().l2_bytes
        block = budget // (4 * (n_keys + head_dim))
        block = _round_down(min(block, SLIM_MAX_BLOCK_M), mr)
        threads = torch.get_num_threads()
        while block > mr and tasks_per_block * -(-n_queries // block) < 4 * threads:
            block = _round_down(block // 2, mr)
        return max(1, min(block, n_queries))

    def _tile_block_m(self, n_queries: int, tasks_per_block: int) -> int:
        """The query block on the bf16 engines (prefill_tiles.cpp). A task walks its rows 32 at a
        time with that pair's scores in L2 whatever the block, and the pairs of one task read
        the same K and V one after the other, so the longest block measured fastest (the tile
        sweep of bench/prefill_attention.py), up to the kernel's limit (constants()
        ["tile_max_block_m"]): halved while fewer than four tasks per thread would be left."""
        block = min(constants()["tile_max_block_m"], -(-n_queries // 32) * 32)
        threads = torch.get_num_threads()
        while block > 32 and tasks_per_block * -(-n_queries // block) < 4 * threads:
            block //= 2
        return max(32, block // 32 * 32)

    def on_tiles(self, q) -> bool:
        """Whether prefill attention of `q` runs on a bf16 engine (bf16 input, engine not "fma")."""
        return q.dtype == torch.bfloat16 and self.gemm_engine() != "fma"

    def slim_attention(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                       block_m: int | None = None, window: int = 0) -> torch.Tensor:
        """SlimAttention prefill: split along queries only, exact one-pass softmax per row.

        q [B, H, N, D], k / v [B, Hkv, Nk, D] (fp32 or bf16) -> [B, H, N, D] like q.
        causal: query i sees keys 0 .. i + (Nk - N) (needs Nk >= N); only those are computed.
        scale: softmax scale, default 1/sqrt(D). block_m: query rows per task (default from L2).
        window: a sliding window (causal only): query i sees only the last `window` of its keys,
        i + (Nk - N) - window + 1 .. i + (Nk - N); 0 (default) for none.

        bf16 inputs run on the bf16 engine in force (gemm_engine_for("bfloat16"): AMX tiles or
        AVX512-BF16):
        Q K^T and P V as bf16 products with fp32 accumulation, the softmax in fp32 and each
        row's probabilities rounded to bf16 for P V; block_m rounds up to whole 32-row pairs.
        Under "fma" they are widened to fp32 and run the fp32 kernels.
        """
        _check_tensor_args(q=q, k=k, v=v)
        if block_m is None and q.dim() == 4 and k.dim() == 4:
            block_m = self.default_block_m(q.shape[2], k.shape[2], q.shape[3], q.shape[0] * q.shape[1],
                                           tiles=self.on_tiles(q))
        elif block_m is None:
            block_m = 1  # the extension rejects the shapes with a message naming them
        return self.ext.slim_attention(q, k, v, causal=bool(causal), scale=scale,
                                       block_m=_positive_int("block_m", block_m),
                                       window=_positive_int("window", window, 0))

    def flash_attention(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                        block_m: int | None = None, block_n: int | None = None, window: int = 0) -> torch.Tensor:
        """FlashAttention-2 prefill: block_m x block_n tiles, online softmax with rescaling.

        Same contract as slim_attention (bf16 inputs on the bf16 engine in force, block_n rounded
        up to whole 32-key blocks there); built from the same micro-kernels and exp.
        """
        _check_tensor_args(q=q, k=k, v=v)
        block_m = FLASH_BLOCK_M if block_m is None else block_m
        block_n = FLASH_BLOCK_N if block_n is None else block_n
        return self.ext.flash_attention(q, k, v, causal=bool(causal), scale=scale,
                                        block_m=_positive_int("block_m", block_m),
                                        block_n=_positive_int("block_n", block_n),
                                        window=_positive_int("window", window, 0))

    # -- decode ----------------------------------------------------------------------

    def decode_attention(self, q, k_cache, v_cache, lengths, *, k_scale=None, v_scale=None,
                         scale: float | None = None, num_splits: int | None = None,
                         int8_kernel: str = "widen", group: int = 0, q_offset: int = 0) -> torch.Tensor:
        """Attention of one new token per sequence over a KV cache.

        q [B, H, D] fp32/bf16; k_cache / v_cache [B, Hkv, Lmax, D] int8, fp16, bf16 or fp32;
        lengths [B] ints in 1..Lmax (ragged batches allowed); k_scale / v_scale [B, Hkv, Lmax]
        fp32 for an int8 cache. num_splits: split-KV chunks per (batch, KV head); default
        picks enough for every thread when B * Hkv is small.

        int8_kernel, how an int8 cache is read (constants()["int8_kernels"]; other caches take "widen"):
          "widen"  K and V widened to fp32 in registers (the paper's kernel);
          "dot"    each query head quantized to int8 too, the scores by integer dot products
                   (`decode_dot_isa()` says which instructions), P.V in fp32;
          "tile"   the caches in the tiled layout (K written with layout="k_tiles", V with
                   "v_groups"; Lmax a multiple of TILED_ALIGN, D of 4): the scores and P.V by
                   integer dot products, the probabilities quantized to [0, 127] per 32 tokens.

        group, q_offset: which KV head each query head reads where the groups are uneven (a
        tensor-parallel rank's shard: workbench.distributed.shard): query head h reads KV head
        (h + q_offset) // group. Default (0, 0): h // (H // Hkv).
        """
        _check_tensor_args(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths)
        group, q_offset = _head_map("decode_attention", group, q_offset)
        if num_splits is not None:
            num_splits = _positive_int("num_splits", num_splits)
        return self.ext.decode_attention(q, k_cache, v_cache, lengths, k_scale=k_scale, v_scale=v_scale,
                                         scale=scale, num_splits=num_splits,
                                         int8_kernel=_int8_kernel("decode_attention", int8_kernel),
                                         group=group, q_offset=q_offset)

    def decode_dot_isa(self) -> str:
        """The integer dot-product instructions of the int8-query decode path in this build."""
        return self.ext.decode_dot_isa()

    def default_num_splits(self, batch: int, kv_heads: int, max_length: int) -> int:
        return self.ext.decode_default_splits(batch, kv_heads, max_length)

    # -- linear layers -----------------------------------------------------------------

    def linear(self, x, w, *, matvec_max_rows: int | None = None, out: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, kernel: str = "") -> torch.Tensor:
        """y = x @ w.T for weights w [N, K] (nn.Linear layout) in fp32, bf16 or int8 and fp32
        x [..., K] -> fp32 [..., N]. int8 weights need `scale` [N] fp32, one per output row
        (quantize_weight_int8): dequantized in registers, the scale applied to each output.
        Block-quantized weights are uint8 rows [N, block_row_bytes(kernel, K)] in the kernels'
        layout (repack_blocks) with their `kernel` named ("q4_0" ... "q6_k", "i4_g128").

        Up to matvec_max_rows rows of x (decode at small batch) run our memory-bound
        matrix-vector kernel, which reads each weight byte once, widening bf16 in registers;
        more rows (batched decode, prefill) run our GEMM (on the bf16 engine in force for bf16
        and int8 weights). The default (None) is the crossover measured on this host for the
        weights' dtype (matvec_max_rows(), workbench/kernels/crossover.py); 0 always uses the GEMM.
        out: an fp32 [rows, N] tensor to write y into (a collective's buffer: zero copy)."""
        _check_tensor_args(x=x, w=w)
        if out is not None:
            _check_tensor_args(out=out)
        if scale is not None:
            _check_tensor_args(scale=scale)
        if x.dim() < 1:
            raise ValueError(f"linear: x must have a last dimension K, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        rows = -1 if matvec_max_rows is None else _positive_int("matvec_max_rows", matvec_max_rows, 0)
        y = self.ext.linear(x.reshape(-1, x.shape[-1]), w, rows, out, scale, kernel)
        return y.reshape(*lead, w.shape[0] if w.dim() == 2 else -1)

    def grouped_matvec(self, x, weights: list, rows: list, *, kernels: list[str] | None = None,
                       scales: list | None = None) -> list[torch.Tensor]:
        """[x[rows[j]] @ weights[j].T for each j] in one parallel region over all of the
        matrices' rows, x fp32 [M, K] rounded once (the decode step runs a mixture's experts
        this way, each on the tokens routed to it). Each weight is block rows with its kernel
        named, or int8 with its scale (per row [N] or per 32 weights [N, K / 32]); K a
        multiple of 32. rows[j]: int64 indices into x."""
        _check_tensor_args(x=x)
        n = len(weights)
        kernels = list(kernels) if kernels is not None else [""] * n
        scales = list(scales) if scales is not None else [None] * n
        return self.ext.grouped_matvec(x, list(weights), scales, kernels, [torch.as_tensor(r, dtype=torch.int64)
                                                                            for r in rows])

    # -- block-quantized weights (kernels/blocks.h) -----------------------------------------

    def block_row_bytes(self, kernel: str, K: int) -> int:
        """Bytes of one row of K weights of a block kernel ("q4_0" ... "q6_k", "i4_g128")."""
        return self.ext.block_row_bytes(kernel, _positive_int("K", K))

    def quantize_blocks(self, x, kernel: str, *, search: bool = False) -> torch.Tensor:
        """Our quantizer: x [rows, K] fp32 -> uint8 [rows, row bytes] in GGUF's block order (what
        a GGUF file holds; i4_g128 in its own layout). search (q4_0 only, our int4-g32): each
        block's least-squares scale instead of GGUF's reference rounding."""
        _check_tensor_args(x=x)
        return self.ext.quantize_blocks(x, kernel, bool(search))

    def repack_blocks(self, w, kernel: str, K: int, *, to_kernel: bool = True) -> torch.Tensor:
        """Block rows w [N, row bytes] from GGUF's byte order to the kernels' (to_kernel) or back;
        the values are unchanged (blocks.h: the blocks of 32 become planes, the rest stays)."""
        _check_tensor_args(w=w)
        return self.ext.repack_blocks(w, kernel, _positive_int("K", K), bool(to_kernel))

    def dequantize_blocks(self, w, kernel: str, K: int, rows: torch.Tensor | None = None, *,
                          reference: bool = False) -> torch.Tensor:
        """Block rows w [N, row bytes] (the kernels' layout) -> fp32 [N, K], or only the rows
        `rows` (int64 [count]) -> [count, K]: the embedding's gather. In vectors, or with
        `reference` weight by weight in plain C++; the same bits either way (tests)."""
        _check_tensor_args(w=w)
        if rows is not None:
            _check_tensor_args(rows=rows)
        return self.ext.dequantize_blocks(w, kernel, _positive_int("K", K), rows, bool(reference))

    def block_dot_isa(self) -> str:
        """The instructions of the block-quantized matrix-vector kernel's dot products here,
        with the activations at block_activation_bits()."""
        return self.ext.block_byte_dot_isa() if self.ext.block_activation_bits() == 8 else self.ext.block_dot_isa()

    ACTIVATION_BITS = (8, 16)

    def block_activation_bits(self) -> int:
        """What decode's matrix-vector kernel of block-quantized and int8 weights rounds the
        activations to, per 32 values: 16 (int16, the default: scale max|x| / 32767, 1.5e-5 of
        the chunk's largest value at most) or 8 (int8, scale max|x| / 127, as llama.cpp does:
        half the instructions a weight, and an error that moves the logits visibly; see
        bench/gguf_formats.py --activation-bits). See kernels/blocks.cpp."""
        return self.ext.block_activation_bits()

    def set_block_activation_bits(self, bits: int) -> None:
        """Choose 16 (the default) or 8 for block_activation_bits(), for every call from then on."""
        if isinstance(bits, bool) or bits not in self.ACTIVATION_BITS:
            raise ValueError(f"bits must be 8 or 16, got {bits!r}")
        self.ext.set_block_activation_bits(int(bits))

    def matvec_max_rows(self, kernel: str) -> int:
        """Up to how many rows of x a linear layer with `kernel` weights (WeightFormat.kernel:
        'float32', 'bfloat16', 'int8', 'int8_group') runs the matrix-vector kernel rather than
        the GEMM: measured on this host when the kernels load (workbench/kernels/crossover.py)."""
        return self.ext.matvec_max_rows(kernel)

    GEMM_ENGINES = ("auto", "fma", "amx_bf16", "avx512_bf16", "amx_int8")

    def gemm_engines(self) -> dict[str, tuple[bool, str]]:
        """Each engine the GEMM can be set to: name -> (may it run here, why)."""
        return {name: (bool(ok), why) for name, (ok, why) in self.ext.gemm_engines().items()}

    def gemm_engine(self) -> str:
        """The GEMM's engine in force: "amx_bf16" (x rounded to bf16, fp32 accumulation, on the
        AMX tiles), "avx512_bf16" (the same rounding, vdpbf16ps), "fma" (fp32 FMAs, x kept in
        fp32) or "amx_int8" (per-row int8 weights as W8A8 on the AMX int8 tiles, the rest as
        amx_bf16; gemm_engine_for says which runs a weight kernel). The matrix-vector kernel of few rows is the same
        for all. Prefill attention (slim_attention, flash_attention) of bf16 q / k / v runs on
        the same engine: Q K^T and P V as bf16 products (kernels/prefill_tiles.cpp), or, under
        "fma", widened to fp32."""
        return self.ext.gemm_engine()

    def gemm_engine_for(self, kernel: str) -> str:
        """The micro-kernel the GEMM runs weights of this kernel (WeightFormat.kernel: "float32",
        "bfloat16", "int8", "int8_group") on: fp32 weights always on "fma" (the exact path),
        the others on gemm_engine() (int8 converted to bf16 one slice of K at a time), except
        under "amx_int8": per-row "int8" weights on it (x quantized to int8 per token: s[m] =
        max|x[m]| / 127, x / s[m] rounded to nearest even; exact int32 sums times s[m] and the
        row scale), "bfloat16" and "int8_group" on "amx_bf16"."""
        return self.ext.gemm_engine_for(kernel)

    def set_gemm_engine(self, engine: str) -> None:
        """Choose the GEMM's engine: "auto" (the fastest that may run: AMX, then AVX512-BF16,
        then FMA), "fma", "amx_bf16", "avx512_bf16" or "amx_int8" (W8A8 for per-row int8
        weights, never chosen by auto: it quantizes the activations), a RuntimeError with the
        reason where it may not run."""
        if engine not in self.GEMM_ENGINES:
            raise ValueError(f"engine must be one of {', '.join(self.GEMM_ENGINES)}, got {engine!r}")
        self.ext.set_gemm_engine(engine)

    def decode_stack(self, layers, caches, *, heads: int, eps: float, int8_kernel: str = "widen", group: int = 0,
                     q_offset: int = 0, kv_handoff: tuple[bool, bool] = (False, False), scale: float | None = None,
                     rotary: int = 0, activation: str = "silu", windows=None):
        """The fused decode step over a whole decoder stack (kernels/decode_step.cpp).

        layers: the model's Layer objects (attn_norm, mlp_norm, the Linear wqkv, wo,
        w_gate_up, w_down, and what the family adds: qkv_bias, q_norm, k_norm,
        post_attn_norm, post_mlp_norm, None where absent; rope: which RoPE table the layer
        reads, 0 global, 1 local; a mixture of experts' router, experts, top_k and norm_topk in
        place of w_gate_up and w_down: then step's expert_hits [layers, experts] says how
        many tokens the last step routed to each expert); caches: one (k, v, k_scale, v_scale) per layer, the scales
        None unless int8; int8_kernel: decode_attention's. Returns an object whose
        step(x, cos, sin, positions, timers, comm, cos_local, sin_local) runs every layer for
        one new token per sequence in one call with the GIL released: x [B, dim] fp32 updated
        in place, cos / sin [B, rotary] (the local table's too where a layer reads it),
        positions [B]; timers a float64 [layers, parts] tensor that receives each layer's
        seconds per part (constants()["timer_parts"]), or None. The weights and caches are
        held, not copied: build one per (model, cache). group, q_offset: decode_attention's.
        kv_handoff (send, recv): a tensor-parallel rank's shared KV head
        (workbench.distributed.shard.kv_handoff): its first KV head computed here and handed
        to the previous rank, its last taken from the next rank, where step's comm can.
        scale: the softmax scale (None: 1/sqrt(head_dim)); rotary: the rotated dims of each
        head (0: all); activation: the MLP's, "silu" or "gelu_tanh"; windows: each layer's
        ring length where its cache is a sliding-window ring (0 or None: the whole cache)."""
        layers, caches = list(layers), list(caches)
        if len(caches) != len(layers):
            raise ValueError(f"decode_stack: caches needs one (k, v, k_scale, v_scale) per layer: {len(layers)}, "
                             f"got {len(caches)}")
        windows = list(windows) if windows is not None else [0] * len(layers)
        if len(windows) != len(layers) or not all(isinstance(w, int) and w >= 0 for w in windows):
            raise ValueError(f"decode_stack: windows needs one ring length >= 0 per layer ({len(layers)}), "
                             f"got {windows!r}")
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"decode_stack: activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        def parts(linear):  # each row-wise part of a workbench.model.llama.Linear
            return [self.ext.WeightPart(p.weight, p.scale, p.fmt.kernel if p.fmt.blocks else "") for p in linear.parts]

        def mixture(layer) -> dict:  # a mixture of experts' router and experts (workbench.model.llama.Layer)
            if getattr(layer, "router", None) is None:
                return {}
            held = [pair or ([], []) for pair in layer.experts]  # another rank's expert (expert parallel): none
            return {"router": parts(layer.router), "experts_gate_up": [parts(g) if g else [] for g, _ in held],
                    "experts_down": [parts(d) if d else [] for _, d in held], "top_k": layer.top_k,
                    "norm_topk": bool(layer.norm_topk)}

        records = [self.ext.DecodeLayer(layer.attn_norm, layer.mlp_norm,
                                        *(parts(getattr(layer, n)) if getattr(layer, n) is not None else []
                                          for n in ("wqkv", "wo", "w_gate_up", "w_down")),
                                        *cache, qkv_bias=getattr(layer, "qkv_bias", None),
                                        **{n: getattr(layer, n, None) for n in ("q_norm", "k_norm", "post_attn_norm",
                                                                               "post_mlp_norm")},
                                        window=window, rope=getattr(layer, "rope", 0), **mixture(layer))
                   for layer, cache, window in zip(layers, caches, windows)]
        group, q_offset = _head_map("decode_stack", group, q_offset)
        if (not isinstance(kv_handoff, tuple) or len(kv_handoff) != 2
                or not all(isinstance(f, bool) for f in kv_handoff)):
            raise ValueError(f"decode_stack: kv_handoff must be a (send, recv) pair of bools, got {kv_handoff!r}")
        return self.ext.DecodeStack(records, heads, float(eps), _int8_kernel("decode_stack", int8_kernel), group,
                                    q_offset, *kv_handoff, None if scale is None else float(scale),
                                    _positive_int("rotary", rotary, 0), activation)

    def rope_(self, x, cos, sin, *, heads: int, head_dim: int) -> torch.Tensor:
        """Rotary position embedding (rotate-half layout) in place: in each row of x [T, C]
        fp32 (rows contiguous), the first `heads` vectors of head_dim values are rotated by
        that row's cos / sin [T, R]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin for the
        halves x1, x2 of each head's first R values (R = head_dim, or fewer for partial
        rotary: the rest pass through). Returns x."""
        _check_tensor_args(x=x, cos=cos, sin=sin)
        self.ext.rope_(x, cos, sin, _positive_int("heads", heads, 0), _positive_int("head_dim", head_dim))
        return x

    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        """RMSNorm of each row in one pass: x [T, n] fp32, weight [n] fp32 ->
        x / sqrt(mean(x^2) + eps) * weight [T, n], rows in parallel (the fused decode step's
        row function)."""
        _check_tensor_args(x=x, weight=weight)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
        return self.ext.rms_norm(x, weight, float(eps))

    def act_mul(self, gate_up, activation: str = "silu") -> torch.Tensor:
        """The MLP's activation in one pass: gate_up [T, 2F] fp32 (each row [gate | up], as the
        fused gate/up product writes it) -> act(gate) * up [T, F], act "silu" (SwiGLU) or
        "gelu_tanh" (GeGLU: GELU's tanh approximation)."""
        _check_tensor_args(gate_up=gate_up)
        if not isinstance(activation, str):
            raise TypeError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        return self.ext.act_mul(gate_up, activation)

    def topk_pairs(self, logits, k: int, offset: int = 0) -> torch.Tensor:
        """Each row's k best logits of [rows, n] fp32, best first (NaN first, as torch.topk; equal
        logits by the lower index, as argmax): [rows, 2k], the k values and then their indices +
        offset as float32 (exact below 2^24). A tensor-parallel rank's candidates (offset: its
        first token id)."""
        _check_tensor_args(logits=logits)
        return self.ext.topk_pairs(logits, _positive_int("k", k), _positive_int("offset", offset, minimum=0))

    def merge_topk(self, pairs, vocab: int) -> torch.Tensor:
        """The k best of every rank's topk_pairs, gathered as [world, rows, 2k], as logits
        [rows, vocab] that are -inf but at those k tokens (what sampling needs for greedy and
        top-k): the exact global top-k, since each rank's k best hold every one of it."""
        _check_tensor_args(pairs=pairs)
        return self.ext.merge_topk(pairs, _positive_int("vocab", vocab))

    def random_normal(self, shape, *, seed: int, stream: int, std: float = 1.0,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new `shape` tensor holding random stream `stream` of `seed`, times std: approximately
        N(0, std^2) (four uniforms summed; kernels/random.cpp), the same values on any number
        of threads; in bfloat16 they are the float32 values rounded to nearest."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        if not isinstance(std, (int, float)) or isinstance(std, bool) or not 0 <= std < float("inf"):
            raise ValueError(f"std must be a finite number >= 0, got {std!r}")
        if isinstance(seed, int) and seed >= 1 << 63:
            raise ValueError(f"seed must be below 2**63, got {seed}")
        out = torch.empty(tuple(shape), dtype=dtype)
        self.ext.fill_normal_(out, _positive_int("seed", seed, 0), _positive_int("stream", stream, 0), float(std))
        return out

    # -- KV cache --------------------------------------------------------------------

    def quantize_kv_int8(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (int8 values [..., D], fp32 scales [...]), one symmetric scale per vector:
        scale = max|x| / 127, q = round(x / scale), so |x - q * scale| <= scale / 2."""
        _check_tensor_args(x=x)
        return self.ext.quantize_kv_int8(x)

    def kv_cache_append(self, cache, values, positions, *, scales=None, layout: str = "rows") -> None:
        """Write values [B, Hkv, T, D] into cache [B, Hkv, Lmax, D] at positions[b] .. +T, in place.

        The cache may be int8 (then scales [B, Hkv, Lmax] fp32 receives the per-token scales),
        fp16, bf16 or fp32; values (any strides, fp32/bf16/fp16) are converted, rounding to
        nearest even. The cache and scales must be contiguous: they are written in place.
        layout: "rows" (token after token), or for an int8 cache the tiled layout's "k_tiles"
        (K) or "v_groups" (V), read by decode_attention(..., int8_kernel="tile"); see untile_kv."""
        _check_tensor_args(cache=cache, values=values, positions=positions)
        if layout not in TILED_LAYOUTS:
            raise ValueError(f"kv_cache_append: layout must be one of {', '.join(TILED_LAYOUTS)}, got {layout!r}")
        self.ext.kv_cache_append(cache, values, positions, scales, layout)


TILED_LAYOUTS = ("rows", "k_tiles", "v_groups")


def _head_map(fn: str, group, q_offset) -> tuple[int, int]:
    for name, value in (("group", group), ("q_offset", q_offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{fn}: {name} must be a non-negative integer, got {value!r}")
    return group, q_offset  # the kernel checks them against the heads


def _int8_kernel(fn: str, name) -> str:
    if not isinstance(name, str):  # the C++ side names the accepted values for a wrong string
        raise TypeError(f"{fn}: int8_kernel must be one of {', '.join(constants()['int8_kernels'])}, got {name!r}")
    return name


def constants() -> dict:
    """The constants the C++ side defines and Python needs (kernels.h, exported by the
    extension's constants(); read, never copied): weight_group (grouped int8 weights per
    scale), tiled_align / tile_tokens / v_group_tokens (the tiled int8 KV layout),
    matvec_max_rows_default (the matrix-vector / GEMM crossover before it is measured),
    gemm_panel_bytes (the FMA GEMM's budget for a block of x^T over a panel of K, from this
    host's caches), tile_max_block_m (the most query rows
    of a prefill task on the bf16 engines), shm_header_bytes, weight_kernels
    (the WeightDtype enumerators), timer_parts (the fused step's timer columns), int8_kernels
    (the ways a decode kernel reads an int8 cache, Int8Kernel's order)."""
    global _CONSTANTS
    if _CONSTANTS is None:
        _CONSTANTS = dict(native.ext.constants())
    return _CONSTANTS


_CONSTANTS: dict | None = None


def __getattr__(name: str):
    if name == "TILED_ALIGN":  # the tiled layout's Lmax multiple (kernels.h: kTiledAlign)
        return constants()["tiled_align"]
    raise AttributeError(f"module 'workbench.kernels' has no attribute {name!r}")


def tiled_length(tokens: int) -> int:
    """`tokens` rounded up to whole blocks of the tiled layout (a multiple of TILED_ALIGN)."""
    align = constants()["tiled_align"]
    return -(-tokens // align) * align


def untile_kv(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A plane [..., Lmax, D] of the tiled int8 layout back in token rows (same shape).

    k_tiles: byte (t, d) at (t // 16) 16 D + (d // 4) 64 + (t % 16) 4 + d % 4;
    v_groups: byte (t, d) at (t // 4) 4 D + 4 d + t % 4 (kernels/decode_tiled.cpp)."""
    *lead, L, D = values.shape
    if layout == "rows":
        return values
    if layout == "k_tiles":
        return values.reshape(*lead, L // 16, D // 4, 16, 4).transpose(-3, -2).reshape(*lead, L, D)
    if layout == "v_groups":
        return values.reshape(*lead, L // 4, D, 4).transpose(-2, -1).reshape(*lead, L, D)
    raise ValueError(f"untile_kv: layout must be one of {', '.join(TILED_LAYOUTS)}, got {layout!r}")


def quantize_weight_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, symmetric: w [N, K] (any float dtype) -> (q int8 [N, K], scale fp32).
    group None: one scale per output row, scale [N]; group 32: one per 32 weights of a row,
    scale [N, ceil(K / 32)] (llama.cpp's Q8_0 granularity). scale = max|w| / 127 over what it
    covers, q = round(w / scale), so |w - q scale| <= scale / 2; all-zero: scale 0, exact."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_int8: w must be a 2-D float tensor [N, K], got {tuple(w.shape)} {w.dtype}")
    g = constants()["weight_group"]
    if group not in (None, g):
        raise ValueError(f"quantize_weight_int8: group must be None (per row) or {g} (the kernels' weight group), "
                         f"got {group!r}")
    N, K = w.shape
    groups = -(-K // g) if group else 1
    scales = torch.empty(N, groups) if group else torch.empty(N)
    q = torch.empty(w.shape, dtype=torch.int8)
    step = max(1, (64 << 20) // max(1, 4 * K))  # ~64 MiB of fp32 at a time: a 7B matrix never twice
    for r0 in range(0, N, step):
        block = w[r0:r0 + step].float()
        if group:
            padded = torch.nn.functional.pad(block, (0, groups * g - K)).reshape(block.shape[0], groups, g)
            s = padded.abs().amax(-1) / 127  # [rows, groups]
            per = s.repeat_interleave(g, dim=1)[:, :K]
        else:
            s = block.abs().amax(dim=1) / 127
            per = s[:, None]
        scales[r0:r0 + step] = s
        q[r0:r0 + step] = torch.where(per > 0, block / torch.where(per > 0, per, 1), 0).round().clamp(
            -127, 127).to(torch.int8)
    return q, scales


def dequantize_kv_int8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of quantize_kv_int8: values [..., D] int8, scales [...] -> fp32 [..., D]."""
    if values.dtype != torch.int8:
        raise TypeError(f"dequantize_kv_int8: values must be int8, got {values.dtype}")
    if scales.shape != values.shape[:-1]:
        raise ValueError(f"dequantize_kv_int8: scales must have shape {tuple(values.shape[:-1])}, "
                         f"got {tuple(scales.shape)}")
    return values.float() * scales.float().unsqueeze(-1)


def _check_tensor_args(**tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


native = KernelSet(process_build())  # the process's build (named "native" for the usual case)
slim_attention = native.slim_attention
flash_attention = native.flash_attention
decode_attention = native.decode_attention
quantize_kv_int8 = native.quantize_kv_int8
kv_cache_append = native.kv_cache_append
linear = native.linear
gemm_engine = native.gemm_engine
gemm_engine_for = native.gemm_engine_for
set_gemm_engine = native.set_gemm_engine
block_activation_bits = native.block_activation_bits
set_block_activation_bits = native.set_block_activation_bits
gemm_engines = native.gemm_engines
matvec_max_rows = native.matvec_max_rows
rope_ = native.rope_
act_mul = native.act_mul
topk_pairs = native.topk_pairs
merge_topk = native.merge_topk
rms_norm = native.rms_norm
random_normal = native.random_normal
decode_stack = native.decode_stack
block_row_bytes = native.block_row_bytes
quantize_blocks = native.quantize_blocks
repack_blocks = native.repack_blocks
dequantize_blocks = native.dequantize_blocks
