"""The file format as data: tensor names and metadata keys, in one table.

Names that upstream GGUF knows come from the `gguf` package's own templates (`blk.{bid}.attn_q`); the
PowerInfer additions (the transposed down projection, the predictors, the sparse threshold) and hotcold's
own keys are written here once. Families, the loader, the budget walk and the converters all name tensors
through this module, so a typo is an AttributeError at import, not a missing tensor at load.

    tensor(ATTN_Q, 3)            -> "blk.3.attn_q.weight"
    tensor(FFN_UP, 3, expert=1)  -> "blk.3.ffn_up.1.weight"   (one tensor per expert)
    tensor(FFN_UP, 3, "bias")    -> "blk.3.ffn_up.bias"
    key(EMBEDDING_LENGTH, "llama") -> "llama.embedding_length"
"""

from __future__ import annotations

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

# --- tensors (templates without the .weight / .bias suffix) ---------------------------------------
TOKEN_EMBD = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]
POS_EMBD = TENSOR_NAMES[MODEL_TENSOR.POS_EMBD]
OUTPUT = TENSOR_NAMES[MODEL_TENSOR.OUTPUT]
OUTPUT_NORM = TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]
ROPE_FREQS = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS]  # Llama 3.1: per-dimension divisors of RoPE's frequencies
ROPE_FACTORS_LONG = TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_LONG]  # Phi-3 long-context variants (longrope)
ROPE_FACTORS_SHORT = TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_SHORT]
ATTN_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM]
ATTN_NORM_2 = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM_2]
ATTN_Q = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q]
ATTN_K = TENSOR_NAMES[MODEL_TENSOR.ATTN_K]
ATTN_V = TENSOR_NAMES[MODEL_TENSOR.ATTN_V]
ATTN_QKV = TENSOR_NAMES[MODEL_TENSOR.ATTN_QKV]
ATTN_OUT = TENSOR_NAMES[MODEL_TENSOR.ATTN_OUT]
ATTN_POST_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_POST_NORM]  # Gemma 3's sandwich norms: after attention,
FFN_POST_NORM = TENSOR_NAMES[MODEL_TENSOR.FFN_POST_NORM]  # and after the FFN, before each residual add
ATTN_Q_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q_NORM]  # Qwen3: an RMS norm over each head of q [Dh]
ATTN_K_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_K_NORM]
ATTN_SINKS = TENSOR_NAMES[MODEL_TENSOR.ATTN_SINKS]  # gpt-oss: a learned softmax logit per head [H]
FFN_NORM = TENSOR_NAMES[MODEL_TENSOR.FFN_NORM]
FFN_UP = TENSOR_NAMES[MODEL_TENSOR.FFN_UP]
FFN_GATE = TENSOR_NAMES[MODEL_TENSOR.FFN_GATE]
FFN_DOWN = TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN]
FFN_ROUTER = TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP]  # MoE router [E, D]
FFN_UP_EXPS = TENSOR_NAMES[MODEL_TENSOR.FFN_UP_EXP]  # stacked experts [E, F, D]
FFN_GATE_EXPS = TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_EXP]
FFN_DOWN_EXPS = TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN_EXP]  # [E, D, F]
# PowerInfer's sparse layout
FFN_DOWN_T = "blk.{bid}.ffn_down_t"  # [F, D]: row i = neuron i's output direction
PRED_FC1 = "blk.{bid}.fc1"  # predictor [R, D]
PRED_FC2 = "blk.{bid}.fc2"  # predictor [F, R]
# the hot-neuron placement cache (.generated.gpuidx)
GPU_IDX = "blk.{bid}.gpu_idx"
GPU_BUCKET = "blk.{bid}.gpu_bucket"

# the FFN's matrices, for classifying a layer's tensors (budget walk, quantizer)
FFN_MATRICES = (FFN_UP, FFN_GATE, FFN_DOWN, FFN_DOWN_T, FFN_UP_EXPS, FFN_GATE_EXPS, FFN_DOWN_EXPS)
PREDICTOR_MATRICES = (PRED_FC1, PRED_FC2)


def tensor(
    template: str, bid: int | None = None, suffix: str = "weight", *, expert: int | None = None
) -> str:
    """A tensor's full name: template filled with the block id, optional expert index, then the suffix."""
    name = template.format(bid=bid) if "{bid}" in template else template
    if expert is not None:
        name = f"{name}.{expert}"
    return f"{name}.{suffix}"


def bare(template: str, bid: int | None = None) -> str:
    """A tensor name without a .weight/.bias suffix, as PowerInfer names the placement cache's tensors:
    bare(GPU_IDX, 3) -> "blk.3.gpu_idx"."""
    return template.format(bid=bid) if "{bid}" in template else template


