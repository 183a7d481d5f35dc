"""Distributed checkpoints (the lecture's section 4.3): every (stage, tensor) position writes its own shards,
atomically, with checksums; they load under any layout. Chapter 11.

    store      save (the trainer's state_dict by name), open (checked first), load resharded, export the model
    manifest   what a manifest must hold, checked before any of it is trusted
    runs       lines of runs in a save folder, the checkpoints it holds, and the lock that keeps a second job out
    resume     --resume: which checkpoint, opened and checked on every rank, loaded resharded
    __main__   python -m hsgd.checkpoint export | info
"""
