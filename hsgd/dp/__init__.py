"""Data parallelism: the lecture's G groups, each on its own slice of the batch; the ranks holding the same shard
average its gradient over dp_comm (section 3.4), in one of several ways. Chapters 4 (why the average is serial
SGD) and 8 (overlap, ZeRO, hierarchical, stragglers and staleness); chapter 16 (experts) for the folded exchange.

    average       batch slices, flat buffers (FlatBuffer), the plain average over dp_comm, the replicas compared
    exchange      the gradient exchange's interface, and the plain one: one Allreduce after the backward pass;
                  every exchange's formulas as an object of sizes alone
    overlapped    one Iallreduce per layer's bucket, started during the backward pass
    hierarchical  reduce-scatter in the node, all-reduce across nodes, all-gather in the node
    stale         one step late: each step's exchange overlaps the whole next step
    zero1         ZeRO 1: reduce-scatter, the owned chunk's update, all-gather
    sharded       what ZeRO 2 and 3 share: each layer's gradient reduce-scattered during the backward pass
    zero2         ZeRO 2: gradients and optimizer state sharded, the parameters kept whole
    zero3         ZeRO 3: the parameters sharded too, gathered layer by layer (with zero2: hybrid sharding);
                  how a layer travels is a Wire
    fp8_gather    ZeRO 3's wire that sends the block linears' weights as FP8 codes, one byte a value, with the
                  scale agreed over the shards first (--fp8-allgather; chapter 15)
    folded        with expert parallelism: the dense gradients averaged over dp_comm, the experts' over edp_comm
                  (one flat buffer for the plain exchange; two exchanges of a kind for ZeRO and overlap)
    make          the one place the exchange is made from the settings (or its sizes alone, for the planner)
"""
