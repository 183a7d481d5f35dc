"""Planning a run before it starts: which dp x pp x tp (and cp, ep, ZeRO, schedule, recomputation) on which machine,
will it fit, how fast (python -m hsgd.plan; the command line in hsgd/plan/__main__.py). Chapter 17.

    models      the presets (Narayanan et al.'s GPTs, GPT-2, Llama 3 8B/70B/405B, Mixtral 8x7B, hsgd's sizes in
                each arch) and --model's keys (sizes, arch, norm, positions, mlp, NKV, bias, tied)
    family      the block's family priced: its parameter formula, what a Megatron-style tp rank holds
    experts     a mixture-of-experts block priced: total and active parameters, a rank's E/ep experts, what the
                block keeps, its all-to-all
    hardware    hardware files (A100, H100, H200, this machine measured) and their checked loader
    calibrate   --calibrate: this machine's matmul rate, memory bandwidth and every collective's alpha and beta
    costs       the time model: alpha-beta collectives on the links each group crosses, matmuls, elementwise work,
                the pipeline's makespan, overlap where hsgd overlaps
    layout      what one rank of a planned layout holds and sends in hsgd (sizes only, equal to the trainer's)
    paper       Narayanan et al. 2021's Table 1 and formulas, Korthikanti 2022's (by family; flash or stored scores)
                and ZeRO's memory
    flags       the chosen layout as Megatron-LM's flags and torchtitan's TOML keys
    search      every layout that splits, dropped where it does not fit, best first
    validate    the planner against Table 1 of Narayanan et al. 2021
    __main__    python -m hsgd.plan
"""
