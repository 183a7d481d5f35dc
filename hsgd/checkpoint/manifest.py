"""A checkpoint's manifest: what it must hold, checked before any of it is trusted.

A manifest decides which files are read (their names), how they are put together (the layout) and which checks
apply (the checksums), so a damaged or edited one could make a loader read files outside the checkpoint, skip
every checksum (an empty `files`), or cut a model into wrong shapes. `check` therefore verifies, in order:

* its own digest (`digest`: SHA-256 of the manifest's JSON without that key, keys sorted), recorded when it was
  written: any later edit is detected;
* its schema: every key there, of its type; the model a valid ModelConfig; the layout (dp, pp, tp, a known tensor
  scheme, virtual stages, the pieces' placement: "loop" when absent, layers per piece) one that splits that model;
  the optimizer's step count at most the checkpoint's step, a loss scale finite and positive (check_state);
* its files: exactly the shard names of that layout, `shard-pp{s}-tp{t}.npz` for every stage s and tensor rank t
  (`shard-pp{s}-tp{t}-ep{r}.npz` for every expert-parallel rank r too with ep > 1),
  each entry naming its own (s, t), a 64-digit SHA-256 and a size. Nothing else is ever opened.

Every failure is `checkpoint ... is corrupt: ...` (a CheckpointError: exit code 2).
"""
import hashlib
import json
import math

from hsgd.errors import ConfigError

DTYPES = ("float32", "float64", "bfloat16", "float16")
OPTIMIZERS = ("sgd", "adamw")


