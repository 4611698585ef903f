"""The runtime layer: a loaded model and what runs on it.

    generate     Model (load_model, generate, logits, the switches), GenerationResult
    sampling     greedy / temperature / top-k / top-p
    timing       StepRecord, Timings and the timing parts (PARTS)
    streaming    TextStream: print tokens as they are generated
    threads      set_threads: the one rule for thread counts
    status       status_report: model, switches, threads, kernels, peaks in a few lines
    aio          run_coroutine: a coroutine to its end, also inside a running event loop (a kernel's)
"""
