"""The chosen layout as the settings of two production trainers: Megatron-LM's command-line flags and torchtitan's
TOML keys, so that a plan can be run where hsgd cannot (python -m hsgd.plan prints both for its best layout).

Flag and key names were checked against the projects' sources, not copied from them:
  * Megatron-LM, megatron/training/arguments.py and the dataclasses its flags are made from (TransformerConfig,
    ModelParallelConfig), at the core_v0.15 line (August 2026): --tensor-model-parallel-size,
    --pipeline-model-parallel-size, --context-parallel-size, --sequence-parallel,
    --num-layers-per-virtual-pipeline-stage, --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
    (uneven stages), --recompute-granularity, --recompute-method, --recompute-num-layers,
    --use-distributed-optimizer (ZeRO-1), --use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads
    (ZeRO-2) or optim_grads_params (ZeRO-3), --overlap-grad-reduce, --normalization RMSNorm,
    --position-embedding-type rope, --rotary-base, --swiglu, --group-query-attention with --num-query-groups,
    --untie-embeddings-and-output-weights, --disable-bias-linear, --use-flash-attn, --attention-dropout,
    --hidden-dropout, --micro-batch-size, --global-batch-size, --bf16 with --grad-reduce-in-bf16 (the
    planner's 2-byte gradients); of its experts --num-experts,
    --moe-router-topk, --moe-layer-freq (an integer n: blocks 0, n, 2n, ... as hsgd's moe_every),
    --moe-expert-capacity-factor, --moe-token-dispatcher-type alltoall, --expert-model-parallel-size (folded out of
    dp x cp, its experts split over tp by default, as hsgd.plan.experts prices them). Its attention accepts fewer
    key/value heads than tp ranks (one head per rank, shared), as hsgd.plan.family prices it.
  * torchtitan, torchtitan/config/job_config.py as of February 2026 (the last release with TOML job files; later
    versions configure in Python with the same field names) and torchtitan/models/llama3 (flavors "8B", "70B",
    "405B" with Llama 3's sizes): [parallelism] data_parallel_replicate_degree, data_parallel_shard_degree,
    fsdp_reshard_after_forward, tensor_parallel_degree, pipeline_parallel_degree, pipeline_parallel_schedule
    ("1F1B", "Interleaved1F1B", "GPipe"; "ZBVZeroBubble" and "DualPipeV", the V schedules, whose name it hands to
    torch.distributed.pipelining's get_schedule_class and which place 2 stages of layers_per_stage layers on
    each rank, s and 2p-1-s), pipeline_parallel_layers_per_stage, pipeline_parallel_microbatch_size,
    context_parallel_degree, expert_parallel_degree; [activation_checkpoint] mode ("none", "selective", "full"),
    selective_ac_option;
    [training] local_batch_size, seq_len; [model] name, flavor.
What does not carry over is said in a comment line (#): Megatron-LM has no GPipe, ZB-H1, ZB-V, DualPipeV or
DualPipe schedule here (its flags run 1F1B, or for the V schedules its interleaved 1F1B on the same 2 chunks a
stage, placed in a loop); torchtitan has no ZB-H1 on one chunk a stage and no bidirectional DualPipe (two copies
of the model, micro-batches from both ends), always pairs tensor with sequence parallelism, has no ZeRO-1 (its
nearest is FSDP without resharding, ZeRO-2's memory) and builds only the llama3 block.
"""
from hsgd.cp.split import a2a_sizes

FLAVORS = {(32, 4096, 14336, 32, 8, 128256): "8B", (80, 8192, 28672, 64, 8, 128256): "70B",
           (126, 16384, 53248, 128, 8, 128256): "405B"}          # torchtitan's llama3 flavors, in Llama 3's sizes


def uneven(L, pp):
    """(first, last) layers of Megatron-LM's uneven pipeline when pp does not divide L: the first and last stages
    take f layers each and the pp - 2 others (L - 2f)/(pp - 2), the f nearest L/pp that makes that whole; None when
    no f does."""
    if pp < 3:
        return None
    fits = [f for f in range(1, L) if L - 2 * f > 0 and (L - 2 * f) % (pp - 2) == 0]
    return (min(fits, key=lambda f: abs(f - L / pp)),) * 2 if fits else None