def template_of(name: str, templates: tuple[str, ...]) -> str | None:
    """Which of `templates` the full tensor name `name` was made from (any block, expert or suffix)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blk":
        return None
    stem = parts[2]
    for t in templates:
        if t.split(".")[-1] == stem:
            return t
    return None


def block_of(name: str) -> int | None:
    """The block id of a `blk.N.*` tensor name, else None."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


# --- metadata keys ---------------------------------------------------------------------------------
ARCHITECTURE = Keys.General.ARCHITECTURE
NAME = Keys.General.NAME
FILE_TYPE = Keys.General.FILE_TYPE
CONTEXT_LENGTH = Keys.LLM.CONTEXT_LENGTH
EMBEDDING_LENGTH = Keys.LLM.EMBEDDING_LENGTH
BLOCK_COUNT = Keys.LLM.BLOCK_COUNT
FEED_FORWARD_LENGTH = Keys.LLM.FEED_FORWARD_LENGTH
VOCAB_SIZE = Keys.LLM.VOCAB_SIZE
EXPERT_COUNT = Keys.LLM.EXPERT_COUNT
EXPERT_USED_COUNT = Keys.LLM.EXPERT_USED_COUNT
EXPERT_FEED_FORWARD_LENGTH = Keys.LLM.EXPERT_FEED_FORWARD_LENGTH  # Qwen3-MoE: an expert's width
HEAD_COUNT = Keys.Attention.HEAD_COUNT
HEAD_COUNT_KV = Keys.Attention.HEAD_COUNT_KV
KEY_LENGTH = Keys.Attention.KEY_LENGTH
LAYERNORM_EPS = Keys.Attention.LAYERNORM_EPS
LAYERNORM_RMS_EPS = Keys.Attention.LAYERNORM_RMS_EPS
SLIDING_WINDOW = Keys.Attention.SLIDING_WINDOW
ROPE_DIMENSION_COUNT = Keys.Rope.DIMENSION_COUNT
ROPE_FREQ_BASE = Keys.Rope.FREQ_BASE
ROPE_SCALING_TYPE = Keys.Rope.SCALING_TYPE
ROPE_SCALING_FACTOR = Keys.Rope.SCALING_FACTOR
ROPE_SCALING_ORIG_CTX_LEN = Keys.Rope.SCALING_ORIG_CTX_LEN
ROPE_SCALING_ATTN_FACTOR = Keys.Rope.SCALING_ATTN_FACTOR  # longrope / YaRN: cos and sin scaled by it
ROPE_FREQ_BASE_SWA = Keys.Rope.FREQ_BASE_SWA  # the sliding-window layers' RoPE base (Gemma 3)
ATTN_LOGIT_SOFTCAPPING = Keys.LLM.ATTN_LOGIT_SOFTCAPPING  # Gemma 2: q.k scores capped by c * tanh(s / c)
FINAL_LOGIT_SOFTCAPPING = Keys.LLM.FINAL_LOGIT_SOFTCAPPING  # and the output logits likewise
ROPE_SCALING_YARN_BETA_FAST = Keys.Rope.SCALING_YARN_BETA_FAST  # written by upstream's converter (YaRN);
ROPE_SCALING_YARN_BETA_SLOW = Keys.Rope.SCALING_YARN_BETA_SLOW  # llama.cpp runs gpt-oss with its own 32 / 1
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"  # older llama.cpp files
# PowerInfer's and hotcold's own keys (other readers ignore them)
SPARSE_THRESHOLD = "powerinfer.sparse_threshold"
FFN_ACTIVATION = "hotcold.ffn_activation"  # "relu" on a dense file converted from a ReLU checkpoint
FFN_KIND = "hotcold.ffn_kind"  # "gated_both": act(gate) * act(up) (TurboSparse dReLU)
# more upstream keys the converters write
QUANTIZATION_VERSION = Keys.General.QUANTIZATION_VERSION
VALUE_LENGTH = Keys.Attention.VALUE_LENGTH
TENSOR_DATA_LAYOUT = Keys.LLM.TENSOR_DATA_LAYOUT  # Falcon: "jploski" (fused qkv as all q, all k, all v)
# the placement cache (.generated.gpuidx): PowerInfer's arch and key, then what hotcold solved it from
GPU_INDEX_ARCH = "generic.gpu_index"  # its block count is key(BLOCK_COUNT, GPU_INDEX_ARCH)
VRAM_CAPACITY = "split.vram_capacity"  # u64: bytes the solver was given for hot neurons
HOTCOLD_PREFIX = "hotcold."  # every hotcold key starts so; the cache keeps them all as its source signature
# `hotcold sparsify` (training-free activation sparsity for SwiGLU files: sparse/thresholded.py)
SPARSIFY_METHOD = "hotcold.sparsify.method"  # "cats": |silu(gate)|; "wina": |silu(gate)| * |down_t row|
SPARSIFY_SPARSITY = "hotcold.sparsify.sparsity"  # f32: the target the file was calibrated for
SPARSIFY_THRESHOLDS = "hotcold.sparsify.thresholds"  # f32 [L]: each layer's threshold at that target
SPARSIFY_GRID = "hotcold.sparsify.grid"  # f32 [G]: sparsity levels of the quantile table, 0 .. 1
SPARSIFY_TOKENS = "hotcold.sparsify.calibration_tokens"  # u32: tokens the statistics were taken on
SPARSIFY_QUANTILES = "hotcold.sparsify.quantiles"  # tensor F32 [L, G]: score quantiles at the grid levels
SPARSIFY_FREQUENCY = "hotcold.sparsify.frequency"  # tensor F32 [L, F]: share of tokens keeping neuron i
SPARSIFY_SCALE = "hotcold.sparsify.scale"  # tensor F32 [L, F]: per-neuron score weight (wina only)
FFN_GATE_PROBE = "blk.{bid}.ffn_gate_probe"  # [F, D] Q4_0 copy of ffn_gate: the mask's score, read whole
# [F, D] copies of ffn_up / ffn_gate in the transposes' type where that differs from theirs: the rows a decode
# token gathers (the gate's only with a gate probe); the originals then serve the dense products, packed
FFN_UP_ROWS = "blk.{bid}.ffn_up_rows"
FFN_GATE_ROWS = "blk.{bid}.ffn_gate_rows"
# `hotcold sparsify --attention`: input sparsity of the attention products (sparse/attention_inputs.py)
ATTN_QKV_T = "blk.{bid}.attn_qkv_t"  # [D, q + k + v]: row i = input channel i's q, k, v directions
ATTN_OUT_T = "blk.{bid}.attn_output_t"  # [H*Dh, D]: attn_output transposed
SPARSIFY_ATTN_QUANTILES = "hotcold.sparsify.attn_quantiles"  # tensor F32 [L, 2, G]: q/k/v input, o input
SPARSIFY_ATTN_SCALE_QKV = "hotcold.sparsify.attn_scale_qkv"  # tensor F32 [L, D]: wina channel weights
SPARSIFY_ATTN_SCALE_O = "hotcold.sparsify.attn_scale_o"  # tensor F32 [L, H*Dh]
# `hotcold sparsify --gate-probe inputs`: the gate from the FFN input's kept channels (sparse/thresholded.py)
FFN_GATE_T = "blk.{bid}.ffn_gate_t"  # [D, F]: ffn_gate transposed
SPARSIFY_GATE_IN_QUANTILES = "hotcold.sparsify.gate_in_quantiles"  # tensor F32 [L, G]
SPARSIFY_GATE_IN_SCALE = "hotcold.sparsify.gate_in_scale"  # tensor F32 [L, D]: wina channel weights
MODEL_SIZE = "hotcold.model_size"
MODEL_MTIME_NS = "hotcold.model_mtime_ns"
ACTIVATION_SHA256 = "hotcold.activation_sha256"


