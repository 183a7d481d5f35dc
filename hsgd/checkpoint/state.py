"""A trainer's state as a checkpoint holds it: parameter shards and optimizer state by parameter name.

The trainer keeps both flat (one buffer over all its parameters; with ZeRO each DP rank's optimizer holds only its
chunk of it). A checkpoint keeps them by name, so that it can be cut again for another layout: `optimizer_state`
turns the flat state into named arrays (gathering the ZeRO chunks), `set_state` the named arrays back into the
flat state of this rank's layout, and `refuse_non_finite` keeps a state that is not finite out of any checkpoint.
"""
from hsgd.model.backend import array_module
from hsgd.errors import NumericalFault


def optimizer_state(trainer):
    """Collective over dp_comm when the exchange shards the optimizer (ZeRO). ({name: {key: shard}}, t): the
    optimizer state of every parameter shard of this rank (keys "velocity" for SGD, "m", "v" for AdamW; none for
    plain SGD) and AdamW's step count. The optimizer holds it flat, over the exchange's owned slice."""
    st = trainer.opt.state.get("flat")
    arrays = {} if st is None else dict(zip(("m", "v"), st)) if isinstance(st, tuple) else {"velocity": st}
    ex, shapes = trainer.exchange, trainer.shapes()
    full = {k: ex.gather(v) for k, v in arrays.items()}                     # (N,) the whole flat layout
    per = {n: {k: v[lo:hi].reshape(shapes[n]) for k, v in full.items()} for n, (lo, hi) in ex.offsets.items()}
    return {n: v for n, v in per.items() if v}, getattr(trainer.opt, "t", 0)


def set_state(trainer, params, state, t):
    """Set this rank's parameter shards and optimizer state (the layout of optimizer_state)."""
    ex = trainer.exchange
    xp = array_module(ex.master)
    ex.set_params(params)
    if hasattr(trainer.opt, "t"):
        trainer.opt.t = t
    flat = {k: xp.zeros(ex.size, dtype=trainer.dtype) for st in state.values() for k in st}
    for n, st in state.items():
        lo, hi = ex.offsets[n]
        for k, v in st.items():
            flat[k][lo:hi] = xp.asarray(v).reshape(-1)
    mine = {k: xp.array(ex.own(v)) for k, v in flat.items()}                # my part of the layout
    trainer.opt.state.clear()
    if mine:
        trainer.opt.state["flat"] = (mine["m"], mine["v"]) if "m" in mine else mine["velocity"]


def refuse_non_finite(trainer, state, step, save_dir, world):
    """Collective: raise NumericalFault on every rank if any rank's parameters or optimizer state hold a NaN or an
    infinity (a checkpoint of them would be useless, and rotate a good one away)."""
    xp = array_module(trainer.exchange.master)
    finite = bool(xp.isfinite(trainer.exchange.master).all()) and all(bool(xp.isfinite(v).all())
                                                                 for st in state.values() for v in st.values())
    bad = [r for r, ok in enumerate(world.allgather(finite)) if not ok]
    if bad:
        raise NumericalFault(f"the parameters or optimizer state are not finite after step {step} (on ranks {bad}); "
                             f"no checkpoint written, the ones in {save_dir!r} are kept; resume from the newest with "
                             "a smaller --lr")
