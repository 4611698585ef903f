"""A few lines on the state of the workbench: what is loaded, its switches, the threads, the
kernels' ISA path and the machine's measured peaks (`%workbench`, `workbench.status()`)."""

from __future__ import annotations


def status_report(model=None) -> str:
    from workbench.hw.machine import machine_info
    from workbench.kernels.peaks import measured_peaks
    from workbench.kernels import build_info
    from workbench.runtime.threads import get_threads

    info, m, p = build_info(), machine_info(), measured_peaks()
    lines = [f"model      {model!r}" if model is not None else "model      (none loaded: %load_model smollm2-135m)"]
    if model is not None:
        llama = getattr(model, "llama", None)
        if llama is not None:  # each tensor group's format (a file's own: a Q4_K_M mixes them)
            from workbench.model.weights import describe_formats

            lines.append(f"weights    {describe_formats(llama.weight_formats)} ({llama.weight_bytes / 2**20:.1f} MiB)")
        lines.append(f"switches   attention={model.attention} kv_cache={model.kv_cache}")
    lines += [
        f"threads    {get_threads()}",
        f"kernels    {info['isa']} path ({', '.join(info['flags'])}), micro-kernel {info['gemm_tile']}",
        f"cpu        {m.cpu_model}, L2 {m.l2_bytes // 1024} KiB",
        f"peaks      triad {p.triad_gbps:.1f} GB/s, FMA {p.fma_gflops:.0f} GFLOP/s ({p.threads} threads, "
        f"measured {p.measured_at})",
    ]
    return "\n".join(lines)
