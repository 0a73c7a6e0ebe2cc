"""Model FLOPs and MFU, against one table of dense peak throughputs (shared with the planner).

FLOPs per token = 6 x (weights of every matmul a token goes through, the output head included, the input
embedding lookup excluded; for a mixture of experts the router and top_k experts) + 6 x layers x heads x (q/k head
dim + v head dim) x seq_len (attention scores and values, forward + backward, no causal discount; 12 x ... x head_dim
where the two are equal) -- the PaLM / nanoGPT / torchtitan convention. With a sliding window a token attends to at
most window keys, so seq_len becomes min(seq_len, window) there. Biases and norms (q/k norms, multi-head latent
attention's latent norms) are not matmuls: they do not count. Multi-head latent attention counts its compressions and
up-projections as they run in training (keys and values up-projected per token; docs/mla.md).
"""

from __future__ import annotations

# Dense (no sparsity) peak TFLOP/s by compute dtype. Matched against the device name, first hit wins.
# float32 is the plain FP32 (non-tensor-core) rate: loom never enables TF32 (PyTorch's default leaves fp32 matmuls
# in full precision), so quoting an fp32 run against the TF32 tensor-core peak would understate its MFU ~7x.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # before H200: its name contains it
    ("H200 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # SXM
    ("H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # SXM
    ("H800", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0, "float32": 75.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("A800", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    ("A10G", {"bfloat16": 70.0, "float16": 70.0, "float32": 35.0}),
    ("RTX 4090", {"bfloat16": 165.0, "float16": 165.0, "float32": 82.6}),
    ("MI300X", {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4}),
]


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s for a device name (e.g. 'NVIDIA H100 80GB HBM3'), or None when unknown."""
    for key, table in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return table[dtype] * 1e12
    return None


def attention_matmul_params(args) -> int:
    """One block's attention weights: q/k/v/o of grouped-query attention, or multi-head latent attention's query
    (compressed or not), latent + RoPE key, per-head key/value up-projection and output."""
    if getattr(args, "attention_kind", "gqa") == "mla":
        heads, qk = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
        query = args.q_lora_rank * (args.dim + heads * qk) if args.q_lora_rank else args.dim * heads * qk
        latent = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
        up = args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim)
        return query + latent + up + heads * args.v_head_dim * args.dim
    hd = args.head_dim
    return args.dim * (args.n_heads * hd) * 2 + args.dim * (args.n_kv_heads * hd) * 2


def matmul_params(args) -> int:
    """Weights that take part in a matmul per token (embedding lookup excluded, head included): per block its
    attention and either its dense SwiGLU or its router, the top_k experts a token goes through and the shared
    experts (``args.moe_layer``: the MoE families keep some blocks dense); multi-token prediction modules
    (``mtp_depth``) add a block, their input projection and a pass through the head each."""
    attn = attention_matmul_params(args)
    dense = 3 * args.dim * args.ffn_dim
    experts = getattr(args, "moe_experts", 0)
    routed = (
        args.dim * experts
        + (args.moe_top_k + getattr(args, "moe_shared_experts", 0)) * 3 * args.dim * args.expert_ffn_dim
        if experts
        else dense
    )
    moe_layer = getattr(args, "moe_layer", lambda i: bool(experts))
    depth = getattr(args, "mtp_depth", 0)
    blocks = sum(attn + (routed if moe_layer(i) else dense) for i in range(args.n_layers + depth))
    return blocks + depth * 2 * args.dim * args.dim + (1 + depth) * args.dim * args.vocab_size


def flops_per_token(args, seq_len: int, adapter_params: int | None = None) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward, input gradient, weight gradient) plus attention. With
    ``adapter_params`` (LoRA: the base frozen) the base's weights cost 4 (no weight gradient) and the adapters 6."""
    window = getattr(args, "sliding_window", 0)
    context = min(seq_len, window) if window else seq_len  # keys a token attends to, at most
    weights = (
        6 * matmul_params(args) if adapter_params is None else 4 * matmul_params(args) + 6 * adapter_params
    )
    qk_v = args.head_dim + getattr(args, "value_head_dim", args.head_dim)  # scores over q/k, the sum over v
    layers = args.n_layers + getattr(args, "mtp_depth", 0)
    return weights + 6 * layers * args.n_heads * qk_v * context


def mfu(
    tokens_per_s_per_device: float, args, seq_len: int, peak: float | None, adapter_params: int | None = None
) -> float | None:
    if peak is None:
        return None
    return tokens_per_s_per_device * flops_per_token(args, seq_len, adapter_params) / peak


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_peak(device, dtype: str) -> float | None:
    """Peak FLOP/s for a torch.device: None on CPU or an unknown GPU (MFU is then not reported; see ``mfu_note``)."""
    return peak_flops(device_name(device), dtype) if device.type == "cuda" else None


def mfu_note(device, dtype: str) -> str:
    """The banner's note when MFU cannot be computed ('' when it can)."""
    if device_peak(device, dtype) is not None:
        return ""
    if device.type != "cuda":
        return f"MFU not reported on {device.type}"
    return (
        f"MFU not reported: no peak {dtype} throughput known for {device_name(device)!r} "
        "(loom.metrics.flops.PEAK_TFLOPS)"
    )