# hsgd's --cp-scheme -> Megatron-LM's --cp-comm-type (p2p is its ring; a2a is Ulysses)
CP_COMM_TYPE = {"ring": "p2p", "allgather": "all_gather", "ulysses": "a2a", "a2a+p2p": "a2a+p2p"}


def megatron(cfg, lay, batch, dtype="bfloat16"):
    """Megatron-LM's flags for the model and layout: a list of lines, flags first, then '# ...' notes."""
    L, out, notes = cfg.n_layers, [], []
    out.append(f"--num-layers {L} --hidden-size {cfg.d_model} --ffn-hidden-size {cfg.d_ff} "
               f"--num-attention-heads {cfg.n_heads} --seq-length {cfg.seq_len} --max-position-embeddings "
               f"{cfg.seq_len}")
    fam = []
    if cfg.norm == "rmsnorm":
        fam.append("--normalization RMSNorm")
    theta = f"{cfg.rope_theta:.0f}" if cfg.rope_theta.is_integer() else f"{cfg.rope_theta:g}"   # (an int flag)
    fam.append(f"--position-embedding-type rope --rotary-base {theta}" if cfg.positions == "rope"
               else "--position-embedding-type learned_absolute")
    if cfg.mlp == "swiglu":
        fam.append("--swiglu")
    if cfg.n_kv_heads != cfg.n_heads:
        fam.append(f"--group-query-attention --num-query-groups {cfg.n_kv_heads}")
    if not cfg.tied:
        fam.append("--untie-embeddings-and-output-weights")
    if not cfg.bias:
        fam.append("--disable-bias-linear")
    if cfg.arch == "llama":
        fam.append("--attention-dropout 0 --hidden-dropout 0")
    if cfg.moe_experts:
        fam.append(f"--num-experts {cfg.moe_experts} --moe-router-topk {cfg.moe_top_k}")
        fam += [f"--moe-layer-freq {cfg.moe_every}"] if cfg.moe_every > 1 else []
        c = cfg.moe_capacity_factor
        fam += [f"--moe-expert-capacity-factor {c:g}"] if c is not None else []
        fam.append("--moe-token-dispatcher-type alltoall")
    out.append(" ".join(fam))
    par = [f"--tensor-model-parallel-size {lay.tp}", f"--pipeline-model-parallel-size {lay.pp}"]
    if lay.cp > 1:
        comm = CP_COMM_TYPE.get(lay.cp_scheme)
        par.append(f"--context-parallel-size {lay.cp}" + (f" --cp-comm-type {comm}" if comm else ""))
        if lay.cp_scheme == "a2a+p2p":                                  # the all-to-all's and the ring's sizes
            par.append("--hierarchical-context-parallel-sizes {} {}".format(*a2a_sizes(lay.cp)))
        if comm is None:
            notes.append(f"# hsgd's --cp-scheme {lay.cp_scheme} has no --cp-comm-type here: give Megatron-LM's own")
    if cfg.moe_experts:
        par.append(f"--expert-model-parallel-size {lay.ep}")
    if lay.tp_scheme == "sequence":
        par.append("--sequence-parallel")
    elif lay.ep > 1 and lay.tp > 1:
        notes.append("# Megatron-LM runs expert parallelism with tp > 1 only with --sequence-parallel")
    v = 1 if lay.schedule == "dualpipe" else lay.v                    # (dualpipe: 1F1B on one copy, below)
    if lay.pp > 1 and L % lay.pp:
        cut = uneven(L, lay.pp)
        if cut and v == 1:
            par.append(f"--decoder-first-pipeline-num-layers {cut[0]} --decoder-last-pipeline-num-layers {cut[1]}")
        else:
            chunks = f" x {v} chunks" if v > 1 else ""
            notes.append(f"# {L} layers do not split evenly over {lay.pp} stages{chunks}: give "
                         "--pipeline-model-parallel-layout")
    if v > 1 and L % (lay.pp * v) == 0:
        par.append(f"--num-layers-per-virtual-pipeline-stage {L // (lay.pp * v)}")
    if lay.pp > 1 and lay.schedule in ("gpipe", "zb-h1", "dualpipe"):
        notes.append(f"# Megatron-LM runs 1F1B in place of {lay.schedule}"
                     + (" (one copy of the model: each stage's L/pp layers once)" if lay.schedule == "dualpipe"
                        else ""))
    if lay.pp > 1 and lay.schedule in ("zb-v", "dualpipev"):
        notes.append(f"# Megatron-LM has no {lay.schedule} schedule: these flags run its interleaved 1F1B on the "
                     "same 2 chunks a stage, placed in a loop (stage s: chunks s and pp+s), not a V")
    par.append(f"--micro-batch-size {lay.b} --global-batch-size {batch}")
    if lay.recompute == "selective":
        par.append("--recompute-granularity selective")
    elif lay.recompute == "full":
        par.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    par.append({0: "", 1: "--use-distributed-optimizer",
                2: "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
                3: "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"}[lay.zero])
    if lay.dp_overlap:
        par.append("--overlap-grad-reduce")
    if lay.attention == "flash":
        par.append("--use-flash-attn")
    # the planner counts 2-byte gradients (ZeRO's 2 + 2 + 12 bytes a parameter, hsgd.plan.paper.model_states);
    # Megatron-LM keeps them in float32 under --bf16 (18 bytes) unless told to reduce them in bf16
    par.append({"bfloat16": "--bf16 --grad-reduce-in-bf16", "float16": "--fp16"}.get(dtype, ""))
    out.append(" ".join(p for p in par if p))
    return out + notes


