"""FP8 training, emulated exactly: matrix products on 8-bit operands, the scaling recipes, and the ranks each scale
is agreed over. Chapter 15.

    recipes     the scaling recipes as objects: delayed (amax history), tensorwise, rowwise, blockwise
    domains     over which ranks each operand's amax is reduced (declared per operand), and the check that every
                holder of a tensor's pieces casts with the same scale
    scaling     an FP8 run's state: the cast, the amax histories, the counts of overflows and underflows
    linear      the block's linear layers with FP8 products (forward, dgrad, wgrad), around the layer functions
    reference   the serial FP8 reference: serial SGD cast as a layout casts (the exact mode's oracle)
    traffic     the scales' collectives in one step, in closed form (the step formula's FP8 terms)
    accumulate  limited-precision accumulation of a product, promoted to float32 every N_c terms (DeepSeek-V3)
    codes       the 256 codes of E4M3 and E5M2: what an FP8 value travels as (one byte)

ZeRO-3 sending its weights as FP8 codes (--fp8-allgather) is hsgd.dp.fp8_gather's.

The formats themselves (E4M3, E5M2: rounding, saturating) are hsgd.model.precision's.
"""
