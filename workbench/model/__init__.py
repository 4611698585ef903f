"""The model layer: what a Llama-family model is and how it runs on the kernels.

    config       ModelConfig and the public models' exact shapes (PRESETS)
    weights      weight formats (WEIGHT_FORMATS)
    kv_formats   KV-cache formats (KV_FORMATS) and the KV cache
    attention    attention backends (ATTENTION_BACKENDS)
    switches     the (attention, KV format) pair a run uses, validated against both registries
    llama        the decoder on the kernels: prefill, decode, per-layer records; the Parallel a
                 tensor-parallel rank is built with
    timing       StepRecord, Timings, Clock and the timing PARTS every table and figure iterates over
    tokenizer    byte-level BPE from GGUF metadata or tokenizer.json; a byte tokenizer
    loaders      the bundled model, GGUF files, Hugging Face directories, random presets
"""
