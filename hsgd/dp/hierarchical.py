"""Hierarchical all-reduce: sum a flat array over a communicator in three steps, so that only 1/n of it leaves a node.

The lecture, section 4.1: keep traffic inside the node (NVLink inside a server, InfiniBand between servers);
section 3.4 names the "2-D mesh all-reduce". View the P = k*n ranks of a communicator (the dp_comm) as a k x n
mesh: k nodes of n ranks each. `node_split` builds both directions of the mesh with Split(color, key):

    node_comm: the n ranks of one node       color = node index,      key = node-local rank   ("dp-node")
    cross_comm: the k ranks, one per node,   color = node-local rank, key = node index        ("dp-cross")
                with the same node-local rank

With ranks_per_node=n the nodes are consecutive ranks (rank = node * n + local), e.g. P=8, n=2:
    node_comm groups  [0 1] [2 3] [4 5] [6 7]          cross_comm groups  [0 2 4 6] [1 3 5 7]
Without it, MPI's shared-memory split (Split_type(COMM_TYPE_SHARED)) finds the real nodes; nodes are then numbered
by their lowest rank and local ranks follow rank order, and every node must have the same size.

`hierarchical_allreduce(flat, node_comm, cross_comm)`, flat: (N,) on every rank; m = ceil(N / n):
    1. node_comm  Reduce_scatter_block  (n, m) -> (m,)  local rank j gets chunk j of its node's sum (zero padded)
    2. cross_comm Allreduce             (m,)            chunk j summed over the k nodes: now the global sum
    3. node_comm  Allgather             (m,) -> (n, m)  every rank of the node gets all n chunks back
The result equals one flat Allreduce up to the order of the additions, and it is bit-identical on every rank
(step 3 copies the same chunks everywhere), so data-parallel replicas stay identical.

Bytes, one call per rank; s = itemsize, Bp = n * m * s (the buffer padded to a multiple of n). CommStats records
(`hier_formula`):   ("<name>-node", "Reduce_scatter_block"): Bp,   ("<name>-cross", "Allreduce"): Bp / n,
                    ("<name>-node", "Allgather"): Bp.
Bytes that cross node boundaries (`cross_node_bytes`; ring algorithms, consecutive placement):
    hierarchical: only step 2 leaves the node; each rank sends 2 (k-1)/k * Bp/n of it, on its own link.
    flat ring over all P ranks: each rank sends 2 (P-1)/P * B to its neighbour; in every node exactly one rank's
    neighbour is on another node, so that one link carries about twice the *whole* buffer.
Per node the totals are about the same (~2 B); the gain is that the hierarchical version spreads them over n
links in parallel (one NIC per GPU) and takes 2 (k-1) slow-network steps instead of 2 (P-1).

The ring costs above are those of Thakur, Rabenseifner and Gropp 2005 ("Optimization of Collective Communication
Operations in MPICH"): a ring Allreduce sends 2 (P-1)/P of the buffer per rank, a ring Reduce-scatter or Allgather
(P-1)/P of it.
Left out: overlapping the steps with the backward pass, and pipelining chunks of a large buffer.
"""
import numbers

from mpi4py import MPI

from hsgd.model.backend import array_module
from hsgd.grid.comm import Comm
from hsgd.model.config import divisors
from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes, numel_of
from hsgd.errors import ConfigError


def node_split(comm, ranks_per_node=None):
    """(node_comm, cross_comm): Comms named "<name>-node", "<name>-cross" sharing comm's CommStats. Collective."""
    P = comm.size
    if ranks_per_node is None:                            # the real nodes, from MPI's shared-memory split
        shm = comm.comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        leader = shm.allreduce(comm.rank, op=MPI.MIN)     # a node's name: its lowest rank in comm
        local = shm.Get_rank()                            # node-local rank, in the order of comm's ranks
        shm.Free()
        leaders = comm.allgather_obj(leader)              # metadata: which node every rank is on
        sizes = sorted((leaders.count(x) for x in set(leaders)), reverse=True)
        if len(set(sizes)) != 1:
            raise ConfigError(f"the shared-memory split of the {P} ranks of '{comm.name}' gives nodes of sizes "
                              f"{sizes}; the hierarchical all-reduce needs equal nodes: launch the same number of "
                              f"ranks on every node, or pass ranks_per_node, one of {divisors(P)}")
        node = sorted(set(leaders)).index(leader)
    else:
        n = ranks_per_node
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 or P % n:
            raise ConfigError(f"ranks_per_node={n!r} does not split the {P} ranks of '{comm.name}' into equal "
                              f"nodes; use a divisor of {P}: {divisors(P)}")
        node, local = comm.rank // n, comm.rank % n       # consecutive ranks share a node
    node_comm = Comm(comm.comm.Split(color=node, key=local), f"{comm.name}-node", comm.stats, comm.check)
    cross_comm = Comm(comm.comm.Split(color=local, key=node), f"{comm.name}-cross", comm.stats, comm.check)
    return node_comm, cross_comm


