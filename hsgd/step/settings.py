"""The training run's settings: grouped dataclasses whose fields are the flags of hsgd.train and hsgd.verify.

A run uses P = dp x pp x cp x tp MPI ranks: dp data-parallel replicas (the lecture's G groups), each a pipeline of
pp stages, each stage split over tp tensor-parallel ranks (the lecture's M workers per group), and with context
parallelism over cp ranks that hold T/cp positions of every sequence each (hsgd.cp.split). TrainConfig is one
flat object (tc.tp, tc.lr, tc.micro_batches) whose fields come from the groups by plain dataclass inheritance:

    Layout        the dp x pp x cp x tp grid, how the tp and cp ranks split the model and the sequence, the
                  pipeline's schedule and micro-batches
    Optimization  steps, the batch, the optimizer and its hyperparameters, the seed
    Data          the text, the floating-point type, the device, BLAS threads
    Output        progress lines, validation losses, the sample, the JSON log, the trace and the plots
    Checkpoints   saving and resuming, a non-finite loss, the replica check
    Exchange      how the gradients cross dp_comm: all-reduce, overlapped, ZeRO, hierarchical or one step late
    Memory        activation recomputation, and measuring every byte of a step
    Experiments   faults and stragglers, on purpose (hsgd.step.experiments)

Every field is made with config.flag(default, help_text, ...), and hsgd.run.flags turns the fields into the command
lines of hsgd.train, hsgd.verify and the schedule lab (and reads --config FILE.toml), so that a default and its
help are written once. Each group checks its own values (TrainConfig.validate); hsgd.run.flags.configs_from_args adds
what needs the model and the world size. Errors name the field, the value and what would work.
"""
import math
import os
from dataclasses import dataclass, fields

from hsgd.tp import model as tp_model, schemes as tp_schemes
from hsgd.model.backend import resolve_device, resolve_dtype
from hsgd.model.config import check_at_most, check_nonnegative_int, check_positive_int, flag
from hsgd.cp.split import CP_SCHEMES
from hsgd.tp.attention import ATTENTIONS
from hsgd.errors import ConfigError
from hsgd.fp8.scaling import Fp8Settings
from hsgd.grid.process_grid import check_sizes
from hsgd.pp.schedules import SCHEDULES, TWO_CHUNKS
from hsgd.step.experiments import Experiments

MAX_RANKS = 2**20            # ranks in a job, and so each of dp, pp, cp, tp (the largest machines have ~10^5 devices)
MAX_SAMPLE_BYTES = 2**20     # bytes of the sample: each is a forward pass
MAX_EVAL_BATCHES = 2**20     # batches of one validation loss: each is a forward pass of the whole batch


