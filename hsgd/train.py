"""Train the GPT with mini-batch SGD: python -m hsgd.train [flags]   (python -m hsgd.train --help)

One process, the serial reference model. Each step: take the step's batch (a pure function of seed and step),
compute the mean loss and its gradient with the hand-written backward pass, update every parameter with
w <- w - lr * g (the seed paper's mini-batch SGD; momentum and weight decay optional). Prints a progress line
every few steps, the validation loss at intervals, and a generated sample at the end.

Left out here: parallelism (tensor, data and pipeline parallel training build on this loop in later modules).
"""
import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, fields

from threadpoolctl import threadpool_limits

from . import serial
from .backend import resolve_device, resolve_dtype
from .config import ModelConfig, check_positive_int
from .data import Corpus
from .errors import EXIT_USAGE, ConfigError, UsageError
from .generate import generate, printable
from .optim import SGD


@dataclass
class TrainConfig:
    steps: int = 300               # optimizer steps
    batch_size: int = 16           # B: sequences in the global batch of every step
    lr: float = 0.03               # learning rate of w <- w - lr * g
    momentum: float = 0.9          # heavy-ball momentum (0 = plain SGD)
    weight_decay: float = 0.0      # decoupled weight decay on weight matrices
    seed: int = 0                  # seeds the parameters, the batches and the sample
    data: str = None               # text file to train on; None = the built-in corpus
    dtype: str = "float32"         # float32, or float64 for exactness checks
    device: str = None             # cpu or gpu; None = $HSGD_DEVICE or cpu
    eval_interval: int = 100       # steps between validation-loss evaluations (0 = only before and after)
    eval_batches: int = 4          # batches averaged for one validation loss
    log_interval: int = 10         # steps between progress lines
    sample_bytes: int = 200        # bytes generated at the end (0 = none)
    prompt: str = "def "           # prompt of the generated sample
    threads: int = None            # BLAS threads; None = all cores
    log_json: str = None           # write one JSON object per step to this file

    def validate(self):
        for name in ("steps", "batch_size", "eval_batches", "log_interval"):
            check_positive_int(name, getattr(self, name))
        for name in ("eval_interval", "sample_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name}={v!r} must be an integer >= 0")
        if self.threads is not None:
            check_positive_int("threads", self.threads)
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r} must be > 0 (typical SGD values: 0.01 to 1)")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1) (typical: 0.9)")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        resolve_dtype(self.dtype)
        resolve_device(self.device)


def build_parser():
    d, m = TrainConfig(), ModelConfig()
    p = argparse.ArgumentParser(
        prog="python -m hsgd.train",
        description="Train a GPT-style Transformer with mini-batch SGD (w <- w - lr * mean gradient), "
                    "every backward pass written by hand. Trains on the Python standard library's source "
                    "files unless --data is given.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--seq-len", type=int, default=m.seq_len, help="T: context length in bytes")
    g.add_argument("--d-model", type=int, default=m.d_model, help="C: width of the residual stream")
    g.add_argument("--n-layers", type=int, default=m.n_layers, help="L: Transformer blocks")
    g.add_argument("--n-heads", type=int, default=m.n_heads, help="NH: attention heads (must divide d-model)")
    g.add_argument("--d-ff", type=int, default=m.d_ff, help="F: hidden width of the MLP")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="B: sequences per step (global batch)")
    g.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    g.add_argument("--momentum", type=float, default=d.momentum, help="heavy-ball momentum, 0 for plain SGD")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of parameters, batches and sampling")
    g = p.add_argument_group("data and numerics")
    g.add_argument("--data", default=d.data, metavar="FILE",
                   help="text file to train on (bytes are tokens); default: the Python standard library's source")
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "float64"], help="floating-point type")
    g.add_argument("--device", default=d.device, choices=["cpu", "gpu"],
                   help="cpu (NumPy) or gpu (CuPy); default: $HSGD_DEVICE, else cpu")
    g.add_argument("--threads", type=int, default=d.threads, help="BLAS threads (default: all cores)")
    g = p.add_argument_group("output")
    g.add_argument("--log-interval", type=int, default=d.log_interval, help="steps between progress lines")
    g.add_argument("--eval-interval", type=int, default=d.eval_interval,
                   help="steps between validation losses (0: only before and after training)")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches, help="batches per validation loss")
    g.add_argument("--sample-bytes", type=int, default=d.sample_bytes, help="bytes to generate at the end")
    g.add_argument("--prompt", default=d.prompt, help="prompt of the generated sample")
    g.add_argument("--log-json", default=d.log_json, metavar="FILE", help="write one JSON object per step")
    return p


