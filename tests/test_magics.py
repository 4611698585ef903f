"""The magics driven in a real IPython shell (InteractiveShell), every error path included."""

from __future__ import annotations

import pytest

IPython = pytest.importorskip("IPython")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402


@pytest.fixture(scope="module")
def shell():
    from workbench.runtime import session

    session.current.model = None  # the shell is one per process: start from nothing loaded
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "workbench")
    return sh


def run(shell, line: str):
    """Run one cell; return (result, error) with the exception it raised, if any."""
    result = shell.run_cell(line, silent=False)
    return result, result.error_in_exec or result.error_before_exec


def test_nothing_loaded_yet_is_a_usage_error(shell):
    for line in ("%attention slim", "%kvcache int8", "%generate hello", "%ablate --batch 1"):
        _, err = run(shell, line)
        assert isinstance(err, UsageError) and "%load_model" in str(err)


def test_load_switch_generate(shell, capsys):
    _, err = run(shell, "%load_model smollm2-135m")
    assert err is None
    assert "smollm2-135m" in capsys.readouterr().out
    assert run(shell, "%attention flash")[1] is None
    assert run(shell, "%kvcache int8")[1] is None
    assert shell.user_ns["wb_model"].attention == "flash" and shell.user_ns["wb_model"].kv_cache == "int8"
    capsys.readouterr()
    _, err = run(shell, "%generate -n 6 The capital of France is")
    assert err is None
    out = capsys.readouterr().out
    assert "Paris" in out and "tokens/s" in out and "per decode step (" in out and "median of 5), all 30 layers" in out
    assert shell.user_ns["wb_result"].switches.kv_cache == "int8"
    assert run(shell, "%attention")[1] is None and run(shell, "%kvcache")[1] is None  # no argument: the current one
    assert capsys.readouterr().out.splitlines() == [
        "attention = flash", "kv_cache = int8 (tile); other kernels: dot, widen (%kvcache int8 --kernel ...)"]


def test_ignore_eos_generates_the_length_asked_for(shell, capsys):
    """A chat reply ends at end-of-sequence (and says so); with --ignore-eos the same
    generation runs to -n, as timed runs and fault tests need."""
    run(shell, "%load_model smollm2-135m")
    capsys.readouterr()
    assert run(shell, "%generate -n 48 --chat Answer with one word: is the sky blue")[1] is None
    stopped = shell.user_ns["wb_result"]
    assert len(stopped.token_ids) < 48 and "stopped at end-of-sequence" in capsys.readouterr().out
    assert run(shell, "%generate -n 48 --ignore-eos --chat Answer with one word: is the sky blue")[1] is None
    full = shell.user_ns["wb_result"]
    assert len(full.token_ids) == 48 and full.sampling["stop_at_eos"] is False
    assert full.token_ids[:len(stopped.token_ids)] == stopped.token_ids  # greedy: the same reply, then more
    assert "stopped at end-of-sequence" not in capsys.readouterr().out


def test_a_trained_model_cut_short_warns(shell, capsys):
    _, err = run(shell, "%load_model smollm2-135m --layers 2")
    assert err is None
    out = capsys.readouterr().out
    assert "warning: " in out and "first 2 of its 30 trained layers" in out and "--random" in out
    _, err = run(shell, "%load_model llama2-7b --random --layers 1")  # random weights: nothing to warn about
    assert err is None and "warning" not in capsys.readouterr().out
    run(shell, "%load_model smollm2-135m")


def test_mistakes_raise_usage_errors_and_keep_the_model(shell):
    run(shell, "%load_model smollm2-135m")
    model = shell.user_ns["wb_model"]
    cases = {
        "%attention warp": "invalid choice",
        "%kvcache int4": "invalid choice",
        "%threads zero": "invalid int value",
        "%threads 0": "threads must be between",
        "%load_model llama2-7b": "no local weights for llama2-7b",
        "%load_model gpt-17": "unknown model",
        "%load_model llama2-7b --random --layers 0": "layers must be a positive integer",
        "%generate -n 0 hi": "max_new_tokens must be a positive integer",
        "%ablate --attention slim,warp": "warp not accepted",
        "%ablate --prompt-len 12x": "comma-separated list of int",
        "%ablate --batch 0": "--batch values must be positive",
        "%ablate -o 1bad": "variable name",
    }
    for line, message in cases.items():
        _, err = run(shell, line)
        assert isinstance(err, UsageError), (line, err)
        assert message in str(err), (line, str(err))
    assert shell.user_ns["wb_model"] is model  # a failed %load_model leaves the loaded model in place
    assert run(shell, "%generate -n 2 Hello")[1] is None