@dataclass
class Layout:
    """The P = dp x pp x cp x tp grid of ranks, how the tp ranks split the model and the cp ranks the sequence, and
    the pipeline's micro-batches."""

    tp: int = flag(None, "tensor-parallel size: the ranks that split every layer of a stage between them (each of "
                         f"tp, dp, pp, cp and their product, the ranks, at most {MAX_RANKS})",
                   shown="2 when the ranks per stage are even, else 1")
    dp: int = flag(None, "data-parallel size: model replicas, each on its own slice of the batch",
                   shown="ranks / (pp * tp)")
    pp: int = flag(1, "pipeline stages, each holding consecutive Transformer blocks")
    pp_split: str = flag(None, "layers per pipeline stage, e.g. 3,1 (with --virtual-stages v: per piece of the "
                               "model, pp x v numbers in the model's order; the interleaved schedule places piece "
                               "c*pp + s on stage s as its chunk c)", shown="as even as possible",
                         metavar="N,N,...")
    schedule: str = flag("1f1b", "pipeline schedule (python -m hsgd.schedule draws them)\n"
                         "1f1b: PipeDream-Flush, one forward then one backward in the steady state\n"
                         "gpipe: all forwards, then all backwards\n"
                         "interleaved: 1F1B over --virtual-stages chunks per stage (Megatron-LM's order)\n"
                         "zb-h1: zero-bubble H1, each backward split into B (input gradient) and W (weight "
                         "gradients), the W's filling the bubble\n"
                         "zb-v: zero-bubble V, two chunks per stage placed down the stages and back up (stage s "
                         "holds pieces s and 2pp-1-s), B and W split\n"
                         "dualpipev: DeepSeek's DualPipeV, the same V, one micro-batch's forward run with another's "
                         "backward (m >= 2 pp)\n"
                         "dualpipe: DeepSeek's DualPipe, half the micro-batches from each end, every stage holding "
                         "two pieces and their gradients summed with the stage opposite (pp even, m >= 2 pp, even)",
                         choices=SCHEDULES)
    virtual_stages: int = flag(1, "model chunks per pipeline stage (--schedule interleaved): the layers are cut "
                                  "into pp x v pieces, chunk c of stage s being piece c*pp + s of the model (the "
                                  "loop placement, hsgd.pp.placement); zb-v, dualpipev and dualpipe hold 2")
    micro_batches: int = flag(1, "micro-batches per DP group and step: the pipeline's m; gradient accumulation when "
                                 "pp = 1")
    tp_scheme: str = flag("megatron", "tensor-parallel scheme\n"
                          "megatron: Megatron-LM's f/g operator pairs, one Allreduce at the exit of every branch\n"
                          "gather: the lecture's, every linear column-split and its output All-Gathered\n"
                          "sequence: megatron's split, with LayerNorm and the residual stream split along T",
                          choices=tp_schemes.SCHEMES)
    cp: int = flag(1, "context-parallel size: the ranks that split every sequence between them, T/cp positions each "
                      "(rank r holds chunks r and 2cp-1-r of 2cp; seq_len a multiple of 2cp)")
    cp_scheme: str = flag("ring", "how a cp rank's attention reads the keys and values of the others\n"
                          "ring: ring attention, (k, v) blocks passed around cp_comm, overlapped with the blocks\n"
                          "allgather: All-Gather k and v of the whole sequence, Reduce-Scatter their gradients\n"
                          "ulysses: all-to-all from T/cp positions of every head to all T positions of NH/(tp cp) "
                          "heads, the attention whole, all-to-all back (cp must divide NH/tp and NKV/tp)\n"
                          "a2a+p2p: Megatron-LM's hierarchical cp: ulysses inside groups of a adjacent cp ranks, "
                          "ring attention across the r = cp/a groups; r is cp's smallest prime factor (cp 4: 2 x 2, "
                          "8: 4 x 2; cp not prime), a must divide NH/tp and NKV/tp",
                          choices=CP_SCHEMES)
    ep: int = flag(1, "expert-parallel size: the ranks of dp x cp (Megatron-LM's parallel folding) that split each "
                      "MoE block's experts between them, E/ep each, tokens sent to their experts by all-to-all; the "
                      "dp x cp / ep groups of them hold copies of the same experts and average their gradients")
    attention: str = flag("materialized", "how a rank holding whole sequences computes its core attention\n"
                          "materialized: the scores and probabilities (B x NH/tp x T x T per block) computed whole "
                          "and the probabilities kept for the backward pass\n"
                          "flash: by blocks of 64 keys with an online softmax, keeping only the output and one "
                          "log-sum-exp per query; the backward pass computes each block's probabilities again "
                          "(Dao 2023, FlashAttention-2). With --cp, ring attention is blockwise already and "
                          "allgather keeps its (T/cp x T) probabilities", choices=ATTENTIONS)

    def check_layout(self):
        for name in ("tp", "dp"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("pp", self.pp)
        check_positive_int("micro_batches", self.micro_batches)
        check_positive_int("virtual_stages", self.virtual_stages)
        check_positive_int("cp", self.cp)
        check_positive_int("ep", self.ep)
        for name in ("tp", "dp", "pp", "cp", "ep"):
            if getattr(self, name) is not None:
                check_at_most(name, getattr(self, name), MAX_RANKS, f"a job has at most {MAX_RANKS} ranks")
        if self.cp_scheme not in CP_SCHEMES:
            raise ConfigError(f"cp_scheme={self.cp_scheme!r} is not known; use one of {', '.join(CP_SCHEMES)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is not known; use one of {', '.join(SCHEDULES)}")
        if self.schedule in TWO_CHUNKS and self.virtual_stages not in (1, 2):
            raise ConfigError(f"--schedule {self.schedule} holds 2 chunks per stage, not --virtual-stages "
                              f"{self.virtual_stages}; leave --virtual-stages out (or give 2)")
        if self.schedule in TWO_CHUNKS:
            self.virtual_stages = 2                                    # (what the checkpoints and stages see)
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention={self.attention!r} is not known; use one of {', '.join(ATTENTIONS)}")

    def resolve_layout(self, world_size):
        """Fill in tp and dp from the world size, then check that dp * pp * cp * tp == world size."""
        check_at_most("ranks", world_size, MAX_RANKS, f"run on at most {MAX_RANKS} ranks")
        per_stage = world_size // (self.pp * self.cp) if world_size % (self.pp * self.cp) == 0 else 1
        if self.tp is None:
            self.tp = 2 if per_stage % 2 == 0 and (self.dp is None or per_stage // self.dp % 2 == 0) else 1
        if self.dp is None:
            self.dp = max(world_size // (self.tp * self.pp * self.cp), 1)
        check_sizes(world_size, self.dp, self.pp, self.tp, self.cp)


@dataclass
class Optimization:
    """Mini-batch SGD (or AdamW): steps, the global batch, the learning-rate schedule, the seed."""

    steps: int = flag(1000, "optimizer steps")
    batch_size: int = flag(16, "B: sequences in the global batch of every step, a multiple of dp * micro_batches")
    optimizer: str = flag("sgd", "sgd (with momentum) or adamw", choices=("sgd", "adamw"))
    lr: float = flag(0.05, "peak learning rate")
    momentum: float = flag(0.9, "heavy-ball momentum of SGD, 0 for plain SGD")
    weight_decay: float = flag(0.0, "decoupled weight decay on the weight matrices")
    warmup: int = flag(20, "linear warmup steps, then cosine decay to lr/10 at the last step")
    clip: float = flag(0.0, "clip the global gradient norm to this value, 0 = no clipping")
    seed: int = flag(0, "seeds the parameters, the batches and the sample")

    def check_optimization(self):
        check_positive_int("steps", self.steps)
        check_positive_int("batch_size", self.batch_size)
        check_nonnegative_int("warmup", self.warmup)
        check_nonnegative_int("seed", self.seed)
        for name in ("lr", "momentum", "weight_decay", "clip"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a finite number")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r} must be > 0 (typical: SGD 0.01 to 0.1, AdamW 1e-4 to 3e-3)")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1) (typical: 0.9)")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if not self.clip >= 0:
            raise ConfigError(f"clip={self.clip!r} must be >= 0 (0 turns clipping off)")
        if self.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"optimizer={self.optimizer!r} is not known; use sgd or adamw")


@dataclass
class Data:
    """What is trained on, in which floating-point type, on which device."""

    data: str = flag(None, "text file to train on, its bytes the tokens",
                     shown="the Python standard library's source files", metavar="FILE")
    dtype: str = flag("float32", "floating-point type of the computation; float64 for exactness checks; bfloat16 "
                                 "and float16 emulated on float32 arrays, rounded at every point of "
                                 "hsgd.model.precision.POINTS, with float32 "
                                 "master weights, gradients and optimizer state",
                      choices=("float32", "float64", "bfloat16", "float16"))
    reduce_dtype: str = flag("float32", "the format the gradients are exchanged in over dp_comm (with --dtype "
                                        "bfloat16 or float16)", choices=("float32", "bfloat16", "float16"))
    loss_scale: str = flag("dynamic", "with --dtype float16: dynamic loss scaling (start at 2^16, halve and skip the "
                                      "update on an inf or NaN, double after 2000 good steps; stop with exit code "
                                      "3 when it falls below 1), or none",
                           choices=("dynamic", "none"))
    fp8: str = flag(None, "FP8 matrix products in the blocks' linear layers (hsgd.fp8): hybrid casts activations and "
                          "weights to E4M3 forward and gradients to E5M2 backward, e4m3 all to E4M3; products "
                          "accumulate in the --dtype (float32, or float64: the exact FP8 mode), master weights and "
                          "optimizer stay in it", shown="off", choices=("hybrid", "e4m3"))
    fp8_recipe: str = flag(None, "with --fp8: how each operand's scale is chosen\n"
                           "delayed: from the amax of the last --fp8-history steps\n"
                           "tensorwise: from this tensor's amax\n"
                           "rowwise: one scale per row along the contraction\n"
                           "blockwise: 1 x b tiles of activations, b x b of weights (--fp8-block)",
                           shown="delayed", choices=("delayed", "tensorwise", "rowwise", "blockwise"))
    fp8_history: int = flag(None, "with --fp8-recipe delayed: steps of amax history the scale is taken from",
                            shown="16")
    fp8_margin: int = flag(None, "with --fp8: the scale is fmax / amax / 2^margin", shown="0")
    fp8_block: int = flag(None, "with --fp8-recipe blockwise: the tile size b; it divides d_model, d_ff, the "
                                "kv width (per tp rank) and a rank's runs of positions", shown="128")
    fp8_accumulate: str = flag(None, "with --fp8: products accumulated with BITS significand bits and added into "
                                     "float32 every NC terms (DeepSeek-V3: about 14 and 128; NC 0: never)",
                               shown="off: in --dtype", metavar="BITS:NC")
    fp8_check: bool = flag(False, "with --fp8: compare every scale over the ranks that hold its tile, and stop "
                                  "naming the operand if they differ (costs two Allreduces per cast)")
    fp8_allgather: bool = flag(False, "with --fp8 and --zero 3: each rank casts its chunk of the block linears' "
                                      "weights to FP8 before the All-Gather, one byte a value (the scale agreed "
                                      "over the shards first; --fp8-recipe tensorwise or delayed)")
    device: str = flag(None, "cpu (NumPy) or gpu (CuPy)", shown="$HSGD_DEVICE, else cpu", choices=("cpu", "gpu"))
    threads: int = flag(None, "CPU threads per rank: for BLAS and the tuned layers; a rank that holds the whole "
                              "model (pp = tp = 1) splits each micro-batch's sequences over them (not with "
                              "experts or --fp8, whose counts and scales are taken over a whole micro-batch)",
                        shown="cores / ranks on the machine, at least 1")

    def check_data(self):
        if self.threads is not None:
            check_positive_int("threads", self.threads)
        resolve_dtype(self.dtype)
        resolve_device(self.device)
        if self.reduce_dtype != "float32" and self.dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"reduce_dtype={self.reduce_dtype!r} needs --dtype bfloat16 or float16 (a {self.dtype} "
                              "run exchanges its gradients in its own type)")
        self.check_fp8()

    def check_fp8(self):
        """--fp8 and its settings (hsgd.fp8): a setting without --fp8, a history below 1, a block below 1, a
        BITS:NC that is not one, a low-precision --dtype (FP8 runs on float32 or float64)."""
        given = [n for n in ("fp8_recipe", "fp8_history", "fp8_margin", "fp8_block", "fp8_accumulate")
                 if getattr(self, n) is not None] + [n for n in ("fp8_check", "fp8_allgather") if getattr(self, n)]
        if not self.fp8:
            if given:
                raise ConfigError(f"{given[0]} is an FP8 setting, but --fp8 is off; add --fp8 hybrid (or e4m3)")
            return
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"--fp8 with --dtype {self.dtype} is not built: the products are FP8 and the rest runs "
                              "in --dtype float32 (or float64, the exact FP8 mode)")
        recipe = self.fp8_recipe or "delayed"
        if self.fp8_history is not None:
            check_positive_int("fp8_history", self.fp8_history)
            if recipe != "delayed":
                raise ConfigError(f"fp8_history is for --fp8-recipe delayed, not {recipe}")
        if self.fp8_block is not None:
            check_positive_int("fp8_block", self.fp8_block)
            if recipe != "blockwise":
                raise ConfigError(f"fp8_block is for --fp8-recipe blockwise, not {recipe}")
        if self.fp8_margin is not None:
            check_nonnegative_int("fp8_margin", self.fp8_margin)
        if self.fp8_accumulate is not None:
            fp8_accumulate_value(self.fp8_accumulate)
        if self.fp8_allgather and recipe not in ("tensorwise", "delayed"):
            raise ConfigError(f"fp8_allgather sends each weight with one scale; --fp8-recipe {recipe} has a scale per "
                              "row or block, whose tiles a shard's chunk may cut: use --fp8-recipe tensorwise or "
                              "delayed, or leave --fp8-allgather off")

    def fp8_settings(self):
        """The FP8 settings with their defaults (an hsgd.fp8.scaling.Fp8Settings; accumulate: (bits, nc) or None),
        or None without --fp8."""
        if not self.fp8:
            return None
        return Fp8Settings(self.fp8, self.fp8_recipe or "delayed", self.fp8_history or 16, self.fp8_margin or 0,
                           self.fp8_block or 128, fp8_accumulate_value(self.fp8_accumulate), self.fp8_check)


