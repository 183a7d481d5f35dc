"""The ranks: the dp x pp x cp x tp process grid, its communicators (Split by color), every collective written out
and counted, and how a job of many ranks starts and ends. Chapters 2 (collectives) and 3 (ranks and communicators,
the lecture's P = G x M); chapter 21 for the devices.

    process_grid   ProcessGrid: the coordinates of every rank and a communicator per dimension
    comm           Comm: every collective on mpi4py's buffer methods, recorded (calls, bytes, seconds), checkable
    trace          a timeline of every rank's phases and collectives (a Chrome / Perfetto trace)
    launch         fail fast, never hang: usage errors said once, an exception on one rank ends every rank
    devices        the node-local rank, and the GPU it uses with --device gpu
    __main__       mpirun -n P python -m hsgd.grid --tp 2: the layout table of any sizes
"""