def test_ablate_stores_a_dataframe(shell):
    run(shell, "%load_model smollm2-135m")
    _, err = run(shell, "%ablate --attention slim,naive --kvcache int8,fp32 --prompt-len 24 --batch 1,2 "
                        "--new-tokens 3 -o df")
    assert err is None
    df = shell.user_ns["df"]
    assert len(df) == 2 * 2 * 2
    assert set(df.columns) >= {"attention", "kv_cache", "prefill_ms", "decode_tokens_per_s", "decode_gbps",
                               "pct_peak_bandwidth", "decode_gflops", "pct_peak_fma", "top1_agreement"}
    ref = df[(df.attention == "naive") & (df.kv_cache == "fp32")]
    assert (ref.top1_agreement == 1.0).all()


def test_workbench_status_and_help(shell, capsys):
    run(shell, "%load_model smollm2-135m")
    capsys.readouterr()
    assert run(shell, "%workbench")[1] is None
    out = capsys.readouterr().out
    assert "attention=" in out and "triad" in out and "path" in out
    for magic in ("load_model", "attention", "kvcache", "threads", "generate", "ablate", "workbench", "serve",
                  "serve_bench"):
        doc = shell.find_line_magic(magic).__doc__
        assert "Examples::" in doc and f"%{magic}" in doc.split("Examples::")[0]  # usage line, then examples


def test_kv_quality_magic_table_figure_report_and_every_format_generates(shell, capsys, tmp_path):
    from workbench import report
    from workbench.model.kv_formats import KV_FORMATS

    run(shell, "%load_model smollm2-135m")
    report.clear()
    text = tmp_path / "notes.txt"
    text.write_text(open("/usr/share/common-licenses/GPL-3").read())  # a file of the user's
    _, err = run(shell, f"%kv_quality --formats fp32,int8,int8:dot,int8-kivi,int4-block32 --context 96,160 "
                        f"--steps 8 --text {text} -o kvq")
    assert err is None, err
    out = capsys.readouterr().out
    assert "best per byte" in out and "int8-kivi" in out and str(text) in out
    df = shell.user_ns["kvq"]
    assert len(df) == 5 * 2 and set(df.context) == {96, 160}
    assert "int8 (tile)" in set(df.cache) and "int8 (dot)" in set(df.cache)
    assert set(df.columns) >= {"cache", "kv_cache", "kv_kernel", "bits", "bytes_per_element", "context", "perplexity", "kl_nats",
                               "top1_agreement_vs_fp32"}
    four = df[df.kv_cache == "int4-block32"].iloc[0]
    assert four.bits == 4 and four.bytes_per_element == pytest.approx(0.5 + 2 / 32)
    assert (df[df.kv_cache == "fp32"].kl_nats == 0).all()
    assert [e["kind"] for e in report.recorded()] == ["kv_quality"]
    report.clear()
    for line, message in (("%kv_quality --formats int3", "int3"), ("%kv_quality --text /no/such/file", "no such file"),
                          ("%kv_quality --context 8 --steps 16", "steps must be")):
        _, err = run(shell, line)
        assert isinstance(err, UsageError) and message in str(err), (line, err)
    for fmt in KV_FORMATS:  # every format runs in generation, so %kvcache accepts each
        assert run(shell, f"%kvcache {fmt}")[1] is None
        assert run(shell, "%generate -n 3 The capital of France is")[1] is None, fmt
    capsys.readouterr()
    for kernel in KV_FORMATS["int8"].kernels:  # and each kernel of the int8 cache
        assert run(shell, f"%kvcache int8 --kernel {kernel}")[1] is None
        assert f"kv_cache = int8 ({kernel})" in capsys.readouterr().out
        assert run(shell, "%generate -n 3 The capital of France is")[1] is None, kernel
        assert shell.user_ns["wb_result"].switches.kv_kernel == kernel
    _, err = run(shell, "%kvcache fp16 --kernel tile")
    assert isinstance(err, UsageError) and "kv_kernel must be one of widen for kv_cache 'fp16'" in str(err)
    assert shell.user_ns["wb_model"].kv_cache == "int8"  # a refused switch leaves the model's as they were
    run(shell, "%kvcache fp32")


def test_threads_without_an_argument_prints_the_current_number(shell, capsys):
    """README: the switches with no argument print the current value; %threads did not."""
    from workbench.runtime.threads import get_threads

    capsys.readouterr()
    assert run(shell, "%threads")[1] is None
    assert capsys.readouterr().out.strip() == f"threads = {get_threads()}"