@dataclass
class Output:
    """What rank 0 prints and writes while training."""

    log_interval: int = flag(50, "steps between progress lines")
    eval_interval: int = flag(250, "steps between validation losses, 0 = only before and after training")
    eval_batches: int = flag(4, f"batches averaged for one validation loss (at most {MAX_EVAL_BATCHES})")
    sample_bytes: int = flag(200, f"bytes generated at the end, 0 = none (at most {MAX_SAMPLE_BYTES})")
    prompt: str = flag("def ", "prompt of the generated sample", shown="'def '")
    log_json: str = flag(None, "rank 0 writes one JSON object per line to FILE: one per step (loss, lr, grad_norm, "
                               "times) and one per validation loss (step, val_loss)", metavar="FILE")
    trace: str = flag(None, "write a Chrome/Perfetto trace of every rank (compute phases and collectives) to FILE",
                      metavar="FILE.json")
    plot: str = flag(None, "write PNG plots to DIR: loss curves and a per-rank timeline of one step", metavar="DIR")
    dump_step: list = flag(None, "write step N as a crosscheck dump into DIR (the parameters before it, its batch, "
                                 "its loss and every rank's gradient shards; hsgd/crosscheck/FORMAT.md), then go "
                                 "on; check it with python -m hsgd.crosscheck DIR", nargs=2, metavar=("N", "DIR"))

    def check_output(self):
        check_positive_int("eval_batches", self.eval_batches)
        check_positive_int("log_interval", self.log_interval)
        check_nonnegative_int("eval_interval", self.eval_interval)
        check_nonnegative_int("sample_bytes", self.sample_bytes)
        check_at_most("sample_bytes", self.sample_bytes, MAX_SAMPLE_BYTES, "each byte is a forward pass")
        check_at_most("eval_batches", self.eval_batches, MAX_EVAL_BATCHES, "each batch is a forward pass")
        if self.dump_step is not None:
            self.dump_step = dump_step_value(self.dump_step)


