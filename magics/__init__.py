"""IPython magics for the workbench, a thin layer over the `workbench` library.

    In [1]: %load_ext workbench
    In [2]: %load_model smollm2-135m
    In [3]: %attention slim
    In [4]: %kvcache int8
    In [5]: %generate --max-new-tokens 32 The capital of France is
    In [6]: %ablate --attention slim,flash --kvcache int8,fp32 --prompt-len 128 --batch 1,4 -o df
    In [7]: %workbench
    In [8]: %serve start --slots 8; %serve_bench --rate 1,2,4 -o sb; %serve stop

Every magic has `%magic?` help. A user's mistake (unknown model or backend, a bad number,
nothing loaded yet) raises UsageError with a one-line message; the loaded model stays.
"""

from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from workbench.model.attention import ATTENTION_BACKENDS
from workbench.model.kv_formats import KERNEL_FORMATS, KV_FORMATS, KV_KERNELS, kv_label, parse_kv
from workbench.distributed.cluster import LAUNCHERS
from workbench.distributed.backends import BACKENDS
from workbench.distributed.tp import LM_HEAD, TOKEN_BROADCAST
from workbench.options import (GENERATE_OPTIONS, LOAD_OPTIONS, SERVE_BENCH_OPTIONS, chat_prompt, generate_kwargs,
                               magic_options)


def _csv(option: str, kind, choices=None):
    """argparse type for `option`: a comma-separated list of `kind`, each in `choices` if given
    (positive if ints); every message names the option."""
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            values = [kind(x) for x in items]
        except ValueError:
            raise UsageError(f"{option} expects a comma-separated list of {kind.__name__}, got {text!r}") from None
        if not values:
            raise UsageError(f"{option} expects a comma-separated list, got {text!r}")
        if choices is not None:
            bad = [v for v in values if v not in choices]
            if bad:
                raise UsageError(f"{option}: {', '.join(map(str, bad))} not accepted; choose from {', '.join(choices)}")
        if kind is int and any(v < 1 for v in values):
            raise UsageError(f"{option} values must be positive integers, got {text!r}")
        return values
    parse.__name__ = f"comma-separated {kind.__name__}s"
    return parse


def _kv_list(option: str):
    """argparse type for `option`: comma-separated KV caches, each a format or format:kernel
    (int8:widen), checked against the registry."""
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise UsageError(f"{option} expects a comma-separated list, got {text!r}")
        for item in items:
            try:
                parse_kv(item)
            except ValueError as e:
                raise UsageError(f"{option}: {e}") from None
        return items
    parse.__name__ = "comma-separated KV caches"
    return parse


def _start_command(cluster) -> str:
    """%distributed start as `cluster` was started (its ranks, backend, threads, pinning, launcher)."""
    return (f"%distributed start -n {cluster.n} --backend {cluster.backend} --threads-per-rank {cluster.threads_per_rank}"
            + (" --pin" if cluster.pin else "") + (f" --launcher {cluster.launcher}" if cluster.launcher != "local" else ""))