def test_distributed_stop_without_a_cluster_keeps_the_model(shell, capsys):
    """A no-op must not unload the model: %distributed stop with no cluster once put back a
    single-process model that had never been saved (None)."""
    from workbench.runtime import session

    run(shell, "%load_model smollm2-135m")
    model = shell.user_ns["wb_model"]
    capsys.readouterr()
    assert run(shell, "%distributed stop")[1] is None
    assert "no cluster was running; the model stays" in capsys.readouterr().out
    assert session.current.model is model and shell.user_ns["wb_model"] is model
    assert run(shell, "%workbench")[1] is None
    assert "none loaded" not in capsys.readouterr().out


def test_weight_quality_magic_table_figure_report_and_the_model_stays(shell, capsys):
    """Each format loaded again from the model's source: a row each with its quality against
    fp32 weights, bytes and speed; the table in -o, the entry in %report with its findings,
    the loaded model untouched; bad arguments a UsageError naming them."""
    from workbench import report
    from workbench.report import render

    run(shell, "%load_model smollm2-135m")
    loaded = shell.user_ns["wb_model"]
    report.clear()
    capsys.readouterr()
    _, err = run(shell, "%weight_quality --formats fp32,file,q8_0,int4-g128 --context 80 --rounds 1 --new-tokens 3 "
                        "--prompt-len 16 -o wq")
    assert err is None, err
    out = capsys.readouterr().out
    assert "Pareto front" in out and "int4-g128" in out and "80 tokens scored" in out
    df = shell.user_ns["wq"]
    assert list(df.format) == ["fp32", "file", "q8_0", "int4-g128"]
    rows = {r["format"]: r for r in df.to_dict("records")}
    assert rows["fp32"]["kl_nats"] == 0 and rows["fp32"]["top1_agreement"] == 1
    assert rows["fp32"]["bits_per_weight"] == 32 and 4 < rows["int4-g128"]["bits_per_weight"] < 4.5
    assert rows["q8_0"]["kl_nats"] < rows["int4-g128"]["kl_nats"]
    assert all(r["decode_tok_s"]["median"] > 0 and r["prefill_ms"]["median"] > 0 for r in rows.values())
    assert shell.user_ns["wb_model"] is loaded and loaded.llama is not None
    entries = report.recorded()
    assert [e["kind"] for e in entries] == ["weight_quality"] and len(entries[0]["rows"]) == 4
    page = render.html_page(report.build())
    assert "weight formats: each one" in page and "fig-weights-0" in page and "no format reads fewer bytes" in page
    report.clear()
    for line, message in (("%weight_quality --formats q3_k", "q3_k"), ("%weight_quality --context 1", "context"),
                          ("%weight_quality --rounds 0", "rounds"), ("%weight_quality --text /no/such/file", "no such file"),
                          ("%weight_quality -o 1x", "-o needs")):
        _, err = run(shell, line)
        assert isinstance(err, UsageError) and message in str(err), (line, err)
    assert shell.user_ns["wb_model"] is loaded


def _helps(magic) -> list[str]:
    """Every help string a magic's arguments give, as argparse prints it (%% is one %)."""
    parser = magic.__func__.parser  # what @magic_arguments built the docstring from
    return [a.help % {"default": a.default, "prog": parser.prog, "dest": a.dest}
            for a in parser._actions if a.help and a.help != "==SUPPRESS=="]


@pytest.mark.parametrize("name", ["load_model", "attention", "kvcache", "threads", "generate", "ablate", "kv_quality",
                                  "weight_quality", "distributed", "serve", "serve_bench", "profile", "report", "workbench"])
def test_every_magics_help_reads_as_written(shell, name):
    """`%magic?` shows the docstring IPython builds from the arguments: each argument's help
    whole (a bare % in one made argparse print its own internals into %serve_bench's --url
    line), and the defaults said where a help says "default"."""
    magic = shell.find_line_magic(name)
    doc = "".join(magic.__doc__.split())  # argparse wraps lines (and breaks hyphenated words)
    assert "option_strings" not in doc and "{'" not in doc, magic.__doc__
    for help_text in _helps(magic):
        assert "".join(help_text.split()) in doc, (name, help_text)
    assert "Examples::" in magic.__doc__


def test_serve_bench_help_says_every_default():
    """serve-bench's options are defined once (workbench.options) for the CLI and the magic,
    each default the function's own and said in the help."""
    import inspect

    from workbench.analysis.serve_bench import serve_bench
    from workbench.options import SERVE_BENCH_OPTIONS

    defaults = inspect.signature(serve_bench).parameters
    for flags, kwargs in SERVE_BENCH_OPTIONS:
        name = flags[0].lstrip("-").replace("-", "_")
        if name in defaults and name != "prompts_file":
            assert kwargs["default"] == defaults[name].default, name
        if kwargs.get("default") is not None:
            assert "default" in kwargs["help"], name