def torchtitan(cfg, lay, batch):
    """torchtitan's TOML for the model and layout: a list of lines ([table], key = value, '# ...' notes)."""
    sizes = (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size)
    flavor = FLAVORS.get(sizes) if cfg.arch == "llama" and (cfg.norm, cfg.positions, cfg.mlp, cfg.bias,
                                                            cfg.tied) == ("rmsnorm", "rope", "swiglu", False,
                                                                          False) else None
    out = ["[model]", 'name = "llama3"']
    if flavor:
        out.append(f'flavor = "{flavor}"')
    elif cfg.arch == "llama":
        out.append("# no llama3 flavor has these sizes: add one (dim, n_layers, n_heads, n_kv_heads, the FFN width)")
    else:
        out.append(f"# torchtitan builds the llama3 block only, not {cfg.arch}'s")
    out += ["[training]", f"local_batch_size = {batch // lay.dp}", f"seq_len = {cfg.seq_len}", "[parallelism]"]
    if lay.zero == 0:
        out += [f"data_parallel_replicate_degree = {lay.dp}", "data_parallel_shard_degree = 1"]
    else:
        out += ["data_parallel_replicate_degree = 1", f"data_parallel_shard_degree = {lay.dp}"]
        if lay.zero < 3:
            out += ['fsdp_reshard_after_forward = "never"',
                    f"# ZeRO-{lay.zero}: torchtitan's nearest is FSDP that keeps the parameters gathered from the "
                    "forward to the backward (ZeRO-2's memory)"]
    out += [f"tensor_parallel_degree = {lay.tp}", f"context_parallel_degree = {lay.cp}",
            f"pipeline_parallel_degree = {lay.pp}"]
    if cfg.moe_experts:
        out += [f"expert_parallel_degree = {lay.ep}", "# torchtitan's llama3 has no experts: its MoE models (e.g. "
                "deepseek_v3) take this degree"]
    if lay.tp > 1 and lay.tp_scheme != "sequence":
        out.append("# torchtitan's tensor parallelism is always sequence-parallel too")
    if lay.pp > 1:
        sched = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe", "zb-v": "ZBVZeroBubble",
                 "dualpipev": "DualPipeV"}.get(lay.schedule)
        out.append(f'pipeline_parallel_schedule = "{sched}"' if sched else
                   "# torchtitan has no bidirectional DualPipe (two copies of the model, micro-batches from both "
                   'ends); its nearest is pipeline_parallel_schedule = "DualPipeV", the V on one copy'
                   if lay.schedule == "dualpipe" else f"# no torchtitan schedule is {lay.schedule}")
        if lay.v > 1 and lay.schedule != "dualpipe" and cfg.n_layers % (lay.pp * lay.v) == 0:
            out.append(f"pipeline_parallel_layers_per_stage = {cfg.n_layers // (lay.pp * lay.v)}")
        out.append(f"pipeline_parallel_microbatch_size = {lay.b}")
    out += ["[activation_checkpoint]", f'mode = "{lay.recompute}"']
    if lay.recompute == "selective":
        out.append('selective_ac_option = "op"')
    if lay.attention == "materialized":
        out.append("# torchtitan's attention is scaled_dot_product_attention (flash): no stored scores")
    return out
