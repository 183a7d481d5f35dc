"""The gradient exchange of a run, made in this one place from the Exchange settings (--zero, --dp-overlap,
--hierarchical, --dp-staleness: at most one, checked by TrainConfig.validate; --zero 2|3 --hierarchical is hybrid
sharding; with --ep > 1 the folded exchange, hsgd.dp.folded): the exchange itself (make_exchange), or its sizes
alone (exchange_sizes: its formulas without an array or a communicator, for the planner). Chapter 8 runs every
one."""
from dataclasses import replace

from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes
from hsgd.dp.folded import FoldedExchange, PairedExchange
from hsgd.dp.hierarchical import HierarchicalExchange, HierarchicalSizes
from hsgd.dp.overlapped import OverlappedExchange, OverlappedSizes
from hsgd.dp.stale import StaleExchange, StaleSizes
from hsgd.dp.zero1 import Zero1Exchange, Zero1Sizes
from hsgd.dp.zero2 import Zero2Exchange, Zero2Sizes
from hsgd.dp.zero3 import Zero3Exchange, Zero3Sizes


def make_exchange(settings, params, groups, grid, micro_batches, num, wire=None):
    """This rank's exchange for the Exchange settings: params, groups its stage's parameter shards by gradient group
    (backward order), grid the ProcessGrid (its dp_comm), micro_batches per step (ZeRO 2 and 3 reduce-scatter each
    one's), num where it rounds (hsgd.model.precision.Numerics), wire how ZeRO 3 sends its groups (hsgd.dp.zero3.Wire;
    None: as they are)."""
    s = settings
    experts = {n for n in params if ".moe.experts." in n}
    if getattr(grid, "ep", 1) > 1 and experts:                        # experts averaged over their own ranks (a
        if s.zero or s.dp_overlap or s.dp_staleness or s.hierarchical:   # stage without any: the plain ways)
            # the experts' part: its edp_comm holds every ep-th rank of dp_comm, so ranks_per_node/ep of it share
            # a node (hsgd.ep.layout checks that ep divides ranks_per_node)
            se = replace(s, ranks_per_node=s.ranks_per_node // grid.ep if s.ranks_per_node else None)
            ex = PairedExchange(params, groups, grid, experts,
                                lambda p, g, comm: build(se if comm is grid.edp_comm else s, p, g, comm, micro_batches))
        else:
            ex = FoldedExchange(params, groups, grid.dp_comm, grid.edp_comm, grid.ep_comm, experts)
    else:
        ex = build(s, params, groups, grid.dp_comm, micro_batches, wire)
    ex.use(num)
    return ex


def build(s, params, groups, dp_comm, micro_batches, wire=None):
    """The exchange the settings s choose, averaging `params` over dp_comm (ZeRO 3: its groups sent by `wire`)."""
    if s.zero == 3:
        return Zero3Exchange(params, groups, dp_comm, micro_batches, hybrid=s.hierarchical,
                             ranks_per_node=s.ranks_per_node, wire=wire)
    if s.zero == 2:
        return Zero2Exchange(params, groups, dp_comm, micro_batches, hybrid=s.hierarchical,
                             ranks_per_node=s.ranks_per_node)
    if s.zero == 1:
        return Zero1Exchange(params, groups, dp_comm)
    if s.hierarchical:
        return HierarchicalExchange(params, groups, dp_comm, s.ranks_per_node)
    return (OverlappedExchange if s.dp_overlap else StaleExchange if s.dp_staleness else AllreduceExchange)(
        params, groups, dp_comm)


def exchange_sizes(settings, numel, itemsize, dp_size, micro_batches=1):
    """The sizes object (its formulas) of the exchange make_exchange would make for the Exchange settings, for a
    stage whose gradient groups have numel {group: elements} (backward order) of itemsize bytes, on a dp_comm of
    dp_size ranks (dp x cp). --hierarchical needs settings.ranks_per_node here (no MPI to find the nodes)."""
    s = settings
    if s.zero >= 2:
        hybrid = s.ranks_per_node if s.hierarchical else None
        return (Zero2Sizes if s.zero == 2 else Zero3Sizes)(numel, itemsize, dp_size, micro_batches, hybrid)
    if s.zero == 1:
        return Zero1Sizes(numel, itemsize, dp_size)
    if s.hierarchical:
        return HierarchicalSizes(numel, itemsize, dp_size, s.ranks_per_node)
    return (OverlappedSizes if s.dp_overlap else StaleSizes if s.dp_staleness else AllreduceSizes)(
        numel, itemsize, dp_size)
