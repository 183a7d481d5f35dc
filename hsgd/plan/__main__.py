"""python -m hsgd.plan: which layout, will it fit, how fast.

    python -m hsgd.plan --model narayanan-145.6b --batch 2304 --devices 1536 --hw a100-80g
    python -m hsgd.plan --model L=96,C=12288,NH=96,F=49152,V=51200,T=2048 --batch 1536 --devices 1024 --hw h100-80g
    python -m hsgd.plan --model hsgd-default --batch 32 --devices 8 --hw this-machine --impl hsgd --dtype float32
    python -m hsgd.plan --model llama3-405b --batch 2048 --devices 8192 --hw h100-80g --tp 8 --pp 16
    python -m hsgd.plan --model mixtral-8x7b,T=4096 --batch 512 --devices 64 --hw h100-80g --tp 1,2,4 --pp 1,2,4
    python -m hsgd.plan --model llama3-8b --moe-experts 8 --moe-top-k 2 --batch 256 --devices 32 --hw h100-80g
    python -m hsgd.plan --model narayanan-1.7b --batch 512 --devices 32 --pp 4 --schedule 1f1b,zb-v,dualpipev,dualpipe
    mpirun -n 8 python -m hsgd.plan --calibrate --out my-machine.toml          # measure this machine

It enumerates every dp x pp x tp (x cp, chunks per stage, ZeRO stage, sequence parallelism, recomputation,
micro-batch size, schedule; for a mixture-of-experts model ep, the ranks of dp x cp that split its experts) that the
model allows on the devices, drops what does not fit in a device's memory,
and prints the fastest N with memory per device by category, bytes per step on each communicator and link, and
the predicted step time split into compute, elementwise, exposed tensor-parallel, pipeline (bubble and
transfers), data-parallel and context-parallel communication, with tokens/s and MFU; memory in GiB, a layout
fitting in what --headroom leaves; with --impl megatron, the best layout's Megatron-LM flags and torchtitan keys
(hsgd.plan.flags). --model gives the family too (hsgd.plan.models: GQA, SwiGLU, RMSNorm, RoPE; Llama 3 presets);
--moe-experts makes its MLPs mixtures of experts (hsgd.plan.experts: total and active parameters, each rank's E/ep
experts, the all-to-all on the link its ep group crosses; Mixtral's preset has them).
--explain prints every term of the best layouts as its formula with the numbers in; --json writes everything.
The model of time, memory and bytes is in hsgd.plan.costs, hsgd.plan.layout and hsgd.plan.paper.
"""
import argparse
import dataclasses
import json
import sys

from hsgd import cli
from hsgd.cli import Parser
from hsgd.errors import ConfigError, UsageError
from hsgd.files import writable_file
from hsgd.readers import printable
from . import flags
from .experts import param_counts
from .family import is_gpt2
from .hardware import load, names
from .models import parse_model, presets
from .search import CP_SCHEMES, HEADROOM, SCHEDULES, check_search, rank_key, rate_of, search


class PlanError(UsageError):
    """Input the planner cannot use; the message says what to change."""


def int_list(name, low=1, high=None):
    """argparse type: integers separated by commas, each in [low, high]."""
    def parse(text):
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes integers separated by commas, e.g. 1,2,4,8") from None
        bad = [v for v in vals if v < low or (high is not None and v > high)]
        if bad:
            allowed = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"{name} {bad[0]}: give integers {allowed}")
        return vals
    return parse


def positive(name, low=1):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes an integer, e.g. 8") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} {v}: give an integer of at least {low}")
        return v
    return parse


def number(name):
    def parse(text):
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, e.g. 1.25") from None
    return parse


def choice_list(name, allowed):
    def parse(text):
        vals = text.split(",")
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{name}: {bad[0]!r} is not one of {', '.join(allowed)}")
        return vals
    return parse


