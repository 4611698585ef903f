"""The analysis layer: experiments built from the runtime, each a library function that the
magics, the notebooks, the CLI and the benchmarks call.

    text          English text available offline, and prompts of exact lengths cut from it
    forcing       teacher forcing: decode a given continuation, step by step
    ablation      grids of attention backend x KV format x prompt length x batch
    demo          the main job (`workbench demo`)
    experiments   interleaved timing; prefill and KV-format kernel comparisons
    tables        one plain-text table formatter
"""