def hier_buffers(flat, n):
    """Preallocated (pad, chunk) for a flat array of this size on nodes of n ranks; pad is None if n divides N."""
    xp = array_module(flat)
    m = -(-flat.size // n)                                                   # ceil(N / n)
    pad = None if flat.size == n * m else xp.zeros(n * m, dtype=flat.dtype)  # (n*m,)
    return pad, xp.empty(m, dtype=flat.dtype)                                # (m,)


def hierarchical_allreduce(flat, node_comm, cross_comm, buffers=None):
    """In place: flat <- sum over all ranks of node_comm x cross_comm. flat: (N,) C-contiguous."""
    if flat.ndim != 1 or not flat.flags.c_contiguous:
        raise ValueError(f"hierarchical_allreduce needs a flat C-contiguous array, got shape {flat.shape}")
    n, N = node_comm.size, flat.size
    pad, chunk = buffers if buffers is not None else hier_buffers(flat, n)
    m = chunk.size
    if pad is None:
        full = flat.reshape(n, m)                         # (n, m): a view, the result lands in flat directly
    else:
        full = pad.reshape(n, m)                          # (n, m): flat, then zeros
        pad[:N] = flat
        pad[N:] = 0
    node_comm.Reduce_scatter_block(full, chunk)           # (m,) chunk `local` of this node's sum
    cross_comm.Allreduce(chunk)                           # (m,) ... summed over the nodes: 1/n of flat leaves
    node_comm.Allgather(chunk, full)                      # (n, m) every chunk back to every rank of the node
    if pad is not None:
        flat[:] = pad[:N]
    return flat


def hier_formula(nbytes, ranks_per_node, n_nodes, itemsize, name="dp"):
    """{(comm name, op): (calls, payload bytes)} of one hierarchical_allreduce of nbytes, as CommStats records it."""
    n = ranks_per_node
    m = -(-(nbytes // itemsize) // n)                     # chunk elements, ceil(N / n)
    return {(f"{name}-node", "Reduce_scatter_block"): (1, n * m * itemsize),
            (f"{name}-cross", "Allreduce"): (1, m * itemsize),
            (f"{name}-node", "Allgather"): (1, n * m * itemsize)}


def cross_node_bytes(nbytes, ranks_per_node, n_nodes, itemsize):
    """Bytes sent across node boundaries by one rank, ring algorithms, consecutive placement (see the docstring):
    "hier": every rank, step 2 only; "flat_ring": the one rank per node whose ring neighbour is on the next node."""
    n, k = ranks_per_node, n_nodes
    P, m = n * k, -(-(nbytes // itemsize) // n)
    return {"hier": 2 * (k - 1) * m * itemsize / k, "flat_ring": 2 * (P - 1) * nbytes / P if k > 1 else 0.0}


class HierarchicalSizes(AllreduceSizes):
    """The hierarchical exchange from sizes: nodes of ranks_per_node consecutive dp ranks (hier_formula's bytes)."""

    def __init__(self, numel, itemsize, dp_size, ranks_per_node, name="dp"):
        super().__init__(numel, itemsize, dp_size, name)
        if not ranks_per_node or dp_size % ranks_per_node:
            raise ConfigError(f"ranks_per_node={ranks_per_node!r} does not split the {dp_size} dp ranks into equal "
                              f"nodes; give one of {divisors(dp_size)}")
        self.ranks_per_node, self.n_nodes = ranks_per_node, dp_size // ranks_per_node

    def formula(self):
        return hier_formula(self.size * self.itemsize, self.ranks_per_node, self.n_nodes, self.itemsize,
                            self.dp_name)

    def memory_formula(self):
        """The plain exchange's buffers, and the scratch of hierarchical_allreduce: the chunk (m,), m = ceil(size
        / n), and the padded copy (n m,) unless n divides size."""
        out, n, s = super().memory_formula(), self.ranks_per_node, self.itemsize
        m = -(-self.size // n)
        out["comm"] = (m + (n * m if n * m != self.size else 0)) * s
        return out

    def comms(self):
        return {f"{self.dp_name}-node": self.ranks_per_node, f"{self.dp_name}-cross": self.n_nodes}

    def describe(self):
        return (f"hierarchical: {self.ranks_per_node} dp ranks per node x {self.n_nodes} nodes "
                "(node Reduce_scatter_block, cross-node Allreduce, node Allgather)")


class HierarchicalExchange(AllreduceExchange):
    """The gradient exchange of --hierarchical: g <- (1/dp) * sum over dp_comm of g, in the three steps of
    hierarchical_allreduce over the node and cross-node communicators that node_split builds from dp_comm."""

    def __init__(self, params, groups, dp_comm, ranks_per_node=None):
        self.node_comm, self.cross_comm = node_split(dp_comm, ranks_per_node)
        super().__init__(params, groups, dp_comm, HierarchicalSizes(*numel_of(params, groups), dp_comm.size,
                                                                     self.node_comm.size, dp_comm.name))
        self.scratch = hier_buffers(self.buf.flat, self.node_comm.size)      # (pad, chunk), allocated once

    def average(self):
        """My gradient (rounded to --reduce-dtype as it leaves), node / cross / node, then / dp."""
        hierarchical_allreduce(self.num.reduced(self.buf.flat), self.node_comm, self.cross_comm, self.scratch)
        if self.dp_comm.size > 1:
            self.buf.flat *= 1.0 / self.dp_comm.size

    def comms(self):
        return [self.node_comm, self.cross_comm]

    def free(self):
        self.close()
        if self.node_comm is not None:
            self.node_comm.free()
            self.cross_comm.free()
            self.node_comm = self.cross_comm = None