@dataclass
class Checkpoints:
    """Distributed checkpoints (the lecture's section 4.3); what to do with a non-finite loss or diverged replicas."""

    save_dir: str = flag(None, "write distributed checkpoints into DIR", metavar="DIR")
    save_interval: int = flag(0, "steps between checkpoints, 0 = only after the last step")
    keep: int = flag(3, "checkpoints kept in save_dir, the newest")
    resume: str = flag(None, "continue from the newest checkpoint in --save-dir (auto) or from PATH, under any layout "
                             "valid for the model", metavar="auto|PATH")
    on_nan: str = flag("stop", "a non-finite loss or gradient: stop the run (exit code 3) or skip that step's update",
                       choices=("stop", "skip"))
    overwrite: bool = flag(False, "start a new run in a --save-dir that holds other checkpoints (they are kept; "
                                  "--resume auto then follows the new run)")
    allow_changes: bool = flag(False, "resume although seed, data or batch size differ from the checkpoint's run")
    step_timeout: float = flag(0.0, "end the job (exit code 5) when a collective phase runs longer than its limit, as "
                                    "when a rank stops and the others wait for it forever: S seconds for a step and "
                                    "the --dump-step dump; 10 S for a checkpoint save or load; S per batch for a "
                                    "validation (the first and the last too); S per byte for the sample; S + 60 s for "
                                    "the reports at the end; 0 = off", metavar="S")
    max_skips: int = flag(10, "stop (exit code 3; with --save-dir, a checkpoint of the last finite state first) "
                              "after N updates in a row skipped for non-finite values (--on-nan skip, or float16's "
                              "loss scale backing off once an update was applied; before the first, S finding its "
                              "level is bounded by its floor of 1: 17 halvings from 2^16)",
                          metavar="N")
    check_replicas: int = flag(0, "every N steps compare the DP replicas' parameters and stop, naming the first that "
                                  "differs; 0 = never", metavar="N")

    def check_checkpoints(self):
        check_nonnegative_int("save_interval", self.save_interval)
        check_nonnegative_int("check_replicas", self.check_replicas)
        check_positive_int("keep", self.keep)
        check_positive_int("max_skips", self.max_skips)
        if not (math.isfinite(self.step_timeout) and self.step_timeout >= 0):
            raise ConfigError(f"step_timeout={self.step_timeout!r} must be a finite number of seconds >= 0 (0: off)")
        if self.on_nan not in ("stop", "skip"):
            raise ConfigError(f"on_nan={self.on_nan!r} must be stop or skip")
        if self.resume == "auto" and not self.save_dir:
            raise ConfigError("resume='auto' looks for the newest checkpoint in --save-dir; give --save-dir too")
        if self.save_dir and os.path.exists(self.save_dir) and not os.path.isdir(self.save_dir):
            raise ConfigError(f"save_dir={self.save_dir!r} exists and is not a directory; choose another path")