def key(template: str, arch: str) -> str:
    """A per-architecture metadata key: key(EMBEDDING_LENGTH, "llama") -> "llama.embedding_length"."""
    return template.format(arch=arch)


# --- the FFN rules shared by the reader (config.py) and the writers (convert/) ----------------------
ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")  # gelu_tanh: the tanh approximation (Gemma)
FFN_KINDS = ("gated", "gated_both", "plain", "swiglu_oai")


def default_activation(arch: str, *, sparse: bool) -> str:
    """The activation a file implies when it does not declare one (`hotcold.ffn_activation`): PowerInfer files,
    bamboo and OPT are ReLU; a dense Falcon is GELU; a dense llama/mistral/mixtral is SiLU, as in llama.cpp."""
    if sparse or arch in ("bamboo", "opt"):
        return "relu"
    if arch == "falcon":
        return "gelu"
    if arch in ("gemma2", "gemma3"):
        return "gelu_tanh"
    return "silu"


def ffn_kind(arch: str, declared: str | None) -> str:
    """How a family combines its projections: gated act(gate)*up (llama, mistral, mixtral), gated_both
    act(gate)*act(up) (bamboo, TurboSparse dReLU via `hotcold.ffn_kind`), plain act(up + b) (falcon, opt),
    swiglu_oai (gpt-oss's clamped SwiGLU, llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: sparse/ffn_weights.swiglu_oai)."""
    if arch in ("falcon", "opt"):
        return "plain"
    if arch == "gpt-oss":
        return "swiglu_oai"
    if arch == "bamboo" or declared == "gated_both":
        return "gated_both"
    return "gated"