def digest(manifest):
    """SHA-256 of the manifest's canonical JSON, without its own digest (and the loader's `path`)."""
    body = {k: v for k, v in manifest.items() if k not in ("digest", "path")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def shard_names(pp, tp, ep=1):
    """The files of a checkpoint saved on pp stages x tp tensor ranks {name: (s, t, r)}; with experts split over ep
    ranks one per expert-parallel rank r too, shard-pp{s}-tp{t}-ep{r}.npz (r = 0 also holds the dense parameters)."""
    if ep == 1:
        return {f"shard-pp{s}-tp{t}.npz": (s, t, 0) for s in range(pp) for t in range(tp)}
    return {f"shard-pp{s}-tp{t}-ep{r}.npz": (s, t, r) for s in range(pp) for t in range(tp) for r in range(ep)}


def check_sizes(lay, need):
    """need(ok, what) that the layout's sizes are ones a job can have (dp pp cp tp <= MAX_RANKS ranks): checked
    before any list or name depends on them."""
    from hsgd.step.settings import MAX_RANKS
    ranks = lay["dp"] * lay["pp"] * lay.get("cp", 1) * lay["tp"]
    need(ranks <= MAX_RANKS, f"has a layout of dp x pp x cp x tp = {ranks} ranks, more than a job has (at most "
                             f"{MAX_RANKS})")


def is_int(x, low=0):
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def check_state(m, need):
    """need(ok, what) that the training state the manifest carries could have come from its run: the optimizer's
    step count t at most the checkpoint's step (one update per step at most: AdamW's bias correction divides by
    1 - beta^t), and a float16 loss scaler's state (or null) a finite positive scale with step counts of that
    run; a NaN scale would skip every update of the resumed run."""
    t, step, ls = m["optimizer"]["t"], m["step"], m.get("loss_scale")
    need(t <= step, f"has an optimizer step count {t}, more than its step {step}")
    if ls is None:
        return
    scale = ls.get("scale") if isinstance(ls, dict) else None
    need(isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0,
         f"has a loss scale {scale!r}, not a finite positive number")
    need(all(is_int(ls.get(k)) and ls[k] <= step for k in ("good_steps", "skipped")),
         f"has a loss scaler's step counts {ls.get('good_steps')!r} and {ls.get('skipped')!r}, not integers from 0 "
         f"to its step {step}")


def check(m, path, error):
    """Raise error("checkpoint PATH is corrupt: ...") unless `m`, a dict of hsgd's format (the caller has checked
    that much: hsgd.checkpoint.store.open_checkpoint), is a manifest as described in the module docstring. Returns the
    ModelConfig it describes."""
    from hsgd.model.config import ModelConfig
    from hsgd.errors import UsageError
    from hsgd.pp.chunks import chunk_layers
    from hsgd.pp.placement import SHAPES, placement
    from hsgd.tp.schemes import SCHEMES
    from hsgd.tp.shards import check_tp

    def need(ok, what):
        if not ok:
            raise error(f"checkpoint {path!r} is corrupt: its manifest {what}; resume from another checkpoint")

    need(isinstance(m.get("digest"), str), "records no digest of itself (written by an older hsgd, or edited)")
    need(m["digest"] == digest(m), "was changed after it was written (its digest does not match)")
    for key, kind in (("step", int), ("model", dict), ("layout", dict), ("optimizer", dict), ("dtype", str),
                      ("data", dict), ("files", dict)):
        need(isinstance(m.get(key), kind) and not isinstance(m.get(key), bool), f"has no {key} of type {kind.__name__}")
    need(m["step"] >= 1, f"has step {m['step']!r}, not a step >= 1")
    run = m.get("run")
    need(isinstance(run, dict) and isinstance(run.get("line"), str) and is_int(m.get("written_ns")),
         "has no run line and write time")
    try:
        cfg = ModelConfig(**m["model"])
    except (TypeError, UsageError) as e:
        need(False, f"describes no valid model ({e})")
    lay = m["layout"]
    need(all(is_int(lay.get(k), 1) for k in ("dp", "pp", "tp")), "has a layout without positive dp, pp, tp")
    need(is_int(lay.get("cp", 1), 1), f"has cp {lay.get('cp')!r}, not a positive integer")
    check_sizes(lay, need)                                             # before a list or a name depends on them
    need(lay.get("tp_scheme") in SCHEMES, f"names an unknown tensor-parallel scheme {lay.get('tp_scheme')!r}")
    layers, v = lay.get("layers"), lay.get("virtual_stages", 1)
    need(isinstance(layers, list) and all(is_int(x, 1) for x in layers),
         "has no list of layers per stage (per piece with virtual stages)")
    need(is_int(v, 1), f"has virtual_stages {v!r}, not a positive integer")
    need(lay.get("placement", "loop") in SHAPES, f"names an unknown placement of the pieces "
         f"{lay.get('placement')!r:.40} (one of {', '.join(SHAPES)})")
    try:
        pieces = placement(lay.get("placement", "loop"), lay["pp"], v).K       # (dual: pp pieces, each twice)
        chunk_layers(cfg.n_layers, lay["pp"], pieces // lay["pp"], layers)
        check_tp(cfg, lay["tp"], lay["tp_scheme"])
    except UsageError as e:
        need(False, f"has a layout that does not split its model ({e})")
    opt = m["optimizer"]
    need(opt.get("name") in OPTIMIZERS and is_int(opt.get("t")), "has no optimizer name and step count")
    check_state(m, need)                                               # the optimizer's steps, the loss scale
    need(m["dtype"] in DTYPES, f"has an unknown dtype {m['dtype']!r}")
    ep = lay.get("ep", 1)
    need(is_int(ep, 1) and (ep == 1 or cfg.moe_experts and cfg.moe_experts % ep == 0
                            and lay["dp"] * lay.get("cp", 1) % ep == 0),
         "has a layout whose ep is not a positive integer that divides its experts")
    listed, count = sorted(m["files"]), lay["pp"] * lay["tp"] * ep       # (counted before the names are made)
    need(len(listed) == count, f"lists the files {listed[:8]!r}{' ...' if len(listed) > 8 else ''}, not the pp x "
                               f"tp x ep = {count} shards of its layout")
    expected = shard_names(lay["pp"], lay["tp"], ep)
    need(set(m["files"]) == set(expected), f"lists the files {sorted(m['files'])!r}, not the shards of its layout "
                                           f"{sorted(expected)}")
    for name, info in m["files"].items():
        s, t, r = expected[name]
        need(isinstance(info, dict) and info.get("pp") == s and info.get("tp") == t and info.get("ep", 0) == r
             and is_int(info.get("bytes"))
             and isinstance(info.get("sha256"), str) and len(info["sha256"]) == 64, f"has a bad entry for {name}")
    return cfg


# What a resumed run may change, and what it may change only when told (--allow-changes): (name, where in the
# manifest, the run's value, breaks exactness).
def differences(m, tc):
    """[(what, in the checkpoint, now, breaks)] for every setting that differs between the checkpoint's run and this
    one. breaks: the resumed run then is not the continuation of the saved one (other batches or another
    initialization of the data order), so it needs --allow-changes; the others (learning rate, schedule, dtype,
    layout) change how the run goes on, and are only reported."""
    data, sched = m["data"], m.get("schedule", {})
    now = [("seed", data.get("seed"), tc.seed, True), ("data", data.get("corpus"), tc.data or "built-in", True),
           ("batch_size", data.get("batch_size"), tc.batch_size, True), ("dtype", m["dtype"], tc.dtype, False)]
    now += [(k, sched[k], getattr(tc, k), False) for k in SCHEDULE if k in sched]
    return [(k, old, new, breaks) for k, old, new, breaks in now if old != new]


SCHEDULE = ("lr", "warmup", "steps", "momentum", "weight_decay", "clip")     # recorded in the manifest


def say_changes(manifest, tc, say):
    """What differs from the checkpoint's run: reported; a change of seed, data or batch size (not a continuation
    of that run any more) refused unless --allow-changes."""
    changes = differences(manifest, tc)
    breaking = [f"{k} {old!r} -> {new!r}" for k, old, new, breaks in changes if breaks]
    if breaking and not tc.allow_changes:
        raise ConfigError(f"resuming {manifest['path']!r} with {', '.join(breaking)}: the run would not continue the "
                          "saved one (other batches); pass the checkpoint's values, or --allow-changes")
    for k, old, new, _ in changes:
        say(f"resume: {k} {old!r} in the checkpoint's run, {new!r} now")
