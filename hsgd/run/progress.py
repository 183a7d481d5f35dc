"""What a run says while it trains: a progress line every --log-interval steps and the --log-json records.

A progress line averages the steps since the last one: loss, learning rate, tokens/s, the time left (ETA), and the
step time split into compute, tensor-parallel and data-parallel communication. --log-json FILE gets one JSON object
per line: {"step", "loss", "lr", "grad_norm", "seconds", "tp_seconds", "dp_seconds"} for every step (with float16
loss scaling also "loss_scale", the S of the step, and "scale_skips", the updates skipped so far; with --fp8
"fp8_values", "fp8_overflow" and "fp8_underflow", the step's casts to FP8 over all ranks, hsgd.fp8.scaling) and
{"step", "val_loss"} for every validation loss (step 0 or the resumed step: before training), so that a run can be
plotted from the file alone. Only rank 0 writes; a resumed run (--resume) appends to the file, so that it holds the
whole run (steps after the checkpoint that the stopped run had logged appear again: the later record counts), and
every line is flushed when written (a killed run keeps every step it logged).
"""
import json
import math
import time

from hsgd.run.report import fmt_time


def power_of_two(x):
    """2^k for a positive finite x (k exact for a power of two), else x as it is (0.0, inf, nan: no log2 of them)."""
    return f"2^{math.log2(x):g}" if 0 < x < math.inf else f"{x:g}"


class Progress:
    def __init__(self, tc, tokens_per_step, start, say, rank0):
        self.tc, self.tokens, self.start, self.say = tc, tokens_per_step, start, say
        # a resumed run appends to the log of the steps before it; every record is flushed as it is written
        self.log = open(tc.log_json, "a" if start > 1 else "w") if (tc.log_json and rank0) else None
        self.t0 = time.perf_counter()
        self.window = dict.fromkeys(("n", "loss", "s", "tp", "dp"), 0.0)
        self.losses = []                                          # every step's loss, for the plots

    def step(self, step, info):
        self.losses.append(info.loss)
        for k, v in (("n", 1), ("loss", info.loss), ("s", info.seconds), ("tp", info.tp_seconds),
                     ("dp", info.dp_seconds)):
            self.window[k] += v
        record = {"step": step, "loss": info.loss, "lr": info.lr, "grad_norm": info.grad_norm,
                  "seconds": info.seconds, "tp_seconds": info.tp_seconds, "dp_seconds": info.dp_seconds}
        if info.loss_scale is not None:
            record.update(loss_scale=info.loss_scale, scale_skips=info.scale_skips)
        if info.fp8 is not None:
            record.update({f"fp8_{k}": v for k, v in info.fp8.items()})
        self.write(record)
        if step % self.tc.log_interval == 0 or step == self.tc.steps:
            self.line(step, info.lr, info)

    def line(self, step, lr, info=None):
        w, n, steps = self.window, self.window["n"], self.tc.steps
        elapsed = time.perf_counter() - self.t0
        comp = w["s"] - w["tp"] - w["dp"]
        self.say(f"step {step:>{len(str(steps))}}/{steps} | loss {w['loss'] / n:.4f} | lr {lr:.2e} | "
                 f"{n * self.tokens / w['s']:,.0f} tok/s | "
                 f"ETA {fmt_time(elapsed / (step - self.start + 1) * (steps - step))} | "
                 f"step {1e3 * w['s'] / n:.0f} ms = compute {1e3 * comp / n:.0f} + "
                 f"tp {1e3 * w['tp'] / n:.0f} + dp {1e3 * w['dp'] / n:.0f}"
                 + (f" | loss scale {power_of_two(info.loss_scale)}, {info.scale_skips} skipped"
                    if info is not None and info.loss_scale is not None else "")
                 + (f" | fp8 casts: {info.fp8['overflow']:,} overflowed, {info.fp8['underflow']:,} underflowed of "
                    f"{info.fp8['values']:,}" if info is not None and info.fp8 is not None else ""))
        self.window = dict.fromkeys(self.window, 0.0)

    def validation(self, step, loss, when=""):
        self.write({"step": step, "val_loss": loss})
        self.say(f"val loss {loss:.4f} {when or f'at step {step}'}")

    def write(self, record):
        if self.log:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def close(self):
        if self.log:
            self.log.close()
            self.log = None
