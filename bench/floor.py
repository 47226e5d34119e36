"""The bytes one decode step reads, and the floor they set: by weight format (bf16, int8, q4
with its scales), the lm_head, the norms, a MoE layer's router and top-k experts, and the KV
cache at a visible length; the floor is those bytes over the measured copy bandwidth."""
from __future__ import annotations

from onegraph.config import ModelConfig

WEIGHT_FORMATS = ("bf16", "int8", "q4")
Q4_GROUP = 32          # q4: one scale per 32 consecutive weights of a row
Q4_SCALE_BYTES = 1     # the library stores a q4 scale as one e5m3 byte (runtime/quant.py)
NORM_VECTOR_BYTES = 4  # RMSNorm weights are fp32 on the device
KV_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
KV_SCALE_BYTES = {"fp32": 0, "bf16": 0, "int8": 4}  # int8: one fp32 scale per (token, KV head)


def matrix_bytes(rows: int, cols: int, fmt: str = "bf16", q4_scale_bytes: int = 4) -> int:
    """Bytes of a [rows, cols] weight matrix in `fmt`: bf16 2 bytes/weight; int8 1 byte/weight
    + an fp32 scale per row; q4 half a byte/weight + a scale (fp32 = 4, bf16 = 2, e5m3 = 1 byte) per
    group of Q4_GROUP weights (a row's last group padded)."""
    if fmt == "bf16":
        return 2 * rows * cols
    if fmt == "int8":
        return rows * cols + 4 * rows
    if fmt == "q4":
        groups = rows * -(-cols // Q4_GROUP)
        return groups * (Q4_GROUP // 2 + q4_scale_bytes)
    raise ValueError(f"weight format {fmt!r} is not one of {WEIGHT_FORMATS}")


def weight_bytes_per_token(c: ModelConfig, fmt: str = "bf16", lm_head_fmt: str | None = None,
                           q4_scale_bytes: int = Q4_SCALE_BYTES, quantize: str = "all") -> dict[str, int]:
    """Weight bytes one decode step reads, by part. The matrices `quantize` names ("all",
    "dense": attention and dense FFN, "experts") are in `fmt`, the others bf16; the lm_head in
    `lm_head_fmt` (default: `fmt`). The body gathers one bf16 embedding row (a tied model's
    quantized lm_head is a separate copy), so the table counts one row. MoE layers read the
    router (bf16 always: small, and routing decides everything after it) and the top-k
    experts only."""
    H = c.hidden_size
    lm_fmt = lm_head_fmt or fmt
    dense_fmt = fmt if quantize in ("all", "dense") else "bf16"
    experts_fmt = fmt if quantize in ("all", "experts") else "bf16"

    def mat(rows, cols, f=dense_fmt):
        return matrix_bytes(rows, cols, f, q4_scale_bytes)

    parts = {"embedding_row": mat(1, H, "bf16"), "attention": 0, "norms": 0, "router": 0, "ffn": 0}
    for layer in range(c.num_hidden_layers):
        parts["attention"] += mat(c.q_size + 2 * c.kv_size, H) + mat(H, c.q_size)
        parts["norms"] += NORM_VECTOR_BYTES * (2 * H + (2 * c.head_dim if c.has_qk_norm else 0))
        if c.is_moe_layer(layer):
            parts["router"] += mat(c.num_experts, H, "bf16")
            Im = c.moe_intermediate_size
            parts["ffn"] += c.num_experts_per_tok * (mat(2 * Im, H, experts_fmt) + mat(H, Im, experts_fmt))
        else:
            parts["ffn"] += mat(2 * c.intermediate_size, H) + mat(H, c.intermediate_size)
    parts["norms"] += NORM_VECTOR_BYTES * H
    parts["lm_head"] = mat(c.vocab_size, H, lm_fmt)
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(c: ModelConfig, kv: str, context: float) -> int:
    """Bytes of K and V (with int8 scales) the attention reads at a visible length of `context`
    rows, over all layers."""
    per_row = c.num_key_value_heads * (c.head_dim * KV_ELEMENT_BYTES[kv] + KV_SCALE_BYTES[kv])
    return round(2 * c.num_hidden_layers * context * per_row)


def mean_decode_context(prompt_len: int, n: int) -> float:
    """Mean visible length over n decode steps after a prompt: step i writes row prompt + i and
    attends over prompt + i + 1 rows."""
    return prompt_len + (n + 1) / 2


def bytes_per_token(c: ModelConfig, kv: str, context: float, fmt: str = "bf16",
                    quantize: str = "all", lm_head_fmt: str | None = None) -> dict:
    weights = weight_bytes_per_token(c, fmt, lm_head_fmt=lm_head_fmt or fmt, quantize=quantize)
    kv_read = kv_bytes_per_token(c, kv, context)
    label = weights_label(fmt, quantize, lm_head_fmt or fmt)
    return {"weights": weights, "weight_format": label, "kv_read": kv_read, "context": context,
            "total": weights["total"] + kv_read,
            "embedding_table_not_read": matrix_bytes(c.vocab_size - 1, c.hidden_size, "bf16")
            if not c.tie_word_embeddings else 0}


def weights_label(fmt: str, quantize: str = "all", lm_head_fmt: str | None = None) -> str:
    """"bf16" / "int8" / "q4" when every matrix has that format, else the classes spelled out."""
    from onegraph.quant import WeightScheme
    scheme = WeightScheme.make(fmt, quantize, (lm_head_fmt or fmt) != "bf16")
    return scheme.label()


def floor_fields(total_bytes: int, bandwidth: float | None, ms_per_token: float | None) -> dict:
    if not bandwidth:
        return {"floor_ms": None, "floor_tokens_per_s": None, "fraction_of_floor": None}
    floor_ms = total_bytes / bandwidth * 1e3
    return {"floor_ms": floor_ms, "floor_tokens_per_s": 1e3 / floor_ms,
            "fraction_of_floor": floor_ms / ms_per_token if ms_per_token else None}
