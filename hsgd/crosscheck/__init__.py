"""Check another system's distributed gradients against hsgd's serial float64 reference, and name the bug
(chapter 20):

    python -m hsgd.crosscheck DIR          (DIR: a dump, hsgd/crosscheck/FORMAT.md)

hsgd.crosscheck.dump        the dump once read: Dump, its Tensors (to and from the reference's parameters), Shards
hsgd.crosscheck.read        load(DIR): reading a dump and checking every part against the others (DumpError)
hsgd.crosscheck.shards      a tensor's shards in layout.json: whole, along one axis, or boxes along several (FSDP x
                            TP), equal or disjoint and covering
hsgd.crosscheck.write       writing one (layout.json, the .npz files), a one-rank dump in PyTorch's storage, and one
                            of tp x dp ranks in any storage (write_sharded)
hsgd.crosscheck.manifest    dump.json, written last: a dump as one set of files of one run (check_set refuses an
                            incomplete or mixed folder; clean removes an earlier dump's files before writing)
hsgd.crosscheck.hsgd_dump   hsgd.train --dump-step N DIR: hsgd's own runs as dumps
hsgd.crosscheck.systems     other systems' storage of the model as a dump's tensors: Megatron-LM's names and fused
                            linear_qkv (per query group) and linear_fc1 ([gate_i | up_i] per rank), Hugging Face's,
                            torchtitan's (llama3, and 0.3's fused wqkv; q and k in rotary-pair order)
hsgd.crosscheck.safetensors a bounded safetensors reader (any of a dump's arrays may be NAME.safetensors) and writer
hsgd.crosscheck.dcp         a PyTorch Distributed Checkpoint folder read without unpickling anything but its
                            .metadata, and that only through PyTorch's reader for a caller that trusts it
hsgd.crosscheck.torch_save  one tensor of a DCP chunk as torch.save wrote it, read without unpickling
hsgd.crosscheck.from_dcp    python -m hsgd.crosscheck.from_dcp DIR --out DUMP: a DCP folder of one step as a dump
hsgd.crosscheck.classify    what kind of bug a wrong gradient shows: a constant factor, a permutation, padding,
                            a partial sum, fused parts swapped, a tied weight's part missing, or only rounding
hsgd.crosscheck.explain     why a failing gradient fails: what classify compares it with, gathered once, in order
hsgd.crosscheck.fused       a fused tensor searched as one: which blocks of q|k|v or gate|up moved where
hsgd.crosscheck.local       each data-parallel rank's own rows' gradient (what an unreduced gradient is)
hsgd.crosscheck.replicas    what each rank's shard of a failing gradient holds (the replica verdicts name ranks)
hsgd.crosscheck.experts     with experts: the reference counted as the layout counts (its micro-batches, each rank's
                            rows), and what an expert-parallel bug gives (experts averaged over the wrong group, the
                            balance loss over each rank's rows)
hsgd.crosscheck.__main__    the command: reassemble, reference, the per-parameter table, exit 0 / 1 / 2
"""