@magics_class
class WorkbenchMagics(Magics):
    """The workbench's magics. The loaded model is the session's (workbench.runtime.session),
    which a control panel follows too, and `wb_model` in the namespace."""

    def __init__(self, shell):
        super().__init__(shell)
        self.last_result = None
        self._last_load = None  # (name, load arguments) of the last %load_model, for %ablate --ranks
        self._single = None  # the single-process model while a cluster runs
        self._last_load_line = None

    @property
    def model(self):
        from workbench.runtime.session import current

        return current.model

    def _switch(self, name: str, value: str | None) -> None:
        model = self._require_model()
        if value is not None:
            try:
                setattr(model, name, value)  # validated by the model; no reload
            except ValueError as e:
                raise UsageError(str(e)) from None
        print(f"{name} = {getattr(model, name)}")

    def _kv_command(self) -> str:
        """%kvcache as the model's switches stand, the kernel named where the format has several."""
        from workbench.model.kv_formats import kv_format

        fmt = kv_format(self.model.kv_cache)
        kernel = fmt.kernel(self.model.kv_kernel, self.model.config.head_dim)
        return f"%kvcache {fmt.name}" + (f" --kernel {kernel}" if len(fmt.kernels) > 1 else "")

    def _command(self, magic: str, line: str, serve_line: str | None = None) -> str:
        """The magics that reproduce a measurement as it was run: the model's load, the
        switches and threads in force, then this one (run as written, they measure the same
        configuration, not the defaults). serve_line: the %serve start that this one loaded,
        started before it and stopped after, as a cluster is."""
        from workbench.runtime.threads import get_threads

        cluster = getattr(self.model, "cluster", None)  # a tensor-parallel model: its cluster first
        lines = ["%load_ext workbench"]
        if cluster is not None:
            lines.append(_start_command(cluster))
        if self._last_load_line:
            lines.append(f"%load_model {self._last_load_line}")
        if self.model is not None and magic != "load_model":
            lines += [f"%attention {self.model.attention}", self._kv_command()]
        if cluster is not None:
            o = self.model.options
            lines.append(f"%distributed --token-broadcast {o.token_broadcast} --lm-head {o.lm_head} "
                         f"--zero-copy {'on' if o.zero_copy else 'off'} --kv-handoff {'on' if o.kv_handoff else 'off'} "
                         f"--check-topk {'on' if o.check_topk else 'off'}")
        lines.append(f"%threads {get_threads()}")
        if serve_line is not None:
            lines.append(f"%serve {serve_line}")
        lines.append(f"%{magic} {line}".strip())
        if serve_line is not None:
            lines.append("%serve stop")
        if cluster is not None:
            lines.append("%distributed stop")  # the commands leave nothing running
        return "\n".join(lines)

    def _require_model(self):
        if self.model is None:
            raise UsageError("no model loaded: run %load_model first (e.g. %load_model smollm2-135m)")
        return self.model

    @magic_arguments()
    @argument("name", help="preset name (smollm2-135m, llama2-7b, ...), a .gguf file or a model directory")
    @magic_options(LOAD_OPTIONS)
    @argument("--seed", type=int, default=0, help="seed for --random weights")
    @argument("--experts", choices=["expert", "tensor"], default=None,
              help="on a cluster, a mixture of experts' split: whole experts per rank (expert, the default) or each "
                   "expert's FFN split (tensor)")
    @line_magic
    def load_model(self, line):
        """Load a model; it replaces the current one only if loading succeeds.

        Examples::

          In [1]: %load_model smollm2-135m
          In [2]: %load_model llama2-7b --random --layers 4 --dtype bf16
          In [3]: %load_model ~/models/TinyLlama-1.1B-Chat-v1.0
          In [4]: %load_model ~/models/Qwen3-30B-A3B-Q4_K_M.gguf --experts tensor   # on a cluster
        """
        import functools
        import warnings

        import workbench as wb
        from workbench.distributed.cluster import DistributedError, running
        from workbench.distributed.tp import TPOptions

        args = parse_argstring(self.load_model, line)
        cluster = running()  # with %distributed start, every engine loads the model and keeps its shard
        if args.experts is not None and cluster is None:
            raise UsageError("--experts splits a mixture of experts over ranks: %distributed start first")
        load = (functools.partial(cluster.load_model, options=TPOptions(experts=args.experts or "expert"))
                if cluster is not None else wb.load_model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model = load(args.name, random=args.random, layers=args.layers, dtype=args.dtype, seed=args.seed)
            except (wb.ModelLoadError, ValueError, DistributedError) as e:
                raise UsageError(str(e)) from None
        for w in caught:
            print(f"warning: {w.message}")
        self._last_load = (args.name, dict(random=args.random, layers=args.layers, dtype=args.dtype, seed=args.seed))
        self._last_load_line = line
        from workbench.runtime.session import current

        if self.model is not None:
            model.attention, model.kv_cache = self.model.attention, self.model.kv_cache
            model.kv_kernel = self.model.kv_kernel
        current.model = model
        self.shell.user_ns["wb_model"] = model
        print(repr(model))

    @magic_arguments()
    @argument("backend", nargs="?", choices=list(ATTENTION_BACKENDS), default=None,
              help=" | ".join(ATTENTION_BACKENDS) + " (none: print the current one)")
    @line_magic
    def attention(self, line):
        """Choose the attention kernel for the next runs (no reload); without an argument,
        print the current one.

        Examples::

          In [1]: %attention slim
          In [2]: %attention
        """
        self._switch("attention", parse_argstring(self.attention, line).backend)

    @magic_arguments()
    @argument("dtype", nargs="?", choices=list(KV_FORMATS), default=None,
              help=" | ".join(KV_FORMATS) + " (none: print the current one)")
    @argument("--kernel", choices=list(KV_KERNELS), default=None,
              help="the kernel that reads the cache: " + " | ".join(KV_KERNELS) + " (default: the format's fastest)")
    @line_magic
    def kvcache(self, line):
        """Choose the KV-cache format, and optionally the kernel that reads it, for the next
        runs (no reload); without arguments, print the current ones. A format is storage
        (int8: int8 values and one fp32 scale per head per token); its kernels read the same
        values and scales (int8: tile, the default, dot, widen: the paper's).

        Examples::

          In [1]: %kvcache int8
          In [2]: %kvcache int8 --kernel widen
          In [3]: %kvcache
        """
        args = parse_argstring(self.kvcache, line)
        model = self._require_model()
        if args.kernel is not None and args.dtype is None:
            args.dtype = model.kv_cache
        try:
            if args.dtype is not None:
                KV_FORMATS[args.dtype].kernel(args.kernel)  # both checked before either is set
                model.kv_cache = args.dtype  # resets the kernel to the format's default
            if args.kernel is not None:
                model.kv_kernel = args.kernel
        except ValueError as e:
            raise UsageError(str(e)) from None
        fmt = KV_FORMATS[model.kv_cache]
        kernel = fmt.kernel(model.kv_kernel, model.config.head_dim)
        others = [k for k in fmt.kernels if k != kernel]
        print(f"kv_cache = {kv_label(model.kv_cache, kernel)}" +
              (f"; other kernels: {', '.join(others)} (%kvcache {fmt.name} --kernel ...)" if others else ""))

    @magic_arguments()
    @argument("n", type=int, nargs="?", default=None,
              help="number of threads for the kernels and torch (none: print the current number)")
    @line_magic
    def threads(self, line):
        """Set the number of threads (torch.set_num_threads); without an argument, print the
        current number.

        Examples::

          In [1]: %threads 2
          In [2]: %threads
        """
        from workbench.runtime.threads import get_threads, set_threads

        args = parse_argstring(self.threads, line)
        if args.n is None:
            print(f"threads = {get_threads()}")
            return
        try:
            print(f"threads = {set_threads(args.n)}")
        except ValueError as e:
            raise UsageError(str(e)) from None

    @magic_arguments()
    @argument("prompt", nargs="+", help="the prompt text")
    @magic_options(GENERATE_OPTIONS)
    @line_magic
    def generate(self, line):
        """Generate text, streaming tokens as they come, then a per-layer timing summary.

        The result (text, token ids, timings) is kept as `wb_result`.

        Examples::

          In [1]: %generate The capital of France is
          In [2]: %generate -n 64 --kv-cache int8 --chat Write a haiku about CPUs.
        """
        from workbench.runtime.streaming import TextStream

        args = parse_argstring(self.generate, line)
        model = self._require_model()
        try:
            prompt = chat_prompt(model, " ".join(args.prompt), args.chat)
            out = model.generate(prompt, **generate_kwargs(args), on_token=TextStream(model.tokenizer))
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.last_result = out
        self.shell.user_ns["wb_result"] = out
        from workbench import report

        report.record(out, model, command=self._command("generate", line), prompt=prompt)
        print("\n")
        print(out.report())

    @magic_arguments()
    @argument("--attention", type=_csv("--attention", str, ATTENTION_BACKENDS), default=list(ATTENTION_BACKENDS))
    @argument("--kvcache", type=_kv_list("--kvcache"), default=list(KERNEL_FORMATS),
              help="KV formats, each optionally with its kernel (int8:widen)")
    @argument("--kv-kernel", type=_csv("--kv-kernel", str, [*KV_KERNELS, "all"]), default=None,
              help="kernels that read the KV formats (each applies to the formats that have it; all: every "
                   "kernel of each format); default: each format's fastest")
    @argument("--prompt-len", type=_csv("--prompt-len", int), default=[128])
    @argument("--batch", type=_csv("--batch", int), default=[1])
    @argument("--new-tokens", type=int, default=16)
    @argument("--ranks", type=_csv("--ranks", int), default=None,
              help="tensor-parallel ablation: rank counts (1 = one process on the same cores)")
    @argument("--backend", type=_csv("--backend", str, BACKENDS), default=None, help="with --ranks")
    @argument("--token-broadcast", type=_csv("--token-broadcast", str, TOKEN_BROADCAST), default=None)
    @argument("--lm-head", type=_csv("--lm-head", str, LM_HEAD), default=None)
    @argument("--zero-copy", type=_csv("--zero-copy", str, ["on", "off"]), default=None)
    @argument("--kv-handoff", type=_csv("--kv-handoff", str, ["on", "off"]), default=None,
              help="a KV head two ranks hold: handed over (on) or computed on both (off); shm only")
    @argument("--experts", type=_csv("--experts", str, ["expert", "tensor"]), default=None,
              help="a mixture of experts' split over the ranks: whole experts per rank (expert) or each expert's "
                   "FFN split (tensor); each a load of its own (default expert)")
    @argument("--repeats", type=int, default=None,
              help="measured runs per setting, interleaved (default 3; with --ranks 2); rows show median and min-max")
    @argument("-o", dest="output", default=None, help="store the results DataFrame in this variable")
    @line_magic
    def ablate(self, line):
        """Run a grid of configurations and show one row per configuration: prefill ms,
        decode tokens/s, GB/s, % of the measured peak bandwidth, top-1 agreement with the
        naive / fp32-cache reference. With --ranks (and --backend, --token-broadcast,
        --lm-head, --zero-copy, --kv-handoff, and a mixture's --experts split), a tensor-parallel
        grid instead: decode ms/token, comm
        ms/token, % comm, bytes per token, whether the tokens equal one process's, then
        each switch's saving: its optimization against the setting without it in rows
        matched on the other switches, bytes and ms per token with the spread over the
        rounds (with -o tp, also in tp_savings). Zero copy and the KV handoff change the
        fused decode step on shm only (gloo and ccl rows say n/a; so does the KV handoff
        where the split shares no KV head).

        Examples::

          In [1]: %ablate --attention slim,flash --kvcache int8,fp32 --prompt-len 128,1024 --batch 1,16
          In [2]: %ablate --kvcache int8,fp16 --new-tokens 32 -o results
          In [3]: %ablate --ranks 1,2 --backend gloo,shm --zero-copy on,off -o tp
          In [4]: %ablate --ranks 1,2 --backend shm --experts expert,tensor     # a mixture of experts
        """
        from workbench.analysis.ablation import rows_as_dicts, run_ablation, spread_warnings
        from workbench.distributed.cluster import DistributedModel, running

        args = parse_argstring(self.ablate, line)
        model = self._require_model()
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o needs a Python variable name, got {args.output!r}")
        tp_options = (args.ranks, args.backend, args.token_broadcast, args.lm_head, args.zero_copy, args.kv_handoff,
                      args.experts)
        if any(v is not None for v in tp_options):
            return self._tp_ablate(args, line)
        if isinstance(model, DistributedModel) or running() is not None:
            raise UsageError("a cluster is running: use %ablate --ranks 1,2 ... for a tensor-parallel grid, or "
                             "%distributed stop for the single-process one")
        repeats = 3 if args.repeats is None else args.repeats
        if repeats == 1:
            print("--repeats 1: one sample per configuration, no spread; rows may differ by run-to-run noise")
        bar = _Progress()
        try:
            kernels = "all" if args.kv_kernel and "all" in args.kv_kernel else args.kv_kernel
            rows = run_ablation(model, args.attention, args.kvcache, args.prompt_len, args.batch, args.new_tokens,
                                progress=bar.update, repeats=repeats, kv_kernels=kernels)
        except ValueError as e:
            raise UsageError(str(e)) from None
        finally:
            bar.close()
        table = _dataframe(rows_as_dicts(rows))
        if args.output:
            self.shell.user_ns[args.output] = table
        from IPython.display import display

        from workbench import report
        from workbench.ui.plots import ablation_figure, show_figure

        report.record(rows, model, command=self._command("ablate", line))

        from workbench.analysis.ablation import DIGITS

        print("top1_agreement: share of positions whose most likely next token is the reference's "
              "(naive attention with an fp32 KV cache, same prompts); decode rates: all sequences together")
        display(table.round(DIGITS) if hasattr(table, "round") else table)  # -o keeps full precision
        show_figure(ablation_figure(rows))
        for warning in spread_warnings(rows):
            print(f"warning: {warning}")

    def _tp_ablate(self, args, line: str):
        from workbench.analysis.tp_ablation import tp_ablation
        from workbench.analysis.tp_savings import savings_table, switch_savings
        from workbench.distributed.cluster import DistributedError, running

        if running() is not None:
            raise UsageError("%ablate --ranks starts its own clusters: %distributed stop first")
        if self._last_load is None:
            raise UsageError("load the model with %load_model first (its name is what every engine loads)")
        name, kwargs = self._last_load
        try:
            from workbench.distributed.backends import available_backends

            rows = tp_ablation(name, kwargs, ranks=args.ranks or [1, 2], backends=args.backend or available_backends(),
                               token_broadcast=args.token_broadcast or ["ids"], lm_head=args.lm_head or ["topk"],
                               zero_copy=[z == "on" for z in (args.zero_copy or ["on"])],
                               kv_handoff=[h == "on" for h in (args.kv_handoff or ["on"])],
                               experts=args.experts or ["expert"],
                               prompt_len=args.prompt_len[0], new_tokens=args.new_tokens,
                               repeats=2 if args.repeats is None else args.repeats,
                               progress=print)
        except (ValueError, DistributedError) as e:
            raise UsageError(str(e)) from None
        table = _dataframe(rows)
        if args.output:
            self.shell.user_ns[args.output] = table
        from IPython.display import display

        from workbench import report

        report.record(rows, kind="tp_ablation", command=self._command("ablate", line))
        display(table.round(2) if hasattr(table, "round") else table)
        savings = _dataframe(savings_table(switch_savings(rows)))
        if len(savings):
            if args.output:
                self.shell.user_ns[f"{args.output}_savings"] = savings
            print("Each switch's saving per decode token (its optimization against the setting without it, rows "
                  "matched on the other switches; ms: median and min-max over the pairs' rounds):")
            display(savings.round(2) if hasattr(savings, "round") else savings)

    @magic_arguments()
    @argument("action", nargs="?", choices=["start", "status", "stop"], default=None,
              help="start engines, show their status, or stop them; none: change the switches below")
    @argument("-n", type=int, default=2, help="ranks (one ipyparallel engine each), default 2")
    @argument("--backend", default="shm", help="collectives: " + ", ".join(BACKENDS) + " (default shm)")
    @argument("--threads-per-rank", type=int, default=1)
    @argument("--pin", action="store_true", help="bind each rank to its own cores (and NUMA node)")
    @argument("--launcher", default="local", help="ipyparallel launcher: " + ", ".join(LAUNCHERS))
    @argument("--timeout", type=float, default=30.0, help="seconds a collective waits for a rank")
    @argument("--oversubscribe", action="store_true", help="allow more threads than CPUs")
    @argument("--token-broadcast", choices=list(TOKEN_BROADCAST), default=None)
    @argument("--lm-head", choices=list(LM_HEAD), default=None)
    @argument("--zero-copy", choices=["on", "off"], default=None)
    @argument("--kv-handoff", choices=["on", "off"], default=None,
              help="a KV head two ranks hold: one computes it and hands it over (shm), or both compute it")
    @argument("--check-topk", choices=["on", "off"], default=None,
              help="also gather all logits every step and compare the distributed top-k")
    @line_magic
    def distributed(self, line):
        """Tensor-parallel runs on ipyparallel engines: start them, switch the paper's three
        communication optimizations, stop them. While a cluster runs, %load_model loads on
        every engine (each keeps its shard) and %generate runs on them.

        Examples::

          In [1]: %distributed start -n 2 --backend shm --threads-per-rank 1 --pin
          In [2]: %load_model smollm2-135m
          In [3]: %generate -n 32 The capital of France is
          In [4]: %distributed --token-broadcast embeddings --lm-head gather --zero-copy off
          In [5]: %distributed status
          In [6]: %distributed stop
        """
        from workbench.distributed.cluster import Cluster, DistributedError, running
        from workbench.runtime.session import current

        args = parse_argstring(self.distributed, line)
        switches = {k: v for k, v in (("token_broadcast", args.token_broadcast), ("lm_head", args.lm_head),
                                      ("zero_copy", None if args.zero_copy is None else args.zero_copy == "on"),
                                      ("kv_handoff", None if args.kv_handoff is None else args.kv_handoff == "on"),
                                      ("check_topk", None if args.check_topk is None else args.check_topk == "on"))
                    if v is not None}
        cluster = running()
        try:
            if args.action == "start":
                if cluster is not None:
                    raise UsageError(f"a cluster is already running ({cluster!r}): %distributed stop first")
                cluster = Cluster(args.n, backend=args.backend, threads_per_rank=args.threads_per_rank, pin=args.pin,
                                  launcher=args.launcher, timeout_s=args.timeout,
                                  oversubscribe=args.oversubscribe).start()
                self._single = self.model  # back in use after %distributed stop
                current.model = None
                print(f"{cluster!r}: " + ", ".join(f"rank {e['rank']} pid {e['pid']} cpus {e['cpus']}"
                                                   for e in cluster.engines))
                print("now %load_model loads on every engine")
            elif args.action == "stop":
                if cluster is not None:
                    cluster.stop()
                # The single-process model comes back where the cluster's was in use: after this
                # stop, or after a rank's failure had stopped the cluster already. With no
                # cluster and a model of one process loaded, there is nothing to stop and the
                # model stays (a no-op must not unload it).
                was_distributed = getattr(current.model, "cluster", None) is not None
                if was_distributed or (cluster is not None and current.model is None):
                    current.model, self._single = self._single, None
                    self.shell.user_ns["wb_model"] = current.model
                loaded = "no model loaded" if current.model is None else f"loaded: {current.model.description}"
                print("cluster stopped; " + loaded if cluster is not None else
                      "the cluster had stopped already; " + loaded if was_distributed else
                      "no cluster was running; the model stays (" + loaded + ")")
            elif args.action == "status":
                print(_cluster_status(cluster))
            if switches:
                model = cluster.model if cluster is not None else None
                if model is None:
                    raise UsageError("no distributed model: %distributed start, then %load_model")
                options = model.set_options(**switches)
                print(", ".join(f"{k} = {v}" for k, v in vars(options).items()))
        except (ValueError, DistributedError) as e:
            raise UsageError(str(e)) from None

    @magic_arguments()
    @argument("--title", default="Workbench report", help="the report's title")
    @argument("-o", dest="output", default=None,
              help="the HTML file, the JSON beside it (default: report.html in the results folder, "
                   "workbench.cache.results_dir(): the checkout's results/, never the notebook's folder)")
    @line_magic
    def report(self, line):
        """Write a shareable report of everything measured in this session (every %generate
        and %ablate so far): one self-contained HTML page that opens offline and its JSON.
        It says where, as absolute paths.

        Examples::

          In [1]: %report
          In [2]: %report --title "SmolLM2, int8 vs fp16" -o ~/reports/kv.html
        """
        from workbench import report

        args = parse_argstring(self.report, line)
        entries = report.recorded()
        if not entries:
            raise UsageError("nothing measured yet: run %generate or %ablate first, then %report")
        try:
            out = report.write(args.output, title=args.title)
        except ValueError as e:
            raise UsageError(str(e)) from None
        kinds = ", ".join(f"{sum(e['kind'] == k for e in entries)} {k}" for k in sorted({e["kind"] for e in entries}))
        print(f"wrote {out['html']} and {out['json']}: {out['entries']} measurements ({kinds})")

    @magic_arguments()
    @argument("--text", default=None, help="a text file to measure on (default: the license texts)")
    @argument("--formats", type=_kv_list("--formats"), default=None,
              help="KV formats, each optionally with its kernel (int8:dot); default: every format and kernel")
    @argument("--context", type=_csv("--context", int), default=[1024], help="context lengths, e.g. 512,1024,2048")
    @argument("--steps", type=int, default=64, help="teacher-forced positions measured at the end of each context")
    @argument("-o", dest="output", default=None, help="store the table (a DataFrame) in this variable")
    @line_magic
    def kv_quality(self, line):
        """Each KV-cache format against an fp32 cache on real text: perplexity, KL of the
        next-token distributions, top-1 agreement and bytes per element, a table and a
        quality-vs-bytes figure; the rows join %report.

        Examples::

          In [1]: %kv_quality --context 512,1024,2048 -o kvq
          In [2]: %kv_quality --formats int8:widen,int8:dot,int8-block32 --text my_notes.txt
        """
        import pandas as pd
        from IPython.display import display

        from workbench import report
        from workbench.analysis.quality import ALL_CACHES, best_per_byte, default_text_name, kv_quality, quality_figure
        from workbench.ui.plots import show_figure

        args = parse_argstring(self.kv_quality, line)
        model = self._require_model()
        text = _text_file(args.text)
        try:
            rows = kv_quality(model, args.formats or ALL_CACHES, context=args.context, steps=args.steps, text=text)
        except ValueError as e:
            raise UsageError(str(e)) from None
        df = pd.DataFrame(rows)
        print(f"text: {args.text or default_text_name()}; the last {args.steps} tokens of each context "
              f"teacher-forced over the cache; reference: an fp32 cache")
        cols = ["cache", "granularity", "bits", "bytes_per_element", "context", "perplexity", "kl_nats",
                "top1_agreement_vs_fp32", "attention_rel_error", "kernel"]
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        front = best_per_byte(rows)
        print("best per byte (no format has fewer bytes and lower KL), at context "
              f"{max(args.context)}: " + ", ".join(f"{r['cache']} ({r['bytes_per_element']:.3f} B, KL "
                                                   f"{r['kl_nats']:.2e})" for r in front))
        show_figure(quality_figure(rows))
        report.record(rows, model, command=self._command("kv_quality", line), kind="kv_quality")
        if args.output:
            self.shell.user_ns[args.output] = df

    @magic_arguments()
    @argument("--formats", type=_csv("--formats", str), default=None,
              help="weight formats, comma-separated: 'file' (a GGUF's own formats) and any of "
                   "workbench.model.weights.WEIGHT_FORMATS (default: every format)")
    @argument("--text", default=None, help="a text file to measure on (default: the license texts)")
    @argument("--context", type=int, default=1024, help="tokens of text scored, one forward pass (default 1024)")
    @argument("--rounds", type=int, default=3, help="interleaved timing rounds after a warm-up (default 3)")
    @argument("--new-tokens", type=int, default=32, help="decode tokens timed per round (default 32)")
    @argument("--prompt-len", type=int, default=256, help="prefill tokens timed per round (default 256)")
    @argument("-o", dest="output", default=None, help="store the table (a DataFrame) in this variable")
    @line_magic
    def weight_quality(self, line):
        """Every weight format on the loaded model's source, side by side: quality against its
        fp32 weights on real text (KL, top-1 agreement, perplexity), the bytes a batch-1 decode
        step reads, decode tokens/s and prefill ms in interleaved rounds; a table and a Pareto
        figure (bytes per token against KL); the rows join %report. The model is loaded again
        in each format; the loaded model stays as it is.

        Examples::

          In [1]: %weight_quality
          In [2]: %weight_quality --formats fp32,bf16,int8-g32,q4_k,q4_0,int4-g32 --rounds 5 -o wq
          In [3]: %weight_quality --formats file,q8_0,q4_0 --text my_notes.txt --context 512
        """
        from workbench import report
        from workbench.analysis.weight_study import DEFAULT_FORMATS, format_study, study_figure, weight_study
        from workbench.distributed.cluster import DistributedModel
        from workbench.model.loaders import ModelLoadError
        from workbench.ui.plots import show_figure

        args = parse_argstring(self.weight_quality, line)
        model = self._require_model()
        if isinstance(model, DistributedModel):
            raise UsageError("%weight_quality loads the model in this process: %distributed stop first")
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o needs a Python variable name, got {args.output!r}")
        text = _text_file(args.text)
        bar = _Progress("weights", label=str)
        try:
            rows = weight_study(model, args.formats or DEFAULT_FORMATS, context=args.context, text=text,
                                new_tokens=args.new_tokens, prompt_len=args.prompt_len, rounds=args.rounds,
                                progress=bar.update)
        except (ValueError, ModelLoadError) as e:
            raise UsageError(str(e)) from None
        finally:
            bar.close()
        print(f"{rows[0]['model']}: text {args.text or 'the license texts'}, {rows[0]['context']} tokens scored "
              f"against fp32 weights; decode batch 1, {args.new_tokens} tokens, and prefill of {rows[0]['prompt_len']} "
              f"tokens, median (min-max) of {args.rounds} interleaved rounds")
        print(format_study(rows))
        show_figure(study_figure(rows))
        report.record(rows, model, command=self._command("weight_quality", line), kind="weight_quality")
        if args.output:
            self.shell.user_ns[args.output] = _dataframe(rows)

    @magic_arguments()
    @argument("--native", action="store_true", help="native frames too: our C++ kernels by name")
    @argument("--rate", type=int, default=250, help="samples per second (default 250)")
    @argument("--duration", type=float, default=None, help="stop sampling after this many seconds")
    @argument("-o", dest="output", default=None,
              help="speedscope JSON file (default: profile.speedscope.json in the results folder, "
                   "workbench.cache.results_dir())")
    @argument("statement", nargs="*", help="the statement to profile (or the cell body with %%%%profile)")
    @line_cell_magic
    def profile(self, line, cell=None):
        """Profile a statement with py-spy attached to this kernel (and, with a cluster
        running, to its engines): the hottest frames, a flame graph, and the speedscope
        JSON saved (it joins %report). The result is kept as `wb_profile`.

        Examples::

          In [1]: %profile --native model.generate("Hello", max_new_tokens=32)
          In [2]: %%profile --rate 500
             ...: %generate -n 32 The capital of France is
        """
        from workbench import report
        from workbench.analysis.profile import ProfilerUnavailable, flame_spec, profile, report_entry, top_frames_text
        from workbench.ui.plots import show_figure

        args = parse_argstring(self.profile, line)
        code = cell if cell is not None else " ".join(args.statement)
        if not code.strip():
            raise UsageError("%profile needs a statement, e.g. %profile --native model.generate('Hi')")
        cluster = getattr(self.model, "cluster", None)
        pids = {e["rank"]: e["pid"] for e in cluster.engines} if cluster is not None else None
        try:
            result = profile(lambda: self.shell.run_cell(code, silent=False), native=args.native, rate=args.rate,
                             duration=args.duration, out=args.output, engine_pids=pids)
        except (ProfilerUnavailable, ValueError) as e:
            raise UsageError(str(e)) from None
        result.pop("value", None)
        self.shell.user_ns["wb_profile"] = result
        report.add_entry(report_entry(result, code.strip()))
        print(top_frames_text(result))
        for rank, summary in result["engines"].items():
            print(f"\nrank {rank}: {summary['speedscope']}")
            print(top_frames_text(summary))
        show_figure(flame_spec(result["stacks"], title=f"py-spy: {code.strip()[:80]}"))
        print(f"speedscope JSON: {result['speedscope']} (open it at speedscope.app)")

    @magic_arguments()
    @argument("--panel", action="store_true", help="show the control panel with live plots")
    @line_magic
    def workbench(self, line):
        """What is loaded, the switches, the kernels' ISA path, the machine's measured peaks;
        with --panel, the control panel (workbench.panel()) for the loaded model.

        Examples::

          In [1]: %workbench
          In [2]: %workbench --panel
        """
        args = parse_argstring(self.workbench, line)
        if args.panel:
            import workbench as wb
            from IPython.display import display

            p = wb.panel()  # follows the session: the model loaded now or later
            display(p)
            return
        from workbench.runtime.status import status_report

        print(status_report(self.model))

    @magic_arguments()
    @argument("action", choices=["start", "stop", "status"], help="start a server on the loaded model, stop it, "
              "or say what runs")
    @argument("--port", type=int, default=None, help="default: 8000 where it is free, else a free port (said)")
    @argument("--slots", type=int, default=8, help="sequences decoded together at most")
    @argument("--max-len", type=int, default=None, help="tokens per sequence (default min(context, 2048))")
    @argument("--chunk", type=int, default=256, help="prompt tokens prefilled per scheduler step")
    @argument("--prefix-cache-tokens", type=int, default=0, help="prompt-prefix reuse budget (0: off)")
    @argument("--max-queue", type=int, default=256, help="waiting requests at most; beyond, 429")
    @line_magic
    def serve(self, line):
        """An OpenAI-compatible server (`workbench serve`) on the loaded model, as a process of
        its own on 127.0.0.1, with the model's KV cache switch; %serve_bench loads it.

        Examples::

          In [1]: %serve start --slots 8 --prefix-cache-tokens 8192
          In [2]: %serve_bench --rate 1,2,4 --slo-ttft 1s -o sb
          In [3]: %serve stop
        """
        from workbench.serving.process import ServerProcess, default_port, server_args

        args = parse_argstring(self.serve, line)
        running = getattr(self, "_server", None)
        if args.action == "status":
            print(f"serving at {running.url}: {running.shell_command}" if running and running.running else
                  "no server running (%serve start)")
            return
        if args.action == "stop":
            if running is None:
                raise UsageError("no server running (%serve start)")
            running.stop()
            self._server = None
            print(f"server at {running.url} stopped")
            return
        if running is not None and running.running:
            raise UsageError(f"a server already runs at {running.url} (%serve stop first)")
        model = self._require_model()
        if getattr(model, "cluster", None) is not None:
            raise UsageError("%serve runs one process; stop the cluster first (%distributed stop)")
        options = server_args(model, slots=args.slots, chunk=args.chunk, prefix_cache_tokens=args.prefix_cache_tokens,
                              max_queue=args.max_queue, max_len=args.max_len)
        port, moved = (args.port, None) if args.port is not None else default_port()
        server = ServerProcess(options, port=port)
        try:
            server.start()
        except RuntimeError as e:
            raise UsageError(str(e)) from None
        self._server, self._serve_line = server, line
        self.shell.user_ns["wb_server_url"] = server.url
        print(f"serving at {server.url} (wb_server_url){f' ({moved})' if moved else ''}: {server.shell_command}")

    @magic_arguments()
    @argument("--url", default=None, help="the server (default: the one %%serve started)")
    @magic_options(SERVE_BENCH_OPTIONS)
    @argument("-o", "--out", default=None, help="store the rows as a DataFrame in this variable")
    @line_magic
    def serve_bench(self, line):
        """Load an OpenAI-compatible server and print TTFT / TPOT / ITL percentiles, tokens/s
        and goodput per load (workbench.analysis.serve_bench); a sweep of rates draws the
        latency-throughput curve.

        Examples::

          In [1]: %serve_bench --concurrency 8 --num-requests 32
          In [2]: %serve_bench --rate 1,2,4 --slo-ttft 1s --slo-tpot 100ms -o sb
          In [3]: %serve_bench --rate 2 --range-ratio 0.5 --prompts-file prompts.jsonl
        """
        from workbench.analysis.serve_bench import format_rows, serve_bench

        args = parse_argstring(self.serve_bench, line)
        if args.out and not args.out.isidentifier():
            raise UsageError(f"-o needs a variable name, got {args.out!r}")
        server = getattr(self, "_server", None)
        url = args.url or (server.url if server is not None and server.running else None)
        if url is None:
            raise UsageError("no server to load: %serve start, or --url http://host:port")
        try:
            rows = serve_bench(url, rates=args.rate, concurrency=args.concurrency, num_requests=args.num_requests,
                               prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                               shared_prefix_tokens=args.shared_prefix_tokens, shared_fraction=args.shared_fraction,
                               burstiness=args.burstiness, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                               range_ratio=args.range_ratio, prompts_file=args.prompts_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
        from workbench import report
        from workbench.ui.plots import knee_spec, show_figure

        # loaded the server %serve started: its start and stop reproduce it too
        command = self._command("serve_bench", line, serve_line=None if args.url else self._serve_line)
        report.record(rows, kind="serve_bench", command=command)
        print(format_rows(rows))
        if len(rows) > 1:  # a sweep: the latency-throughput curve
            show_figure(knee_spec(rows))
        if args.out:
            self.shell.user_ns[args.out] = _dataframe(rows)


def _handoff_said(shard: dict, hands_off: bool) -> str:
    """A KV head a rank shares with a neighbour (shard.py), and who computes it: with the handoff
    (shm, kv_handoff on) the later rank, for both; otherwise each rank itself."""
    send, recv = shard["kv_handoff"]
    (lo, hi), rank = shard["kv_heads"], shard["rank"]
    said = []
    if send:
        said.append(f"KV head {lo} shared with rank {rank - 1}: "
                    + ("computed here and handed over" if hands_off else "computed by both"))
    if recv:
        said.append(f"KV head {hi - 1} shared with rank {rank + 1}: "
                    + ("taken from it" if hands_off else "computed by both"))
    return f" ({'; '.join(said)})" if said else ""


def _cluster_status(cluster) -> str:
    if cluster is None:
        return "no cluster running (%distributed start -n 2 --backend shm)"
    st = cluster.status()
    lines = [repr(cluster), f"launcher {st['launcher']}, collective timeout {st['timeout_s']} s, "
                            f"backend settings {st['environment']}"]
    lines += [f"rank {e['rank']}: pid {e['pid']} on {e['host']}, {e['threads']} thread(s), cpus {e['cpus']}, "
              f"NUMA node(s) {e['nodes']}, memory policy {e['memory_policy']}" for e in st["engines"]]
    if cluster.model is not None:
        from workbench.distributed.backends import backend

        lines.append(repr(cluster.model))
        hands_off = backend(cluster.backend).fused_kv_handoff and cluster.model.options.kv_handoff
        lines += [f"rank {sh['rank']}: KV heads {sh['kv_heads']}{_handoff_said(sh, hands_off)}, query heads {sh['q_heads']}, "
                  f"FFN {sh['ffn']}, vocabulary {sh['vocab']}, {sh['weight_bytes'] / 2**20:.0f} MiB of weights"
                  for sh in cluster.model.shards]
    return "\n".join(lines)


def _text_file(name: str | None) -> str | None:
    """--text's file read (None: the default text), a UsageError naming a missing one."""
    from pathlib import Path

    if not name:
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        raise UsageError(f"--text: no such file: {path}")
    return path.read_text(errors="replace")


def _dataframe(rows: list[dict]):
    try:
        import pandas as pd
    except ImportError:  # pandas is a dependency; this keeps the magic usable without it
        return rows
    return pd.DataFrame(rows)


def _ablation_label(row) -> str:
    return f"{row.attention} {kv_label(row.kv_cache, row.kv_kernel)} len {row.prompt_len} batch {row.batch}"


class _Progress:
    """An ipywidgets progress bar where a widget frontend exists, else a text line;
    update(done, total, item) with label(item) the line's text (default: item as it is)."""

    def __init__(self, description: str = "ablate", label=_ablation_label):
        self.bar, self.label = None, label
        try:
            import ipywidgets
            from IPython.display import display

            self.bar = ipywidgets.IntProgress(value=0, min=0, max=1, description=description)
            display(self.bar)
        except ImportError:
            pass

    def update(self, done: int, total: int, item) -> None:
        if self.bar is not None:
            self.bar.max, self.bar.value = total, done
            self.bar.description = f"{done}/{total}"
        else:
            sys.stdout.write(f"\r{done}/{total} {self.label(item)}   ")
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is None:
            sys.stdout.write("\n")


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(WorkbenchMagics)
