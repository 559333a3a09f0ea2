"""Methods by name: smoothing transforms run first, then one weight quantizer, per block."""
from . import awq, gptq, rtn, smoothquant

# name -> fn(block, recipe): rescales float weights in place and folds the inverse into the previous op
SMOOTHING = {"awq": awq.smooth_block, "smoothquant": smoothquant.smooth_block}
# name -> fn(block, recipe): replaces each targeted Linear by a QuantLinear, records block.errors
WEIGHTS = {"rtn": rtn.quantize_block, "gptq": gptq.quantize_block}
