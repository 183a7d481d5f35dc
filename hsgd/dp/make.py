"""The gradient exchange of a run, made in this one place from the settings: which class (exchange_class), the
exchange itself (make_exchange), or its sizes alone (sized_exchange). Chapter 8 runs every one."""
from hsgd.dp.exchange import AllreduceExchange
from hsgd.dp.hierarchical import HierarchicalExchange
from hsgd.dp.overlapped import OverlappedExchange
from hsgd.dp.sharded import ShardedExchange
from hsgd.dp.stale import StaleExchange
from hsgd.dp.zero1 import ZeroExchange


def exchange_class(tc):
    """The class make_exchange chooses for the settings tc (--zero, --dp-overlap, --hierarchical, --dp-staleness:
    at most one, checked by TrainConfig.validate; --zero 2|3 --hierarchical is hybrid sharding)."""
    return (ShardedExchange if tc.zero >= 2 else ZeroExchange if tc.zero else OverlappedExchange if tc.dp_overlap
            else HierarchicalExchange if tc.hierarchical else StaleExchange if tc.dp_staleness else AllreduceExchange)


def sized_exchange(tc, numel, itemsize, dp_size):
    """The exchange make_exchange would make for tc, holding its sizes only (no array, no communicator): its
    formula(), memory_formula(), param_bytes(), grad_bytes() and owned_numel() are those of the trainer's for a
    stage whose gradient groups have numel {group: elements} (backward order), itemsize bytes, dp_comm of dp_size
    ranks (dp x cp). --hierarchical needs tc.ranks_per_node here (no MPI to find the nodes)."""
    cls = exchange_class(tc)
    ex = cls.__new__(cls)                                             # no __init__: nothing is allocated
    ex.dp_comm = None
    ex.configure(tc, dp_size)
    ex.sizes(numel, itemsize, dp_size)
    return ex


def make_exchange(tc, params, groups, grid, tracer):
    """The one place the exchange is made from the settings (exchange_class says which).
    --straggler RANK:MS makes that rank sleep
    before every exchange, to show what synchronous SGD pays for one slow worker."""
    cls = exchange_class(tc)
    if cls is ShardedExchange:
        ex = cls(params, groups, grid.dp_comm, tc.zero, hybrid=tc.hierarchical,
                 ranks_per_node=tc.ranks_per_node, micro_batches=tc.micro_batches)
    elif cls is ZeroExchange:
        ex = cls(params, groups, grid.dp_comm, tc.zero)
    elif cls is HierarchicalExchange:
        ex = cls(params, groups, grid.dp_comm, tc.ranks_per_node)
    else:
        ex = cls(params, groups, grid.dp_comm)
    if tc.straggler and int(tc.straggler.split(":")[0]) == grid.rank:
        ex.delay, ex.tracer = int(tc.straggler.split(":")[1]) / 1000.0, tracer
    return ex
