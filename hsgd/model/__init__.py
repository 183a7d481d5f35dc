"""The model on one process: the GPT-2-style decoder every layout computes, its layers as forward/backward pairs,
the serial reference every parallel run is checked against, and what one process needs around it. Chapter 1 (the
serial SGD of the lecture's section 1), appendix A (where the time goes), chapter 14 (the number formats), chapter 16
(experts).

    config      ModelConfig, the model's shape; `flag`, how a settings field becomes a command-line flag
    backend     the one place that picks NumPy or CuPy; device-to-host copies, counted
    threads     CPU threads for the kernels and the batch split; OpenBLAS's thread timeout
    layers      every layer as its plain formulas, a forward/backward pair each: the reference a reader checks
    llama_layers the Llama block's layers the same way: RMSNorm, rotary embedding, SwiGLU, grouped-query kv repeat
    moe         the mixture-of-experts layer the same way: router, top-k gates, capacity and drops, experts, the
                z-loss and the selection bias (checked alone and against Mixtral's block)
    balance     the load-balancing loss over a declared domain of tokens, over one block or many, and its share on
                a rank
    moe_pass    what one forward call's MoE blocks share: the balance loss, the rows routed together, the biases
    kernels     the same layers tuned (pieces, out=, threads, causal blocks), tested equal to them
    flash       attention that stores no scores: blocks, the online softmax, y and lse kept (FlashAttention);
                ring attention's blocks (hsgd.cp.ring) use it
    ops         the one place the models choose their layer functions (the tuned kernels)
    serial      the serial reference model and serial.sgd, the run every layout must reproduce
    gradcheck   finite differences: every hand-written backward checked against the loss itself
    optim       SGD, AdamW, the learning-rate schedule, global-norm clipping
    precision   bfloat16 and float16 emulated exactly: rounding, the unit roundoff, Numerics (where a run rounds);
                the 8-bit formats E4M3 and E5M2 (rounding only, saturating or not)
    data        the corpus, the train/validation split and the batch of every step
    generate    text from a trained model, one byte at a time
"""
