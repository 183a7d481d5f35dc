"""Dynamic loss scaling: keep float16 gradients out of the underflow range without letting them overflow.

float16 has 5 exponent bits: its smallest normal number is 2^-14 = 6.1e-5, its smallest subnormal 2^-24 = 6.0e-8,
its largest 65504. Gradients are often smaller than 2^-24 and round to zero. Scaling the loss by S before the
backward pass scales every gradient by S (the backward pass is linear in dloss), lifting them into range; the
optimizer then divides by S in float32. Too large an S overflows some gradient to inf, so S is adjusted as
training goes (Micikevicius et al. 2018, "Mixed Precision Training"), with the rules of PyTorch's
torch.amp.GradScaler:

    start at S = 2^16;
    a step whose gradients hold an inf or a NaN on any rank: every rank skips the update and S <- S * 0.5;
    after `growth_interval` (2000) steps in a row without one: S <- S * 2.

A run whose S keeps backing off has diverged, not underflowed: no scale makes an infinite loss finite. So no run
fails quietly: the updates skipped in a row count toward --max-skips (10 by default), with or without loss scaling
(with it, from the run's first applied update on: the back-offs before it are S finding its level from 2^16, which
the floor bounds, 17 halvings); S below MIN_SCALE (1, DeepSpeed's `min_loss_scale`: at S < 1 the scaling shrinks
the gradients it was there to lift) ends the run; and a run that applied none of its updates ends with exit code 3
too, however few steps it ran (hsgd.train). Each of these is `Skipping` (exit code 3), raised on every rank at
once, after which the run writes a checkpoint of its last finite state: the parameters of the last applied update,
which the skipped ones left as they were, with the scaler's state of then (`rewind`).

The verdict "inf or NaN somewhere" must be the same on every rank (a collective: hsgd.step.health), or the replicas
would diverge: one rank would update, another skip. The scaler keeps the books of a run: the S each step's backward
pass started from (with --dp-staleness 1 the update applies the step before's gradient, made with its S: made_with),
the verdict on each step (after_step: update or skip) and the updates skipped. A run without loss scaling keeps the
same books with S = 1 (NoLossScale), where a non-finite value is what --on-nan says: stop, or skip the update.
"""
from hsgd.step.health import Skipping, all_finite, check_finite, stop_after_skips

MIN_SCALE = 1.0             # the loss scale's floor: below it the run ends (Skipping, exit code 3)


class NoLossScale:
    """S = 1 at every step (float32, float64, bfloat16; float16 with --loss-scale none). A non-finite loss or
    gradient stops the run (on_nan "stop": NumericalFault, exit 3) or skips the update (on_nan "skip"), and
    max_skips skipped in a row stop it: a run that diverged for good."""
    dynamic = False

    def __init__(self, on_nan="stop", max_skips=10):
        self.on_nan, self.max_skips = on_nan, max_skips
        self.scale = 1.0
        self.updates_skipped = 0             # updates skipped for a non-finite value, so far
        self.in_a_row = 0                    # ... the last ones in a row (0 after a step that updated)
        self.updates_applied = 0             # updates applied, so far
        self.last_applied = None             # the step of the last applied update (None: none yet)

    def begin_step(self):
        """The S this step's backward pass starts from."""
        return self.scale

    def made_with(self, lag=0):
        """The S the gradient applied now was made with, `lag` steps ago."""
        return self.scale

    def after_step(self, world, step, bad, fresh=None):
        """Collective over world: whether this step's update is applied, no rank having seen a non-finite value in
        the loss or the gradient to apply (bad: this rank's verdict); else what --on-nan says. fresh: LossScaler's."""
        return self.count(check_finite(world, bad, step, self.on_nan), step)

    def count(self, applied, step):
        """The books of a step whose update is applied or skipped; returns applied. max_skips skipped in a row:
        Skipping (with loss scaling too, once an update was applied: before it, the skips are S coming down to its
        level, which the floor bounds; after it, many in a row are a diverged run)."""
        self.in_a_row = 0 if applied else self.in_a_row + 1
        self.updates_skipped += not applied
        self.updates_applied += applied
        if applied:
            self.last_applied = step
            self.finite = self.state()
        elif not self.dynamic or self.updates_applied:
            stop_after_skips(self.in_a_row, self.max_skips, step)
        return applied

    def state(self):
        """What a checkpoint keeps, and the progress line and --log-json show (nothing: S is always 1)."""
        return None

    def rewind(self):
        """Back to the state of the last applied update (the last finite state), for its checkpoint."""


class LossScaler(NoLossScale):
    """Dynamic loss scaling (see the module docstring): S x backoff_factor and the update skipped after an inf or
    NaN, S x growth_factor after growth_interval good steps in a row."""
    dynamic = True

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 max_skips=10, min_scale=MIN_SCALE):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("a loss scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             "growth_interval >= 1")
        super().__init__(on_nan="skip", max_skips=max_skips)
        self.min_scale = float(min_scale)
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0                  # steps in a row without an inf or NaN (GradScaler's growth tracker)
        self.skipped = 0                     # back-offs so far, each an update skipped (with --dp-staleness 1: the
                                             # next step's, which applies the overflowed gradient)
        self.made = []                       # the S of the last two steps' backward passes
        self.finite = self.state()           # the state after the last applied update (rewind)

    def begin_step(self):
        """The S this step's backward pass starts from (dloss = S / m), kept for made_with."""
        self.made = (self.made + [self.scale])[-2:]
        return self.scale

    def made_with(self, lag=0):
        """The S the gradient applied now was made with: this step's (lag 0), or with --dp-staleness 1 (lag 1) the
        step before's, which the scaler may have halved or doubled since."""
        return self.made[-1 - lag] if len(self.made) > lag else self.made[-1] if self.made else self.scale

    def after_step(self, world, step, bad, fresh=None):
        """Collective over world: whether this step's update is applied (no rank saw an inf or NaN in the loss or
        the gradient to apply), and S backed off or grown. S is judged on the gradient made with the current S:
        the applied one, or with --dp-staleness 1 this step's own (fresh(): the flat gradient as it left this
        rank), so that one overflow is one back-off, not two."""
        applied = check_finite(world, bad, step, "skip")
        now = applied if fresh is None else check_finite(world, not all_finite(fresh()), step, "skip")
        self.update(not now)
        if self.scale < self.min_scale:
            self.count(applied, step)
            raise Skipping(f"the loss scale fell to {self.scale:g} at step {step}, below its floor {self.min_scale:g}: "
                           f"{self.in_a_row} update(s) in a row overflowed at every scale; the run has diverged")
        return self.count(applied, step)

    def update(self, found_inf):
        """After a step's gradients are checked (found_inf: the agreed verdict of every rank): back off and count a
        skipped update, or count a good step and grow S after growth_interval of them. Returns whether the
        update is to be applied."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def state(self):
        """What a checkpoint keeps, and the progress line and --log-json show."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load(self, state):
        self.scale, self.good_steps, self.skipped = float(state["scale"]), int(state["good_steps"]), \
            int(state["skipped"])
        self.finite = self.state()

    def rewind(self):
        self.load(self.finite)


def make_scaler(dtype, loss_scale="dynamic", on_nan="stop", max_skips=10):
    """The loss scale of a run: dynamic for float16 with --loss-scale dynamic, else none (S = 1, --on-nan)."""
    return LossScaler(max_skips=max_skips) if dtype == "float16" and loss_scale == "dynamic" else \
        NoLossScale(on_nan, max_skips)