@dataclass
class Exchange:
    """How the gradients are averaged over dp_comm (plain: one Allreduce per step)."""

    dp_overlap: bool = flag(False, "start each layer's gradient Iallreduce while the backward pass goes on")
    zero: int = flag(0, "ZeRO stage (Rajbhandari et al. 2020): each dp rank updates and keeps optimizer state for "
                        "1/dp of the parameters\n"
                        "0: all-reduce, no sharding\n"
                        "1: reduce-scatter after the backward pass, all-gather after the update\n"
                        "2: also the gradients: each layer's reduce-scatter runs during the backward pass\n"
                        "3: also the parameters: each layer's are all-gathered before its forward and its "
                        "backward, and freed after", choices=(0, 1, 2, 3))
    hierarchical: bool = flag(False, "all-reduce as reduce-scatter in the node, all-reduce across nodes, all-gather "
                                     "in the node; with --zero 2 or 3: shard within the node, replicate across "
                                     "nodes")
    dp_staleness: int = flag(0, "1 = asynchronous SGD: each step's averaged gradient is applied one step late, its "
                                "exchange overlapping the next step", choices=(0, 1))
    ranks_per_node: int = flag(None, "dp ranks per node for --hierarchical", shown="MPI's shared-memory split")

    def check_exchange(self):
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero={self.zero!r} must be 0 (all-reduce), 1, 2 or 3 (ZeRO stage)")
        if self.dp_staleness not in (0, 1):
            raise ConfigError(f"dp_staleness={self.dp_staleness!r} must be 0 (synchronous) or 1 (one step late)")
        if self.ranks_per_node is not None:
            check_positive_int("ranks_per_node", self.ranks_per_node)
        hybrid = self.zero >= 2 and self.hierarchical                # sharded in the node, replicated across
        modes = [m for m, on in (("--dp-overlap", self.dp_overlap), (f"--zero {self.zero}", self.zero),
                                 ("--hierarchical", self.hierarchical and not hybrid),
                                 ("--dp-staleness 1", self.dp_staleness)) if on]
        if len(modes) > 1:
            raise ConfigError(f"{' and '.join(modes)} cannot be combined: each is its own way of exchanging the "
                              "gradients over dp_comm; choose one (--hierarchical combines with --zero 2 or 3 "
                              "only: shard within a node, replicate across nodes)")


