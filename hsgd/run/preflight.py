"""What a run checks before it does any work: inputs that would block, outputs that would fail at the end.

Two kinds of failure cost a run more than a bad flag does. An input that is not a regular file (a FIFO, a device
such as /dev/zero, a terminal) never ends or never arrives, so the rank reading it waits forever and the others
wait for it. An output that cannot be written (a --save-dir under a file, a --log-json in a missing folder,
--plot without matplotlib) is found only when it is first used, which for checkpoints, plots and the sample is
after the last step: the run is lost. So `check_run` looks at every output path and every optional dependency
before the first step, on every rank (inside `launch.agree`, so that all ranks stop together with one line and
exit code 2), and `regular_file` is the one gate every input file passes: data, --config, a checkpoint's
manifest and its shards. An output is proved writable by creating and removing a file there (hsgd.files:
os.access() says yes where nothing can be created); nothing is left behind.
"""

from hsgd.files import needs_module, writable_dir, writable_file


def check_run(tc, error):
    """Every check of a training run's outputs and optional dependencies, before any work (see the module
    docstring). tc: TrainConfig; error: the UsageError subclass to raise."""
    from hsgd.model.backend import get_xp, resolve_device
    if resolve_device(tc.device) == "gpu":
        get_xp("gpu")                                    # ConfigError with the fix when CuPy does not import
    if tc.plot:
        needs_module("matplotlib", "--plot", error)
        writable_dir(tc.plot, "--plot folder", error)
    if tc.trace:
        writable_file(tc.trace, "--trace file", error)
    if tc.log_json:
        writable_file(tc.log_json, "--log-json file", error)
    if tc.save_dir:
        writable_dir(tc.save_dir, "--save-dir", error)
    if tc.dump_step:
        writable_dir(tc.dump_step[1], "--dump-step folder", error)
    if tc.sample_bytes:
        try:
            tc.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise error(f"--prompt {tc.prompt!r} is not valid text (it cannot be encoded as UTF-8: {e.reason}); "
                        "pass the prompt as UTF-8") from None


def memory_estimate(cfg, tc):
    """A lower bound of the bytes one rank needs, from the sizes alone (no array is made): its share of the
    parameters, their gradients and the optimizer state (divided by dp where ZeRO shards them), the model's rounded
    copy of the weights in bfloat16 and float16 (but ZeRO-3), and the activations of one micro-batch
    (hsgd.accounting.activations.activation_formula, less what --recompute drops)."""
    from hsgd.accounting.activations import activation_formula
    from hsgd.accounting.step_memory import pieces
    L = cfg.n_layers
    params = cfg.n_params()                                          # of its family (at most 4096 layers to walk)
    itemsize = 8 if tc.dtype == "float64" else 4
    states = 2 if tc.optimizer == "adamw" else 1 if tc.momentum else 0
    share = params * itemsize // (tc.tp * tc.pp)                     # one copy of this rank's stage and tp shard
    zero = tc.zero                                                   # ZeRO shards: state (1), grads (2), params (3)
    dcp = tc.dp * tc.cp                                              # dp_comm: every rank of a shard
    n = (tc.ranks_per_node or dcp) if tc.hierarchical and zero >= 2 else dcp   # hybrid: within a node
    weights = (share // (n if zero >= 3 else 1) + share // (n if zero >= 2 else 1)
               + states * share // (n if zero >= 1 else 1))
    if tc.dtype in ("bfloat16", "float16") and zero < 3:
        weights += share                            # the model's rounded copy of the weights (hsgd.model.precision)
    micro = max(tc.batch_size // (tc.dp * tc.micro_batches), 1)
    f = activation_formula(cfg, micro, itemsize, tc.tp, tc.tp_scheme, tc.cp, tc.cp_scheme, tc.attention)
    kept = pieces(cfg, micro, itemsize, tc.tp, tc.tp_scheme, tc.recompute, tc.cp, tc.cp_scheme,
                  tc.attention)["K"]                                 # a block's cache
    activations = (f["model"] - L * f["block"] + L * kept) // tc.pp
    return weights, activations


def available_memory():
    """Bytes this machine can still give (MemAvailable), or None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(cfg, tc, ranks_here, error, available=None):
    """Refuse a run whose ranks on this machine need more memory than it has (CPU runs: on a GPU the arrays live in
    device memory), with the estimate, before anything is allocated."""
    from hsgd.model.backend import resolve_device
    available = available_memory() if available is None else available
    if available is None or resolve_device(tc.device) == "gpu":
        return
    weights, activations = memory_estimate(cfg, tc)
    need = (weights + activations) * ranks_here
    if need > available:
        gib = lambda b: f"{b / 2**30:,.1f} GiB"
        raise error(f"this run needs at least {gib(weights + activations)} per rank (parameters, gradients and "
                    f"optimizer state {gib(weights)}, activations of one micro-batch {gib(activations)}) x "
                    f"{ranks_here} ranks on this machine = {gib(need)}, but {gib(available)} are available; use a "
                    "smaller model or batch, more micro-batches, or more ranks for tp and pp")
