"""The context layout of a rank, made in this one place: the whole sequence (hsgd.tp.attention.WHOLE) without
context parallelism, else ring attention (hsgd.cp.ring.Ring), the all-gather of the keys and values
(hsgd.cp.allgather.AllGather), Ulysses' all-to-all to a head split (hsgd.cp.ulysses.Ulysses) or Ulysses inside
groups and the ring across them (hsgd.cp.hierarchical.Hierarchical, a2a+p2p) over cp_comm, as --cp-scheme says.
Chapter 13 compares the four. A layout that made communicators of its own frees them (ctx.free(), where it has
one)."""
import numpy as np

from hsgd.cp.allgather import AllGather
from hsgd.cp.hierarchical import Hierarchical
from hsgd.cp.ring import Ring
from hsgd.cp.split import CP_SCHEMES, check_heads
from hsgd.cp.ulysses import Ulysses
from hsgd.errors import ConfigError
from hsgd.model.backend import get_xp
from hsgd.tp.attention import FLASH, WHOLE


def make_context(cfg, grid, cp_scheme="ring", device=None, attention="materialized"):
    """This rank's context layout: WHOLE (FLASH with --attention flash) without context parallelism (grid.cp = 1),
    else ring attention, all-gather attention, Ulysses or a2a+p2p (--cp-scheme; hsgd.cp.ring.Ring,
    hsgd.cp.allgather.AllGather, hsgd.cp.ulysses.Ulysses, hsgd.cp.hierarchical.Hierarchical) on grid.cp_comm, with the
    arrays of `device`. Ulysses' and a2a+p2p's heads are checked here (hsgd.cp.split.check_heads: ConfigError)."""
    if grid.cp == 1:
        return FLASH if attention == "flash" else WHOLE
    check_heads(cfg.n_heads, cfg.n_kv_heads, grid.cp, grid.tp, cp_scheme)
    return make_split(cp_scheme, grid.cp_comm, cfg.seq_len, get_xp(device))


def make_split(scheme, comm, T, xp=np, balanced=True):
    """The context layout of --cp-scheme ring | allgather | ulysses | a2a+p2p on cp_comm."""
    if scheme not in CP_SCHEMES:
        raise ConfigError(f"unknown cp scheme {scheme!r}; use one of {list(CP_SCHEMES)}")
    return {"ring": Ring, "allgather": AllGather, "ulysses": Ulysses,
            "a2a+p2p": Hierarchical}[scheme](comm, T, balanced, xp)
