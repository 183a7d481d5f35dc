"""serial.sgd, the reference run every parallel test compares against: it is the hand-written loop of mini-batch
SGD (optimizer, schedule, clipping), its delayed variant applies each gradient one step late, clipping bounds the
update, and the losses it returns are those of the parameters before each step."""
import math

import numpy as np

from hsgd.model import serial
from hsgd.model.optim import lr_at
from hsgd.step.settings import TrainConfig

from .conftest import max_rel_err, random_batch


def config(**kw):
    base = dict(steps=2, batch_size=4, lr=0.1, momentum=0.9, warmup=1, dtype="float64", seed=3)
    return TrainConfig(**{**base, **kw})


def batches(cfg, steps, B=4):
    """batch(step) for steps 1..steps: a different random batch each step."""
    fixed = [random_batch(cfg, B, seed=s) for s in range(1, steps + 1)]
    return lambda step: fixed[step - 1]


def max_err(a, b):
    """The largest max_rel_err over the parameters (floor 0.02, the init scale: the k-biases stay ~0)."""
    return max(max_rel_err(a[n], b[n], floor=0.02) for n in b)


def test_equals_a_hand_written_loop(tiny_cfg):
    """Two steps of SGD with momentum mu, warmup and the cosine schedule, written out:
    v_1 = g(w_1), w_2 = w_1 - lr_1 v_1;  v_2 = mu v_1 + g(w_2), w_3 = w_2 - lr_2 v_2."""
    tc, batch = config(), batches(tiny_cfg, 2)
    got, losses = serial.sgd(tiny_cfg, tc, batch)
    w = serial.init_params(tiny_cfg, seed=tc.seed, dtype="float64")
    v, hand_losses = None, []
    for step in (1, 2):
        loss, g = serial.loss_and_grads(w, *batch(step), tiny_cfg)
        hand_losses.append(loss)
        v = g if v is None else {n: tc.momentum * v[n] + g[n] for n in g}
        w = {n: w[n] - lr_at(step, tc.lr, tc.warmup, tc.steps) * v[n] for n in w}
    err = max_err(got, w)
    loss_err = max(abs(a - b) for a, b in zip(losses, hand_losses))
    print(f"serial.sgd vs the hand-written loop, 2 steps: max param rel err {err:.1e}, max loss diff {loss_err:.1e}")
    assert err < 1e-13 and loss_err < 1e-13


def test_adamw_with_weight_decay_equals_a_hand_written_step(tiny_cfg):
    """One AdamW step from zero moments: m = (1-b1) g, v = (1-b2) g^2, and after the bias corrections
    w <- w (1 - lr wd [2-D]) - lr g / (|g| + eps): a step of size ~lr along -sign(g)."""
    tc, batch = config(steps=1, optimizer="adamw", lr=0.01, weight_decay=0.1, warmup=0), batches(tiny_cfg, 1)
    got, _ = serial.sgd(tiny_cfg, tc, batch)
    w = serial.init_params(tiny_cfg, seed=tc.seed, dtype="float64")
    _, g = serial.loss_and_grads(w, *batch(1), tiny_cfg)
    lr = lr_at(1, tc.lr, tc.warmup, tc.steps)
    want = {n: w[n] * (1 - lr * tc.weight_decay * (w[n].ndim >= 2)) - lr * g[n] / (np.abs(g[n]) + 1e-8) for n in w}
    err = max_err(got, want)
    print(f"serial.sgd AdamW + weight decay vs one hand-written step: max param rel err {err:.1e}")
    assert err < 1e-12


def test_delayed_applies_each_gradient_one_step_late(tiny_cfg):
    """delayed=True: step 1 changes nothing; step 2 applies g(w_1) with lr_2; step 3 applies g(w_2) with lr_3, where
    w_2 = w_1 (so g(w_2) is the gradient at w_1 on batch 2). Plain SGD (mu = 0), written out."""
    tc, batch = config(steps=3, momentum=0.0), batches(tiny_cfg, 3)
    init = serial.init_params(tiny_cfg, seed=tc.seed, dtype="float64")
    after_1, _ = serial.sgd(tiny_cfg, config(steps=1, momentum=0.0), batch, delayed=True)
    unchanged = max(float(np.abs(after_1[n] - init[n]).max()) for n in init)
    got, losses = serial.sgd(tiny_cfg, tc, batch, delayed=True)
    w = dict(init)
    _, g1 = serial.loss_and_grads(w, *batch(1), tiny_cfg)               # at w_1
    _, g2 = serial.loss_and_grads(w, *batch(2), tiny_cfg)               # at w_2 = w_1
    w = {n: w[n] - lr_at(2, tc.lr, tc.warmup, tc.steps) * g1[n] for n in w}
    w = {n: w[n] - lr_at(3, tc.lr, tc.warmup, tc.steps) * g2[n] for n in w}
    err = max_err(got, w)
    same_loss = abs(losses[1] - serial.loss(init, *batch(2), tiny_cfg))
    print(f"delayed: step 1 moved the parameters by {unchanged:.1e}; 3 steps vs the hand-written delayed loop: "
          f"max param rel err {err:.1e}; loss of step 2 vs the loss at w_1 {same_loss:.1e}")
    assert unchanged == 0.0 and err < 1e-13 and same_loss < 1e-14


def test_clipping_bounds_the_update(tiny_cfg):
    """Plain SGD, one step: ||w_2 - w_1|| = lr_1 * min(||g||, clip), so clip far below ||g|| bounds the step by
    lr_1 * clip, and clip = 0 leaves it at lr_1 * ||g||."""
    batch = batches(tiny_cfg, 1)
    w = serial.init_params(tiny_cfg, seed=3, dtype="float64")
    _, g = serial.loss_and_grads(w, *batch(1), tiny_cfg)
    g_norm = math.sqrt(sum(float((x * x).sum()) for x in g.values()))
    for clip in (0.0, 0.1 * g_norm):
        tc = config(steps=1, momentum=0.0, warmup=0, clip=clip)
        got, _ = serial.sgd(tiny_cfg, tc, batch)
        step = math.sqrt(sum(float(((got[n] - w[n]) ** 2).sum()) for n in w))
        want = lr_at(1, tc.lr, tc.warmup, tc.steps) * (min(g_norm, clip) if clip else g_norm)
        print(f"clip={clip:.3g} (||g|| = {g_norm:.3g}): ||w_2 - w_1|| = {step:.6g}, lr * min(||g||, clip) = "
              f"{want:.6g}, rel err {abs(step - want) / want:.1e}")
        assert abs(step - want) <= 1e-10 * want


def test_starts_from_given_params_and_returns_the_losses_before_each_step(tiny_cfg):
    """params=: the run starts there and updates them in place; losses[s-1] is the loss at w_s before step s."""
    tc, batch = config(steps=2), batches(tiny_cfg, 2)
    start = serial.init_params(tiny_cfg, seed=11, dtype="float64")
    first = serial.loss(start, *batch(1), tiny_cfg)
    got, losses = serial.sgd(tiny_cfg, tc, batch, params=start)
    print(f"params=: loss of step 1 vs the loss at the given params {abs(losses[0] - first):.1e}; "
          f"updated in place: {got is start}")
    assert got is start and len(losses) == 2 and abs(losses[0] - first) < 1e-14