def build_parser():
    ap = Parser(prog="python -m hsgd.plan", description=__doc__.split("\n\n")[2],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="presets: " + ", ".join(presets()) + "\nhardware: " + ", ".join(names()))
    ap.add_argument("--model", default="hsgd-default",
                    help="a preset (below), a preset and keys (llama3-70b,T=4096) or keys L=..,C=..,NH=..[,F=..,V=..,"
                         "T=..,NKV=..,arch=gpt2|llama,norm=layernorm|rmsnorm,pos=learned|rope,mlp=gelu|swiglu,"
                         "bias=yes|no,tied=yes|no] (F = 4C, V = 256, T = 64 unless given; the rest arch's); default "
                         "hsgd-default")
    ap.add_argument("--batch", type=positive("--batch"), default=32, help="global batch in sequences (default 32)")
    ap.add_argument("--devices", type=positive("--devices"), default=8, help="devices (ranks) in all; default 8")
    ap.add_argument("--hw", default="a100-80g", help="a shipped hardware name or a TOML file (default a100-80g)")
    ap.add_argument("--impl", choices=("megatron", "hsgd"), default="megatron",
                    help="megatron: a mixed-precision run with Adam, memory from the published formulas (default); "
                         "hsgd: this implementation's memory and bytes, exactly as hsgd.train measures them")
    ap.add_argument("--dtype", default=None, choices=("float64", "float32", "bfloat16", "float16"),
                    help="compute precision (default bfloat16 with --impl megatron, float32 with --impl hsgd)")
    ap.add_argument("--attention", choices=("flash", "materialized"), default=None,
                    help="flash: no stored T x T scores, as production runs use (default with --impl megatron); "
                         "materialized: the scores, softmax and dropout kept, Korthikanti et al. 2022's 5 a s^2 b "
                         "(default with --impl hsgd, which keeps the softmax)")
    ap.add_argument("--headroom", type=float, default=HEADROOM,
                    help=f"fraction of a device's memory kept free for the CUDA context, communication buffers and "
                         f"fragmentation (default {HEADROOM:g}); a layout fits in the rest")
    ap.add_argument("--efficiency", type=float, default=None,
                    help="fraction of the matmul peak reached (default: the hardware file's, else 0.5)")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw", help="--impl hsgd: its state")
    e = ap.add_argument_group("mixture of experts (hsgd.model.config.ModelConfig's fields; default: --model's)")
    e.add_argument("--moe-experts", type=positive("--moe-experts", 0), metavar="E",
                   help="experts in place of the MLP of every MoE block (0: dense); the planner prints total and "
                        "active parameters and searches ep, each rank holding E/ep experts of each MoE block")
    e.add_argument("--moe-top-k", type=positive("--moe-top-k"), metavar="k", help="experts per token (default 2)")
    e.add_argument("--moe-every", type=positive("--moe-every"), metavar="n",
                   help="the MoE blocks are 0, n, 2n, ... (default 1: every block)")
    e.add_argument("--moe-capacity-factor", type=number("--moe-capacity-factor"), metavar="c",
                   help="slots per expert ceil(c N k / E) (default none: nothing dropped); the planner prices "
                        "uniform routing, in which nothing is dropped for c >= 1")
    g = ap.add_argument_group("the search space (default: every value that applies)")
    g.add_argument("--tp", type=int_list("--tp"), help="e.g. 1,2,4,8")
    g.add_argument("--pp", type=int_list("--pp"))
    g.add_argument("--cp", type=int_list("--cp"), help="default 1 (no context parallelism)")
    g.add_argument("--cp-scheme", type=choice_list("--cp-scheme", CP_SCHEMES), metavar="LIST",
                   help=f"context-parallel schemes to price where cp > 1, from {', '.join(CP_SCHEMES)} (default all; "
                        "ulysses only where cp divides each tp rank's heads)")
    g.add_argument("--ep", type=int_list("--ep"), help="expert-parallel sizes, MoE models only (default: every one "
                                                        "that divides dp x cp and the experts)")
    g.add_argument("--zero", type=int_list("--zero", 0, 3), help="ZeRO stages, e.g. 0,1")
    g.add_argument("--recompute", type=choice_list("--recompute", ("none", "selective", "full")))
    g.add_argument("--sp", choices=("yes", "no", "both"), default="both", help="sequence parallelism")
    g.add_argument("--micro-batch", type=int_list("--micro-batch"), help="sequences per micro-batch, e.g. 1,2,4")
    g.add_argument("--schedule", type=choice_list("--schedule", SCHEDULES),
                   help=f"from {', '.join(SCHEDULES)} (default 1f1b,interleaved); zb-v, dualpipev and dualpipe only "
                        "where they apply (ZeRO 0 or 1; dualpipev m >= 2 pp; dualpipe an even pp and m >= 2 pp, "
                        "dense models), with 2 chunks a stage")
    g.add_argument("--virtual", type=int_list("--virtual"),
                   help="chunks per stage for interleaved (default 2; zb-v, dualpipev and dualpipe: always 2)")
    g.add_argument("--overlap", action="store_true", help="also try --dp-overlap (bucketed, during the backward)")
    g.add_argument("--hierarchical", action="store_true",
                   help="also try the hierarchical exchange (within the node, then across: hsgd.dp.hierarchical)")
    o = ap.add_argument_group("output")
    o.add_argument("--top", type=positive("--top"), default=5, help="how many layouts to print (default 5)")
    o.add_argument("--explain", action="store_true", help="every term of the printed layouts as its formula")
    o.add_argument("--json", metavar="FILE", help="write every fitting layout's numbers as JSON")
    c = ap.add_argument_group("calibration (under mpirun)")
    c.add_argument("--calibrate", action="store_true", help="measure this machine and write --out")
    c.add_argument("--out", help="--calibrate: the hardware file to write")
    c.add_argument("--quick", action="store_true", help="--calibrate: fewer sizes and repetitions")
    return ap