def configs_from_args(args):
    model = ModelConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                        n_layers=args.n_layers, d_ff=args.d_ff)
    train = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    train.validate()
    return model, train


def fmt_time(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def evaluate(params, corpus, cfg, tc):
    """Mean validation loss over tc.eval_batches fixed batches (the same batches at every evaluation)."""
    losses = [serial.loss(params, *corpus.batch(tc.seed, i, tc.batch_size, split="val"), cfg)
              for i in range(tc.eval_batches)]
    return sum(losses) / len(losses)


def train(cfg, tc, out=sys.stdout):
    """Run the training loop (BLAS threads limited to tc.threads); returns a summary dict (losses, timings)."""
    with threadpool_limits(limits=tc.threads):
        return _train(cfg, tc, out)


def _train(cfg, tc, out):
    say = lambda s="": print(s, file=out, flush=True)
    corpus = Corpus.load(tc.data, cfg.seq_len)
    params = serial.init_params(cfg, seed=tc.seed, dtype=tc.dtype, device=tc.device)
    grads = serial.zeros_like_params(params)
    opt = SGD(tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    tokens_per_step = tc.batch_size * cfg.seq_len

    say(f"hsgd serial training | {cfg.n_params():,} parameters | {resolve_device(tc.device)} {tc.dtype}")
    say(f"model: L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size}")
    say(f"data:  {corpus.describe()}")
    say(f"optim: SGD lr={tc.lr} momentum={tc.momentum} weight_decay={tc.weight_decay} | "
        f"batch {tc.batch_size} x {cfg.seq_len} = {tokens_per_step} tokens/step | {tc.steps} steps")
    val0 = evaluate(params, corpus, cfg, tc)
    say(f"val loss {val0:.4f} before training (uniform guess: {math.log(cfg.vocab_size):.4f})")

    log = open(tc.log_json, "w") if tc.log_json else None
    t_start = time.perf_counter()
    t_last, steps_last, loss_sum = t_start, 0, 0.0
    history = []
    for step in range(1, tc.steps + 1):
        idx, targets = corpus.batch(tc.seed, step, tc.batch_size)
        for g in grads.values():
            g.fill(0)
        loss, _ = serial.loss_and_grads(params, idx, targets, cfg, grads=grads)
        opt.step(params, grads)
        history.append(loss)
        loss_sum += loss
        if log:
            log.write(json.dumps({"step": step, "loss": loss, "time": time.perf_counter() - t_start}) + "\n")
        if step % tc.log_interval == 0 or step == tc.steps:
            now = time.perf_counter()
            n = step - steps_last
            tok_s = n * tokens_per_step / (now - t_last)
            eta = (now - t_start) / step * (tc.steps - step)
            say(f"step {step:>{len(str(tc.steps))}}/{tc.steps} | loss {loss_sum / n:.4f} | "
                f"{tok_s:,.0f} tok/s | ETA {fmt_time(eta)}")
            t_last, steps_last, loss_sum = now, step, 0.0
        if tc.eval_interval and step % tc.eval_interval == 0 and step != tc.steps:
            say(f"val loss {evaluate(params, corpus, cfg, tc):.4f} at step {step}")
    if log:
        log.close()
    wall = time.perf_counter() - t_start
    val1 = evaluate(params, corpus, cfg, tc)
    say(f"val loss {val0:.4f} -> {val1:.4f} after {tc.steps} steps in {fmt_time(wall)} "
        f"({tc.steps * tokens_per_step / wall:,.0f} tok/s)")
    if tc.sample_bytes:
        text = generate(params, cfg, tc.prompt.encode(), tc.sample_bytes, seed=tc.seed)
        say("sample:\n" + printable(text))
    return {"val_before": val0, "val_after": val1, "losses": history, "wall_s": wall, "params": params}


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        cfg, tc = configs_from_args(args)
        train(cfg, tc)
    except UsageError as e:
        print(f"hsgd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
