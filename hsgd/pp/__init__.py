"""Pipeline parallelism: the layers cut into pp stages (and v model chunks per stage), each DP group's batch into
m micro-batches that flow through them, and the schedules that order the work (the lecture's sections 1 and
4.2). Chapters 9 (stages, micro-batches, the bubble, GPipe and 1F1B) and 12 (schedules as data, interleaved,
zero bubble, the V and DualPipe).

    chunks      the cut: the blocks of every stage and chunk, their parameters, the bytes on pp_comm
    placement   which stage holds each piece of the model: the loop (piece c p + s), the V (pieces s, 2p-1-s),
                the dual (pieces s and p-1-s, each on two stages)
    actions     what a stage runs: Action (F, B, W of a micro-batch and chunk), Pair (an overlapped F&B)
    schedules   schedules as data: lists of actions (GPipe, 1F1B, interleaved, ZB-H1), checked, simulated
    vshape      the schedules of two chunks per stage: ZB-V, DualPipeV, DualPipe
    timelines   what a list or a timeline says: bubbles, pairs and bytes held, closed forms, pictures
    stage       one rank's stage running its list (ThreadedStage: the batch split over CPU threads)
    dual        DualPipe's stage: two copies of its pieces, their gradients summed with the twin stage's
    make        which of them a rank's layout needs
"""
