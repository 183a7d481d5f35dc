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

The verdict "inf or NaN somewhere" must be the same on every rank (a collective: hsgd.step.health), or the replicas
would diverge: one rank would update, another skip. LossScaler only keeps the state and applies the rules.
"""


class LossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("a loss scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             "growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0                  # steps in a row without an inf or NaN (GradScaler's growth tracker)
        self.skipped = 0                     # back-offs so far, each an update skipped (with --dp-staleness 1: the
                                             # next step's, which applies the overflowed gradient)

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