@dataclass
class Memory:
    """Spending less memory on activations, and measuring where a step's bytes go."""

    recompute: str = flag("none", "activation recomputation (Korthikanti et al. 2022)\n"
                                  "none: the forward pass keeps everything the backward pass needs\n"
                                  "selective: drop the attention probabilities (B x NH/tp x T x T per block) and "
                                  "compute them again in the backward pass\n"
                                  "full: keep only each block's input and run its forward again in the backward "
                                  "pass, tensor-parallel collectives included", choices=tp_model.RECOMPUTE)
    memory: bool = flag(False, "measure every rank's memory by category over one step (a real allocation tracker: "
                               "tracemalloc on the CPU, CuPy's pool on the GPU) and print it next to the formula; "
                               "with --plot also memory.png; the steps up to the measured one are traced (slower) "
                               "and the measured one runs unthreaded")

    def check_memory_settings(self):
        if self.recompute not in tp_model.RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r} must be one of {', '.join(tp_model.RECOMPUTE)}")


@dataclass
class TrainConfig(Layout, Optimization, Data, Output, Checkpoints, Exchange, Memory, Experiments):
    """Every setting of a training run in one flat object: the fields of the groups above."""

    def group(self, cls):
        """The settings of one group (Layout, Exchange, ...) as an object of its own: what a factory takes."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    def validate(self):
        """Check every value before any communication; raises ConfigError naming the field, the value and a fix.
        Each group checks its own fields; what combines fields of two groups is checked here."""
        self.check_layout()
        self.check_optimization()
        self.check_data()
        self.check_output()
        self.check_checkpoints()
        self.check_exchange()
        self.check_memory_settings()
        self.check_experiments()
        if self.reduce_dtype != "float32" and self.zero >= 2:
            raise ConfigError(f"not with --dtype {self.dtype}, --reduce-dtype {self.reduce_dtype}: --zero 2 and 3 "
                              "reduce-scatter during the backward pass, before the gradient is rounded")
        if self.zero == 3 and not self.hierarchical and self.check_replicas:
            raise ConfigError("check_replicas compares the dp replicas' parameters, but --zero 3 keeps no replicas "
                              "(each dp rank holds its own 1/dp); drop --check-replicas, or add --hierarchical (then "
                              "the nodes hold replicas)")
        if self.zero == 3 and not self.hierarchical and str(self.inject_fault).endswith(":diverge"):
            raise ConfigError("inject_fault KIND diverge perturbs one replica, but --zero 3 keeps no replicas; use "
                              "another KIND or --zero 0, 1 or 2")
        late = ("zb-h1",) + TWO_CHUNKS                                 # weight gradients after the backward
        if self.pp > 1 and self.schedule in late and self.zero >= 2:
            raise ConfigError(f"--schedule {self.schedule} with --zero {self.zero}: ZeRO {self.zero} reduce-scatters "
                              "each layer's gradient when its backward ends, but this schedule computes weight "
                              f"gradients later (in W{', and sums two copies' if self.schedule == 'dualpipe' else ''}"
                              f"); use --zero 0 or 1 with {self.schedule}, or 1f1b, gpipe or interleaved with "
                              "--zero 2 or 3")
        if self.pp > 1 and self.memory and (self.schedule in late or self.virtual_stages > 1):
            raise ConfigError("--memory predicts a step of one chunk per stage with fused backwards (gpipe or 1f1b); "
                              f"measure {self.schedule} with python -m hsgd.schedule --run")
        if self.dump_step is not None and self.dp_staleness:
            raise ConfigError("--dump-step writes a step's own averaged gradient, which --dp-staleness 1 applies a "
                              "step later and never holds at the end of its step; dump a run with --dp-staleness 0")
        if self.dp_staleness and (self.save_dir or self.resume):
            raise ConfigError("checkpoints do not hold the gradient in flight of --dp-staleness 1; run it without "
                              "--save-dir / --resume")

    def check_targets(self, world_size):
        """The ranks and steps named by --straggler, --inject-fault and --dump-step exist in a job of world_size
        ranks and self.steps steps (else they would be silently ignored)."""
        if self.dump_step is not None and not 1 <= self.dump_step[0] <= self.steps:
            raise ConfigError(f"dump_step: step {self.dump_step[0]} is not a step of the run (1..{self.steps}); give "
                              f"--dump-step N DIR with N from 1 to --steps")
        self.check_experiment_targets(world_size, self.steps)


def fp8_accumulate_value(value):
    """(bits, nc) from --fp8-accumulate BITS:NC (2 <= bits <= 24, nc >= 0), None for None; ConfigError otherwise."""
    if value is None:
        return None
    parts = str(value).split(":")
    ok = len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts) and 2 <= int(parts[0]) <= 24
    if not ok:
        raise ConfigError(f"fp8_accumulate={value!r} must be BITS:NC, e.g. 14:128 (BITS from 2 to 24 significand bits "
                          "kept while accumulating, NC the terms between promotions to float32, 0: never)")
    return int(parts[0]), int(parts[1])


def dump_step_value(value):
    """[N, DIR] from --dump-step's two strings or a TOML list: N a step >= 1, DIR a path; ConfigError otherwise."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and not isinstance(value[0], (bool, float)) and \
        str(value[0]).isascii() and str(value[0]).isdigit() and int(value[0]) >= 1 and \
        isinstance(value[1], str) and value[1]
    if not ok:
        raise ConfigError(f"dump_step={value!r} must be a step and a folder, e.g. --dump-step 1 dump "
                          f"(TOML: dump_step = [1, \"dump\"])")
    return [int(value[0]), value[1]]
