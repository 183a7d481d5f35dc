"""Distributed checkpoints (the lecture's section 4.3): every (stage, tensor) position writes its own shards,
atomically, with checksums; they load under any layout. Chapter 11.

    store      save, open (checked first), load resharded, export the full model
    manifest   what a manifest must hold, checked before any of it is trusted
    runs       lines of runs in a save folder, the checkpoints it holds, and the lock that keeps a second job out
    state      a trainer's state by parameter name: the optimizer's flat state cut and put back
    __main__   python -m hsgd.checkpoint export | info
"""