def gb(x):
    """Bytes in GiB (2^30 bytes), the unit devices are sold in: an "80 GB" GPU holds 80 GiB."""
    return f"{x / 2**30:.2f} GiB"


def fmt_t(t):
    return f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.2f} s"


def space_of(args, attention):
    space = {"attention": [attention], "tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep, "zero": args.zero,
             "recompute": args.recompute,
             "b": args.micro_batch, "schedule": args.schedule, "v": args.virtual, "cp_scheme": args.cp_scheme,
             "dp_overlap": [False, True] if args.overlap else None,
             "hierarchical": [False, True] if args.hierarchical else None}
    if args.sp != "both":
        space["tp_scheme"] = ["sequence" if args.sp == "yes" else "megatron"]
    return space


def report(e, say, explain):
    """One layout's numbers: memory, bytes, links, time."""
    t = e.time
    if e.memory is not None:
        say(f"    memory of the fullest device (stage {e.stage}): " + ", ".join(
            f"{k} {gb(v)}" for k, v in e.memory.items() if v) + f"; total {gb(sum(e.memory.values()))}")
    say("    bytes per step, stage 0: " + ", ".join(f"{c} {op} {n} x {gb(b / max(n, 1))}"
                                                  for (c, op), (n, b) in sorted(e.bytes[0].items())))
    say("    per link: " + ", ".join(f"{k} {gb(v)}" for k, v in e.links.items()))
    total = t.total
    say("    time " + fmt_t(total) + ": " + ", ".join(f"{k} {fmt_t(v)} ({v / total:.0%})"
                                                      for k, v in t.parts().items() if v > 0))
    if explain:
        for term, text in t.terms:
            say(f"      [{term}] {text}")


