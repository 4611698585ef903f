"""Command-line options that the `workbench` command and the IPython magics share: defined
once here as (flags, argparse keyword arguments), added to an argparse parser by
`add_options` or to a magic by `magic_options` (IPython's @argument takes the same
arguments as argparse's add_argument).

The choices come from the registries, so a new attention backend, KV format or weight
dtype shows up in every --help by itself.
"""

from __future__ import annotations

from workbench.model.attention import ATTENTION_BACKENDS
from workbench.model.kv_formats import KV_FORMATS, KV_KERNELS
from workbench.model.switches import STEP_PATHS
from workbench.model.weights import AS_FILE, WEIGHT_FORMATS

Option = tuple[tuple[str, ...], dict]

# Loading a model (the model's name or path is a positional argument of each command).
LOAD_OPTIONS: list[Option] = [
    (("--random",), dict(action="store_true", help="the preset's exact shapes with seeded random weights")),
    (("--layers",), dict(type=int, default=None, help="keep only the first N layers")),
    (("--dtype",), dict(default=None, choices=[*WEIGHT_FORMATS, AS_FILE],
                        help=f"weight format every matrix is converted to (default: a GGUF file's own formats, "
                             f"'{AS_FILE}'; fp32 for other models)")),
]

# One generation. --attention / --kv-cache default to the model's current switches.
GENERATE_OPTIONS: list[Option] = [
    (("--max-new-tokens", "-n"), dict(type=int, default=32, help="tokens to generate (default 32)")),
    (("--attention",), dict(choices=list(ATTENTION_BACKENDS), default=None,
                            help="attention backend for this run (default: the current switch)")),
    (("--kv-cache",), dict(choices=list(KV_FORMATS), default=None,
                           help="KV-cache format for this run (default: the current switch)")),
    (("--kv-kernel",), dict(choices=list(KV_KERNELS), default=None,
                            help="the kernel that reads the KV cache (default: the format's fastest)")),
    (("--step",), dict(choices=list(STEP_PATHS), default=None,
                       help="decode step path: fused (one C++ call per step) or reference (default: the current "
                            "switch)")),
    (("--temperature",), dict(type=float, default=0.0, help="0 is greedy (default)")),
    (("--top-k",), dict(type=int, default=None)),
    (("--top-p",), dict(type=float, default=None)),
    (("--seed",), dict(type=int, default=0, help="sampling seed")),
    (("--chat",), dict(action="store_true", help="wrap the prompt in the model's chat template")),
    (("--ignore-eos",), dict(action="store_true",
                             help="generate all --max-new-tokens even past end-of-sequence (timed runs, fault tests)")),
]



def add_options(parser, options: list[Option]) -> None:
    for flags, kwargs in options:
        parser.add_argument(*flags, **kwargs)


def magic_options(options: list[Option]):
    """A decorator adding `options` to a magic defined with IPython's @magic_arguments()."""
    from IPython.core.magic_arguments import argument

    def decorate(func):
        for flags, kwargs in reversed(options):  # decorators apply bottom up; keep the listed order
            func = argument(*flags, **kwargs)(func)
        return func

    return decorate


def generate_kwargs(args) -> dict:
    """The keyword arguments of Model.generate from parsed GENERATE_OPTIONS."""
    return dict(max_new_tokens=args.max_new_tokens, attention=args.attention, kv_cache=args.kv_cache,
                kv_kernel=args.kv_kernel, step=args.step, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop_at_eos=not args.ignore_eos)


def chat_prompt(model, prompt: str, chat: bool) -> str:
    """The prompt, wrapped in the model's chat template with --chat (ValueError if it has none)."""
    return model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt


def parse_duration(text: str) -> float:
    """Seconds from '1s', '250ms' or a plain number of seconds (the SLO options)."""
    import argparse

    text = str(text).strip()
    try:
        seconds = (float(text[:-2]) / 1e3 if text.endswith("ms") else float(text[:-1]) if text.endswith("s")
                   else float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration such as 1s or 100ms, got {text!r}") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be > 0, got {text!r}")
    return seconds


def parse_rates(text: str) -> list[float | None]:
    """--rate: requests/s, comma-separated for a sweep, `max` for all at once under the
    concurrency (None); an argparse type, so a mistake is one line naming the option."""
    import argparse

    rates = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            rate = None if item == "max" else float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rate takes requests/s or max, comma-separated; got {text!r}") from None
        if rate is not None and not rate > 0:
            raise argparse.ArgumentTypeError(f"--rate values must be > 0 (or max), got {text!r}")
        rates.append(rate)
    return rates


def _serve_bench_default(name: str):
    """A serve_bench() keyword's default: the function's signature is where it is defined."""
    import inspect

    from workbench.analysis.serve_bench import serve_bench

    return inspect.signature(serve_bench).parameters[name].default


# Loading a server (`workbench serve-bench`, %serve_bench): the load and the requests. Each
# default is serve_bench()'s own and is said in the help. (argparse reads a help string as a
# %-format: a literal percent sign is written %%.)
SERVE_BENCH_OPTIONS: list[Option] = [
    (("--rate",), dict(type=parse_rates, default="max", help="requests/s, comma-separated for a sweep; max: all at "
                                                             "once under --concurrency (default max)")),
    (("--concurrency",), dict(type=int, default=_serve_bench_default("concurrency"),
                              help="requests in flight at most with --rate max (default %(default)s)")),
    (("--burstiness",), dict(type=float, default=_serve_bench_default("burstiness"),
                             help="gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier "
                                  "(default %(default)s)")),
    (("--num-requests",), dict(type=int, default=_serve_bench_default("num_requests"),
                               help="requests at each rate (default %(default)s)")),
    (("--prompt-tokens",), dict(type=int, default=_serve_bench_default("prompt_tokens"),
                                help="words of synthetic prompt, about one token each (default %(default)s)")),
    (("--max-tokens",), dict(type=int, default=_serve_bench_default("max_tokens"),
                             help="tokens each request asks for, past end-of-sequence (default %(default)s)")),
    (("--shared-prefix-tokens",), dict(type=int, default=_serve_bench_default("shared_prefix_tokens"),
                                       help="words of a prefix some prompts share (default %(default)s: none)")),
    (("--shared-fraction",), dict(type=float, default=_serve_bench_default("shared_fraction"),
                                  help="share of prompts starting with the shared prefix (default %(default)s)")),
    (("--range-ratio",), dict(type=float, default=_serve_bench_default("range_ratio"),
                              help="prompt and output lengths drawn uniformly within this fraction of "
                                   "--prompt-tokens and --max-tokens (default %(default)s: all alike)")),
    (("--prompts-file",), dict(default=None, help="prompts from a file: one a line, or JSON lines with prompt (and "
                                                  "max_tokens) if it ends in .jsonl; taken in order")),
    (("--slo-ttft",), dict(type=parse_duration, default=None,
                           help="time-to-first-token objective for goodput, e.g. 1s (default: none)")),
    (("--slo-tpot",), dict(type=parse_duration, default=None,
                           help="time-per-output-token objective for goodput, e.g. 100ms (default: none)")),
]