def to_json(e):
    return {"layout": e.layout.__dict__ | {"name": e.layout.name()}, "memory": e.memory, "stage": e.stage,
            "fits": e.fits, "bytes": {str(s): {f"{c} {op}": list(v) for (c, op), v in b.items()}
                                      for s, b in e.bytes.items()},
            "links": e.links, "time": e.time.parts() | {"total": e.time.total}, "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu, "tflops_per_device": e.tflops}


def check_options(args):
    """Refuse the options no search can use (PlanError, one line); returns the attention to price: --attention, or
    flash for --impl megatron and materialized for hsgd."""
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise PlanError(f"--efficiency {args.efficiency} must be in (0, 1], e.g. 0.5")
    if not 0 <= args.headroom < 1:
        raise PlanError(f"--headroom {args.headroom} must be in [0, 1): the fraction of memory kept free, e.g. 0.1")
    attention = args.attention or ("flash" if args.impl == "megatron" else "materialized")
    if args.impl == "hsgd" and attention == "flash":
        raise PlanError("--impl hsgd prices hsgd.train's memory, whose attention keeps its softmax; use --attention "
                        "materialized, or --impl megatron for flash attention")
    return attention


def model_of(args):
    """--model, with the mixture-of-experts flags that were given in place of its fields; PlanError (one line) for
    what ModelConfig refuses, for expert flags or --ep without experts, and for --impl hsgd with experts."""
    cfg = parse_model(args.model)
    given = {f: getattr(args, f) for f in ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor")
             if getattr(args, f) is not None}
    try:
        cfg = dataclasses.replace(cfg, **given)
    except ConfigError as err:
        raise PlanError(f"--model {args.model!r} with the expert flags: {err}") from None
    extra = ["--" + f.replace("_", "-") for f in given if f != "moe_experts"] + (["--ep"] if args.ep else [])
    if not cfg.moe_experts and extra:
        raise PlanError(f"{', '.join(extra)}: the model has no experts; add --moe-experts E (e.g. 8), or drop "
                        f"{'them' if len(extra) > 1 else 'it'} for a dense model")
    if cfg.moe_experts and args.impl == "hsgd":
        raise PlanError("--impl hsgd prices hsgd.train's own accounting, which has no experts yet; use --impl "
                        "megatron for a mixture-of-experts model")
    return cfg


def nothing_found(cfg, args, tried, usable, memory, attention):
    """The PlanError when no layout is left: none splits the model (tried = 0), or none fits in `usable` bytes."""
    batch = args.batch
    if not tried:
        cp = (f", seq_len={cfg.seq_len} divide by 2 cp (and by tp cp with sequence parallelism)"
              if args.cp and max(args.cp) > 1 else "")
        if cp and args.cp_scheme == ["ulysses"]:
            cp += (f", and cp divide each tp rank's query and kv heads (n_heads={cfg.n_heads}, "
                   f"n_kv_heads={cfg.n_kv_heads} over tp: --cp-scheme ulysses)")
        kv = f", and divide n_kv_heads={cfg.n_kv_heads} or be a multiple of it" if cfg.n_kv_heads < cfg.n_heads \
            else ""
        kv += f", ep divide dp x cp and E={cfg.moe_experts}" if args.ep else ""
        return PlanError(f"no layout of {args.devices} devices splits this model and batch {batch}: tp must divide "
                         f"n_heads={cfg.n_heads} and d_ff={cfg.d_ff}{kv}, dp the batch, pp <= L={cfg.n_layers}"
                         f"{cp}; change --devices or --batch, or widen --tp/--pp" + ("/--cp" if cp else "")
                         + ("/--ep" if args.ep else ""))
    return PlanError(f"nothing fits in {gb(usable)} per device ({gb(memory)} less {args.headroom:.0%} headroom; "
                     f"{tried} layouts tried): use more devices, a smaller --batch or --micro-batch 1, or allow "
                     "--zero 1,2,3 and --recompute full" + (", or --attention flash" if attention != "flash" else "")
                     + (", or a larger --ep" if args.ep else ""))


def say_flags(cfg, layout, batch, dtype, say):
    """The flags of Megatron-LM and the keys of torchtitan that set up `layout` (hsgd.plan.flags)."""
    say(f"\nto run layout 1 ({layout.name()}) with Megatron-LM:")
    for line in flags.megatron(cfg, layout, batch, dtype):
        say("    " + line)
    say("with torchtitan (its TOML job file):")
    for line in flags.torchtitan(cfg, layout, batch):
        say("    " + line)


def plan(args, say=print):
    """The planner's work for parsed args; returns the exit code."""
    cfg = model_of(args)
    hw = load(args.hw)
    dtype = args.dtype or ("float32" if args.impl == "hsgd" else "bfloat16")
    batch = args.batch
    check_search(cfg, batch, args.devices)                             # the stated maxima, before any work
    attention = check_options(args)
    if args.json:
        writable_file(args.json, "--json", PlanError)
    eff = args.efficiency if args.efficiency is not None else (hw.efficiency or 0.5)
    rate = rate_of(hw, dtype, eff)
    total, active = param_counts(cfg)
    say(f"model: L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} V={cfg.vocab_size} "
        f"T={cfg.seq_len}, {total / 1e9:.4g} B parameters" + (f" ({active / 1e9:.4g} B active per token)" if
                                                               cfg.moe_experts else "")
        + f", {cfg.step_flops(batch) / 1e12:.4g} TFLOP per step of {batch} sequences (without recomputation)")
    if not is_gpt2(cfg) or cfg.arch != "gpt2":
        say(f"family: {cfg.describe_family()}")
    if cfg.moe_experts:
        say(f"experts: {len(cfg.moe_layers())} MoE blocks of {cfg.moe_experts} experts; ep tried: "
            + (",".join(map(str, args.ep)) if args.ep else "every divisor of dp x cp that divides E")
            + "; uniform routing, nothing dropped; the all-to-all on the link its ep group crosses")
    where = args.hw if args.hw in names() else hw.source
    say(f"hardware: {printable(hw.name)} ({printable(where)}); {args.devices} devices, {hw.devices_per_node} per "
        f"node, {gb(hw.memory_bytes)} each; matmuls at {rate / 1e12:.4g} TFLOP/s in {dtype}"
        + ("" if dtype in hw.measured_matmul else f" (peak x efficiency {eff:g})") + f"; implementation {args.impl}")
    usable = (1 - args.headroom) * hw.memory_bytes
    say(f"memory: a layout fits in {gb(usable)} per device ({args.headroom:.0%} of {gb(hw.memory_bytes)} kept free, "
        f"--headroom); attention {attention}" + (" (no stored scores)" if attention == "flash" else
                                                  " (the scores stored)"))
    progress = (lambda i, n: say(f"  ... {i} of {n} layouts priced", flush=True)) if args.devices > 64 else None
    space = dict(space_of(args, attention), node_ranks=hw.devices_per_node)
    found, tried, dropped = search(cfg, batch, args.devices, hw, space, args.impl, dtype, eff,
                                   progress=progress, headroom=args.headroom)
    say(f"{tried} layouts allowed by the model; {len(found)} fit" + (
        "; dropped: " + "; ".join(f"{n} x {why}" for why, n in sorted(dropped.items(), key=lambda x: -x[1])[:4])
        if dropped else ""))
    if not found:
        raise nothing_found(cfg, args, tried, usable, hw.memory_bytes, attention)
    from .search import evaluate                       # the printed ones priced again, with the simulator
    shown = sorted((evaluate(cfg, batch, e.layout, hw, args.impl, dtype, eff, explain=args.explain,
                             optimizer=args.optimizer, headroom=args.headroom) for e in found[:args.top]),
                   key=rank_key)
    say(f"\n{'#':>3} {'layout':<62} {'memory':>10} {'step':>10} {'tokens/s':>11} {'MFU':>6} {'TFLOP/s/dev':>11}")
    for i, e in enumerate(shown):
        mem = gb(sum(e.memory.values())) if e.memory is not None else "n/a"
        say(f"{i + 1:>3} {e.layout.name():<62} {mem:>10} {fmt_t(e.time.total):>10} {e.tokens_per_s:>11,.0f} "
            f"{e.mfu:>6.1%} {e.tflops:>11.1f}")
    for i, e in enumerate(shown):
        say(f"\n{i + 1}. {e.layout.name()}")
        report(e, say, args.explain)
    if args.impl == "megatron":
        say_flags(cfg, shown[0].layout, batch, dtype, say)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": cfg.__dict__, "batch": batch, "devices": args.devices, "hardware": hw.name,
                       "impl": args.impl, "dtype": dtype, "efficiency": eff, "tried": tried,
                       "attention": attention, "headroom": args.headroom, "usable_bytes": usable,
                       "layouts": [to_json(e) for e in shown + found[args.top:]]}, f, indent=1)
        say(f"\nwrote {len(found)} layouts to {args.json}")
    return 0


def main(argv=None):
    """The exit code of python -m hsgd.plan argv: 0, or 2 with one line for a usage error (hsgd.cli)."""
    return cli.run(lambda: command(build_parser().parse_args(argv)))


def command(args):
    if args.calibrate:
        if not args.out:
            raise PlanError("--calibrate needs --out FILE (the hardware file to write), e.g. "
                            "mpirun -n 8 python -m hsgd.plan --calibrate --out my-machine.toml")
        from .calibrate import main as calibrate_main
        return calibrate_main(["--out", args.out] + (["--quick"] if args.quick else []))
    return plan(args, lambda *a, **k: print(*a, flush=True))


if __name__ == "__main__":
    sys.exit(main())
