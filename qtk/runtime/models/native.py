"""qtk's native forward over a packed, ragged batch (no padding), for the families in FAMILIES:
Llama 2/3, SmolLM, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm per head), Gemma 1-3 ((1 + w)
norms, GeGLU, Gemma 2/3's sandwich norms, soft-capping, alternating windows, Gemma 3's local and
global RoPE), Phi-3/4 (q/k/v and gate/up fused in the checkpoint, partial RoPE); Mixtral,
Qwen3-MoE and gpt-oss (sinks, alternating windows), their MoE blocks by models/moe.py.

    h = embed(tokens)                                             [T, hidden]   (Gemma: * sqrt(hidden))
    per layer:  x = norm(h); q, k, v = x Wq, x Wk, x Wv (+ bias)      [T, heads | kv_heads, D]
                (qk_norm: q, k = norm_head(q), norm_head(k))
                q, k = rope(q, k, positions)                          (the layer type's RoPE)
                a = Wo paged_attention(q, k, v, window, softcap, sinks)   (writes k, v to the cache)
                h = h + a                  (sandwich: h = h + norm(a))
                h = h + W_down (act(x W_gate) * x W_up),  x = norm(h)   (sandwich: norm(.) of the MLP too)
    logits = lm_head(norm(h)[last token of each sampling sequence])   (soft-capped where the config says)

norm is RMSNorm, scaling by w, or by (1 + w) in Gemma's families (Family.norm_offset); act is the
config's (SiLU, or Gemma's tanh GELU). The weights are those of the loaded Hugging Face model (a
float checkpoint, or one qtk's loader filled with QuantLinear layers): this module shares its
Linear / QuantLinear, norm and embedding modules, and reads each attention module's own scale,
soft-cap and sinks; its rotary module computes the frequencies for every RoPE scaling type the
config names, once at load for the longest sequence (`frozen_rope`). What is ours is the packing
and the paged attention, sliding windows included (`sliding_windows`). Adding a family is a row in
FAMILIES plus what is truly new about it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ... import hadamard
from ..attention import NO_TERMS, AttentionMetadata, KVCache, ScoreTerms, paged_attention
from ..packed_linear import rows_of
from . import moe


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # q_norm / k_norm over head_dim before RoPE (Qwen3, Gemma 3)
    norm_offset: bool = False  # RMSNorm scales by (1 + w) (Gemma 1-3)
    sandwich: bool = False  # a norm after attention and around the MLP too (Gemma 2/3: post_attention_layernorm
    # on the attention's output, pre_feedforward_layernorm / post_feedforward_layernorm around the MLP)


FAMILIES = {"llama": Family(), "mistral": Family(), "qwen2": Family(), "qwen3": Family(qk_norm=True),
            "gemma": Family(norm_offset=True), "gemma2": Family(norm_offset=True, sandwich=True),
            "gemma3_text": Family(qk_norm=True, norm_offset=True, sandwich=True), "phi3": Family(),
            "mixtral": Family(), "qwen3_moe": Family(qk_norm=True), "gpt_oss": Family()}  # MoE blocks: models/moe.py
# sibling projections the engine may fuse into one matmul (packed_linear.pack_linears); Phi-3's
# checkpoint holds them fused already, under these names
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the RMSNorm classes that compute transformers' LlamaRMSNorm (kernels/fused.py's formula)
LLAMA_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Phi3RMSNorm", "MixtralRMSNorm"}
# the config's MLP activation -> its GLU in torch (act(gate) * up) and the name of qtk's fused CPU op
GLU = {"silu": (lambda g, u: torch.nn.functional.silu(g) * u, "silu_and_mul"),
       "gelu_pytorch_tanh": (lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u, "gelu_tanh_and_mul")}
NO_W8A8_INPUTS = (None, None, None)  # a layer whose projections quantize their own input (_w8a8_inputs)


def activation(cfg) -> str:
    """The MLP's activation as the config names it (Gemma 2/3: hidden_activation)."""
    return getattr(cfg, "hidden_activation", None) or cfg.hidden_act


def sliding_windows(cfg) -> list[int | None]:
    """Per layer, the sliding window (a query sees its last `window` keys, itself included) or None,
    as transformers and vLLM read the config: with `layer_types` (Qwen2/Qwen3: use_sliding_window
    and max_window_layers; Gemma 2/3) on the layers of type "sliding_attention", else (Mistral,
    Phi-3) on every layer."""
    window, n = getattr(cfg, "sliding_window", None), cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def frozen_rope(rotary: nn.Module, max_positions: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary D/2], attention scaling) of transformers' rotary module for a sequence of
    max_positions tokens, fixed at load (layer_type: Gemma 3's module holds one RoPE per layer type).
    Per forward it picks them by that forward's last position ("longrope": short or long factors;
    "dynamic": grown past max_position_embeddings), which here would make a token's RoPE depend on
    the chunk and the batch it runs in, and differ from its cached keys'. vLLM fixes them at load too
    (longrope: the long factors where max_model_len > original_max_position_embeddings; the engine's
    max_model_len is at most max_positions)."""
    prefix, kw = ("", {}) if layer_type is None else (f"{layer_type}_", {"layer_type": layer_type})
    device = getattr(rotary, prefix + "inv_freq").device
    rotary(torch.zeros(1, device=device), torch.tensor([[max_positions - 1]], device=device), **kw)
    inv_freq = getattr(rotary, prefix + "inv_freq")
    return inv_freq.detach().float().clone(), getattr(rotary, prefix + "attention_scaling")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, heads, D] rotated in place over its first cos.shape[-1] dims (all of them but for a
    partial RoPE, as Phi-4-mini's); cos, sin [T, 1, rotary D]."""
    r = x[..., :cos.shape[-1]]
    r.copy_(r * cos + rotate_half(r) * sin)


class NativeModel(nn.Module):
    """The native forward of every family in FAMILIES (the Llama family's layout, each family's
    differences as its Family row and the modules' own attributes)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in FAMILIES:
            raise ValueError(f"the qtk runtime runs model_type {sorted(FAMILIES)}, not {cfg.model_type!r}")
        self.config = cfg
        self.family = FAMILIES[cfg.model_type]
        base = hf_model.model
        self.embed_tokens, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
        self.rotary_emb, self.lm_head = base.rotary_emb, hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.windows = sliding_windows(cfg)
        attns = self.attentions
        self.scales = [getattr(a, "scaling", self.head_dim ** -0.5) for a in attns]  # Gemma: query_pre_attn_scalar
        self.terms = [ScoreTerms(getattr(a, "attn_logit_softcapping", None), getattr(a, "sinks", None)) for a in attns]
        self.terms = [t if t else NO_TERMS for t in self.terms]
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.glu, self.glu_op = GLU.get(activation(cfg), (None, None))
        self.why_no_graphs = None if not any(self.terms) else (
            "attention soft-capping or sinks (the Triton decode kernel has neither)")  # else captured (cuda_graphs.py)
        self._frozen_ropes(cfg)
        self.cpu_ops = self._cpu_ops()
        if moe.install(self.layers, cfg, self.cpu_ops):  # each MoE layer's mlp now a SparseMoE over [T, H]
            self.why_no_graphs = moe.WHY_NO_GRAPHS
        self._plan = None  # per layer, the projections' callables (built at the first fused forward)
        self._quant_plan = None  # per layer, the W8A8 projections whose input comes quantized (with the plan)
        self.quantize_in_producers = True  # whether it does (False: each W8A8 layer quantizes its float32 input)
        self.glu_in_products = True  # a W8A8 gate_up's GLU in its kernel's epilogue where it can (read with the plan)
        self._bf16_rows = None  # rows from which a step runs all in bf16 between norms (with the plan)
        self._bf16_attention_rows = None  # rows from which a step's attention is bf16 without it (W8A8, bf16 checkpoint)
        self._step_bf16 = False  # whether the last step did (its logits follow: logits())
        self._triton_fusable = None  # whether _forward_triton applies (triton_fusable, decided at first use)
        self._decode, self._decode_caches, self._decode_rows_below = None, None, 0  # _decode_rows

    def _frozen_ropes(self, cfg) -> None:
        """The RoPE frequencies per layer (frozen_rope), as buffers rope_inv_freq_<type>: one type for
        most families, Gemma 3's "sliding_attention" (local base) and "full_attention" (global)."""
        per_type = isinstance(getattr(self.rotary_emb, "rope_type", None), dict)
        self.rope_types = list(cfg.layer_types) if per_type else [None] * cfg.num_hidden_layers
        self.rope_scaling = {}
        for t in dict.fromkeys(self.rope_types):
            inv_freq, self.rope_scaling[t] = frozen_rope(self.rotary_emb, cfg.max_position_embeddings, t)
            self.register_buffer(f"rope_inv_freq_{t}", inv_freq, persistent=False)
        self.rotary_dim = 2 * inv_freq.numel()  # < head_dim: a partial RoPE (Phi-4-mini)

    def _cpu_ops(self):
        """qtk's fused CPU ops (kernels/csrc/cpu_layers.cpp) for a float32 model on CPU whose MLP
        activation has its fused op, or None."""
        from ...kernels import cpu as cpu_kernels

        w = self.embed_tokens.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or self.glu_op is None:
            return None
        return cpu_kernels.ops()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def attentions(self) -> list[nn.Module]:
        """Per layer, the attention module (it owns the checkpoint's k_scale / v_scale)."""
        return [layer.self_attn for layer in self.layers]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """{layer type: (cos, sin) [T, rotary D]} of positions [T]: transformers' rotary forward over
        the frozen frequencies."""
        out = {}
        for t, scaling in self.rope_scaling.items():
            freqs = positions[:, None].float() * getattr(self, f"rope_inv_freq_{t}")  # [T, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            out[t] = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed)."""
        h = self.embed_tokens(input_ids)
        ropes = self.rope(positions, h.dtype)
        self._step_bf16 = False
        if self.cpu_ops is not None and meta.backend == "cpu":
            return self._forward_fused(h, ropes, meta, kv_caches)
        if meta.backend == "triton" and self.triton_fusable:
            return self._forward_triton(h, ropes, meta, kv_caches)
        ropes = {t: (cos[:, None, :], sin[:, None, :]) for t, (cos, sin) in ropes.items()}  # [T, 1, D]
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            a = self._attention(i, layer.self_attn, layer.input_layernorm(h), ropes[self.rope_types[i]], meta, cache)
            if self.family.sandwich:
                h = h + layer.post_attention_layernorm(a)
                h = h + layer.post_feedforward_layernorm(self._mlp(layer.mlp, layer.pre_feedforward_layernorm(h)))
            else:
                h = h + a
                h = h + self._mlp(layer.mlp, layer.post_attention_layernorm(h))
        return self.norm(h)

    @property
    def triton_fusable(self) -> bool:
        """Whether _forward_triton computes this model's forward: LlamaRMSNorm's formula in every norm
        (no Gemma offset or sandwich norms, no q/k norms), a full RoPE and SiLU's GLU."""
        if self._triton_fusable is None:
            norms = [self.norm, *(n for layer in self.layers for n in (layer.input_layernorm,
                                                                        layer.post_attention_layernorm))]
            self._triton_fusable = (not (self.family.norm_offset or self.family.sandwich or self.family.qk_norm)
                                    and self.glu_op == "silu_and_mul" and self.rotary_dim == self.head_dim
                                    and all(type(n).__name__ in LLAMA_RMS_NORMS for n in norms))
        return self._triton_fusable

    def _forward_triton(self, h, ropes, meta, kv_caches) -> torch.Tensor:
        """forward() on CUDA with kernels/fused.py: each residual add and the norm after it one
        kernel, RoPE on q and k one kernel, the GLU one kernel (eager torch runs 25-35 small kernels a
        layer); the projections and the attention as forward() runs them."""
        from ...kernels import fused

        norm = lambda m: (m.weight, getattr(m, "variance_epsilon", None) or m.eps)  # noqa: E731
        x = fused.rms_norm(h, *norm(self.layers[0].input_layernorm))
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            mlp = layer.mlp
            a = self._attention(i, layer.self_attn, x, ropes[self.rope_types[i]], meta, cache, fused)
            x = fused.add_rms_norm_(h, a, *norm(layer.post_attention_layernorm))
            if hasattr(mlp, "gate_up_proj"):
                m = mlp.down_proj(fused.silu_and_mul(mlp.gate_up_proj(x)))
            elif hasattr(mlp, "gate_proj"):
                m = mlp.down_proj(fused.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
            else:  # a MoE block (models/moe.py)
                m = mlp(x)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x = fused.add_rms_norm_(h, m, *norm(nxt))
        return x

    def _attention(self, i, attn, x, rope, meta, cache, fused=None) -> torch.Tensor:
        """The attention block's output (o_proj's). rope: (cos, sin) [T, 1, D] for models.native.rope_,
        or with `fused` (kernels/fused.py; no q/k norms) [T, D] for its rope_, which rotates q and k
        in the projections' output, side by side in qkv's rows."""
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if hasattr(attn, "qkv_proj"):  # fused by the engine, or in the checkpoint (Phi-3)
            y = attn.qkv_proj(x)
            if fused is not None:
                fused.rope_(y, *rope, H + KV)
            q, k, v = y.split([H * D, KV * D, KV * D], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            if fused is not None:
                fused.rope_(q, *rope, H)
                fused.rope_(k, *rope, KV)
        q, k, v = q.reshape(T, H, D), k.reshape(T, KV, D), v.reshape(T, KV, D)
        if fused is None:
            if self.family.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            rope_(q, *rope)
            rope_(k, *rope)
        o = paged_attention(q, k, v, cache, meta, self.scales[i], window=self.windows[i], terms=self.terms[i])
        return attn.o_proj(o.reshape(T, H * D))

    def _norm_weights(self, norm: nn.Module) -> tuple[torch.Tensor, float]:
        """(w, eps) of an RMSNorm for qtk's fused ops: its weight, or 1 + weight (Gemma)."""
        w = norm.weight.detach().float()
        eps = getattr(norm, "variance_epsilon", None) or norm.eps
        return ((1 + w) if self.family.norm_offset else w).contiguous(), eps

    def _forward_fused(self, h, ropes, meta, kv_caches) -> torch.Tensor:
        """forward() with qtk's fused CPU ops: the same math in a fifth of the calls. The residual
        stream h is added to and normalized in one op (add_rms_norm_), RoPE rotates q and k in
        place in the projection's output, the MLP's activation-and-multiply is one op; the
        projections qtk's kernel runs are called directly (a plan built once: at batch 1 a step is
        ~300 calls, and Python's module machinery would cost as much as the attention).
        A step of many rows whose every layer multiplies them in bf16 (_layer_plan's bf16 entry: a
        bf16 checkpoint on a CPU with bf16 units) keeps the activations between the norms and the
        matmuls in bf16: the norms write bf16, the residual adds the o and down projections' outputs
        as they are (bf16 from oneDNN, float32 from qtk's bf16 kernel for a decode batch), so only
        the qkv output (for RoPE, the cache and attention) and the attention output convert; the
        same numbers as converting around each matmul. A bf16 checkpoint whose layers are W8A8 attends in
        bf16 from as many rows (_w8a8_bf16_rows)."""
        ops = self.cpu_ops
        if self._plan is None:
            self._plan = [self._layer_plan(layer, getattr(ops, self.glu_op)) for layer in self.layers]
            glu_quant = getattr(ops, f"{self.glu_op}_quant", None)
            glu_act = self.glu_op.removesuffix("_and_mul") if self.glu_in_products else None
            self._quant_plan = [self._w8a8_inputs(layer, glu_quant, glu_act, ops.w8a8_quantize) for layer in self.layers]
            bf16_rows = [p[-1][0] for p in self._plan if p[-1] is not None]
            self._bf16_rows = max(bf16_rows) if len(bf16_rows) == len(self._plan) and not self.family.sandwich else None
            self._bf16_attention_rows = self._w8a8_bf16_rows()
            norm, layers = self._norm_weights, self.layers
            self._norms = [norm(layer.input_layernorm) for layer in layers] + [norm(self.norm)]
            self._post_norms = [norm(layer.post_attention_layernorm) for layer in layers]
            if self.family.sandwich:
                self._pre_ff_norms = [norm(layer.pre_feedforward_layernorm) for layer in layers]
                self._post_ff_norms = [norm(layer.post_feedforward_layernorm) for layer in layers]
        T, H, KV, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        rows = rows_of(h)  # T, or the rows of the plain step whose numerics this one keeps (numerics_of)
        if not meta.prefills and rows < self._decode_rows(kv_caches):  # the whole step in one call
            cos, sin = zip(*(ropes[t] for t in self.rope_scaling))
            return self._decode.forward(h, list(cos), list(sin), meta.block_tables, meta.decode_lens, meta.block_size,
                                        meta.slot_mapping)
        qk_norm, sandwich, norms, heads = self.family.qk_norm, self.family.sandwich, self._norms, [H, KV, KV]
        full_rope, glu = self.rotary_dim == D, getattr(ops, self.glu_op)
        bf16 = self._bf16_rows is not None and rows >= self._bf16_rows  # the whole step in bf16 between norms
        attention_bf16 = self._bf16_attention_rows is not None and rows >= self._bf16_attention_rows
        self._step_bf16 = bf16
        last = len(self.layers) - 1
        # W8A8 layers whose input the norm or GLU before them writes quantized (none in a bf16 step)
        quant = self._quant_plan if self.quantize_in_producers and not bf16 else [NO_W8A8_INPUTS] * (last + 1)
        first = quant[0][0]
        x = ops.rms_norm(h, *norms[0], bf16) if first is None else ops.rms_norm_quant(h, *norms[0], first[0])
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            qkv, q_proj, k_proj, v_proj, o_proj, gate_up, down, many_mlp, bf16_plan = self._plan[i]
            qkv_q, gate_up_q, down_q = quant[i]
            attn = layer.self_attn
            if bf16:
                y = bf16_plan[1](x).float()
                q, k, v = y.view(T, H + 2 * KV, D).split_with_sizes(heads, 1)
            elif qkv_q is not None:
                y = qkv_q[1](x)
                q, k, v = y.view(T, H + 2 * KV, D).split_with_sizes(heads, 1)
            elif qkv is not None:
                y = qkv(x)
                q, k, v = y.view(T, H + 2 * KV, D).split_with_sizes(heads, 1)  # views of y, one call
            else:
                q, k, v = q_proj(x).view(T, H, D), k_proj(x).view(T, KV, D), v_proj(x).view(T, KV, D)
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = ropes[self.rope_types[i]]
            if not full_rope:  # a partial RoPE: the first rotary_dim of each head, in torch
                rope_(q, cos[:, None], sin[:, None])
                rope_(k, cos[:, None], sin[:, None])
            elif (qkv is not None or bf16) and not qk_norm:  # q and k side by side in each row: one pass
                ops.rope_(y, cos, sin, H + KV)
            else:  # in place, through 2-D views
                ops.rope_(q.view(T, H * D), cos, sin, H)
                ops.rope_(k.view(T, KV * D), cos, sin, KV)
            many = many_mlp is not None and rows >= many_mlp[0]  # a step whose matmuls run in bf16 (bf16 implies it)
            o = paged_attention(q, k, v, cache, meta, self.scales[i], ops, self.windows[i], self.terms[i],
                                bf16=many or attention_bf16)
            if bf16:  # o and the MLP in bf16; the residual adds their bf16 outputs
                x = ops.add_rms_norm_(h, bf16_plan[2](o.view(T, H * D)), *self._post_norms[i], True)
                x = ops.add_rms_norm_(h, bf16_plan[3](x), *norms[i + 1], i < last)
                continue
            a = o_proj(o.view(T, H * D))
            norm = self._post_norms[i]
            if sandwich:
                a, norm = ops.rms_norm(a, *norm), self._pre_ff_norms[i]
            if gate_up_q is None:
                x = ops.add_rms_norm_(h, a, *norm)
            else:
                x = ops.add_rms_norm_quant_(h, a, *norm, gate_up_q[0])
            if many:  # prefill chunks: bf16 from gate_up to down
                m = many_mlp[1](x).float()
            elif gate_up is None:
                m = layer.mlp(x)
            else:
                g = gate_up(x) if gate_up_q is None else gate_up_q[1](x)
                m = down(glu(g)) if down_q is None else down_q[1](down_q[2](g, down_q[0]))
            if sandwich:
                m = ops.rms_norm(m, *self._post_ff_norms[i])
            nxt = quant[i + 1][0] if i < last else None  # the next layer's qkv
            if nxt is None:
                x = ops.add_rms_norm_(h, m, *norms[i + 1])
            else:
                x = ops.add_rms_norm_quant_(h, m, *norms[i + 1], nxt[0])
        return x

    def _decode_rows(self, kv_caches: list[KVCache]) -> int:
        """Rows below which a step of decodes only runs as one call of qtk's DecodeLayers
        (csrc/cpu_decode.cpp): the ops this forward would call, in its order, from C++. 0 where the model
        is not one it takes: every layer's q/k/v and gate/up joined, and all four projections on the
        weight-only kernel (int4, int8 or bf16 weights; a Hadamard rotation of the input allowed), with a
        full RoPE and no q/k norms or sandwich norms. The bound is the fewest rows at which some layer or
        the attention leaves the float32 kernels this forward uses below it (a bf16 step, oneDNN, qtk's bf16
        dot products). Built at the first call for these caches (a draft model's runner has its own)."""
        if self._decode_caches is kv_caches:
            return self._decode_rows_below
        self._decode, self._decode_caches, self._decode_rows_below = None, kv_caches, 0
        built = self._decode_layers(kv_caches)
        if built is not None:
            self._decode, self._decode_rows_below = built
        return self._decode_rows_below

    def drop_decode_layers(self) -> None:
        """Forget the one-call decode step (it holds its runner's KV caches): a new runner's first step builds
        its own."""
        self._decode, self._decode_caches, self._decode_rows_below = None, None, 0

    def _decode_layers(self, kv_caches: list[KVCache]):
        """(DecodeLayers, rows below which it computes this forward's step) or None (_decode_rows)."""
        from ..attention import _bytes
        from ..packed_linear import WOQLinear

        ops = self.cpu_ops
        if (self.family.qk_norm or self.family.sandwich or self.rotary_dim != self.head_dim
                or not hasattr(ops, "DecodeLayers")):
            return None
        bounds = [b for b in (self._bf16_rows, self._bf16_attention_rows) if b is not None]
        specs = []
        for layer in self.layers:
            mods = [getattr(layer.self_attn, "qkv_proj", None), getattr(layer.self_attn, "o_proj", None),
                    getattr(layer.mlp, "gate_up_proj", None), getattr(layer.mlp, "down_proj", None)]
            if not all(isinstance(m, WOQLinear) and m.runtime.perm is None for m in mods):
                return None
            bounds += [m.kernel_rows for m in mods if m.kernel_rows is not None]
            specs.append([(m.runtime.w.codes, m.runtime.w.scales, m.runtime.w.zs, m.runtime.bias, m.runtime.w.bits,
                           m.runtime.w.n, hadamard.of(m) or 0) for m in mods])
        bounds += [p[-2][0] for p in self._plan if p[-2] is not None]  # many_mlp: the MLP in bf16
        decode = ops.DecodeLayers(self.num_heads, self.num_kv_heads, self.head_dim, self.glu_op == "gelu_tanh_and_mul",
                                  [w for w, _ in self._norms], [eps for _, eps in self._norms])
        types = list(self.rope_scaling)
        for i, (spec, cache) in enumerate(zip(specs, kv_caches)):
            scales = (None, None) if not cache.quantized else (cache.k_scale.reshape(-1), cache.v_scale.reshape(-1))
            terms = self.terms[i]
            decode.add_layer(*spec, *self._post_norms[i], _bytes(cache.k), _bytes(cache.v), *scales, self.scales[i],
                             self.windows[i] or 0, terms.softcap or 0.0, terms.sinks, types.index(self.rope_types[i]))
        return decode, min(bounds, default=1 << 62)

    @staticmethod
    def _w8a8_inputs(layer, glu_quant, glu_act=None, quantize=None) -> tuple:
        """(qkv, gate_up, down) of a layer's W8A8 projections (packed_linear.W8A8Linear) whose input the op
        before them writes quantized, per token or with their static scale, as vLLM's fused norm + quant and
        GLU + quant kernels do (cpu_act_quant.h): each (static scale or None, f) (W8A8Linear.quantized_input),
        down's with the quantizing GLU third; None where not (another kind of layer, q/k/v apart, dynamic
        per-tensor scales, a GLU without a quantizing op, a MoE). The norms (rms_norm_quant,
        add_rms_norm_quant_) and the GLU (glu_quant) then quantize each row as they write it: the same codes
        as the layer's own quantization of their float32 rows, without those rows in memory (a float32
        [T, I] written, then read back to be quantized). glu_act ("silu", "gelu_tanh"): where gate_up can take
        the GLU in its kernel's epilogue (W8A8Linear.glu_of_quantized), its f gives act(gate) * up [T, I]
        and down's third is `quantize` (w8a8_quantize) instead: the same codes again, without gate_up's
        [T, 2I] output in memory (SmolLM2's W8A8 prefill: 12% off the MLP's first half)."""
        from ..packed_linear import W8A8Linear

        def quantized(m):  # not a layer whose input is rotated online: its input is the rotation's output
            return m.quantized_input() if isinstance(m, W8A8Linear) and hadamard.of(m) is None else None

        attn, mlp = layer.self_attn, layer.mlp
        gate_up = getattr(mlp, "gate_up_proj", None)
        if gate_up is None:
            return quantized(getattr(attn, "qkv_proj", None)), None, None
        down = quantized(getattr(mlp, "down_proj", None)) if glu_quant is not None else None
        qkv = quantized(getattr(attn, "qkv_proj", None))
        glu = gate_up.glu_of_quantized(glu_act) if down and glu_act and isinstance(gate_up, W8A8Linear) else None
        if glu is not None:
            return qkv, glu, (down[0], down[1], quantize)
        return qkv, quantized(gate_up), down and (down[0], down[1], glu_quant)

    def _w8a8_bf16_rows(self) -> int | None:
        """Rows from which a step of a bf16 checkpoint whose layers are W8A8 (packed_linear.W8A8Linear.bf16)
        attends in bf16, as a decode batch of a float bf16 checkpoint does (packed_linear.BF16_DOT_ROWS[0]):
        prefill chunks in qtk's bf16 flash kernel, decodes over the bf16 cache in its bf16 decode kernel;
        else None."""
        from ..packed_linear import BF16_DOT_ROWS, W8A8Linear

        w8a8 = [m for m in self.layers.modules() if isinstance(m, W8A8Linear)]
        return BF16_DOT_ROWS[0] if w8a8 and all(m.bf16 for m in w8a8) else None

    @staticmethod
    def _layer_plan(layer, glu) -> tuple:
        """(qkv, q, k, v, o, gate_up, down, many_mlp, bf16): a callable per projection (the kernel call
        itself for a packed one, packed_linear.direct, else the module), None where fused or unfused
        away; many_mlp: (rows, the MLP in bf16, bf16 in and out, for at least that many rows) where its
        projections have a bf16 oneDNN copy (packed_linear.bf16_mlp), else None; bf16: (rows, qkv, o,
        mlp), each bf16 in and out, where q/k/v are joined and the attention's and the MLP's
        projections all have a bf16 copy without bias (packed_linear.bf16_matmul), else None."""
        from ..packed_linear import bf16_matmul, bf16_mlp, direct

        attn, mlp = layer.self_attn, layer.mlp
        get = lambda m, name: direct(getattr(m, name, None))  # noqa: E731
        many_mlp = bf16_mlp(getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None), glu)
        qkv, o = bf16_matmul(getattr(attn, "qkv_proj", None)), bf16_matmul(getattr(attn, "o_proj", None))
        bf16 = None if None in (qkv, o, many_mlp) else (max(qkv[0], o[0], many_mlp[0]), qkv[1], o[1], many_mlp[1])
        return (get(attn, "qkv_proj"), get(attn, "q_proj"), get(attn, "k_proj"), get(attn, "v_proj"),
                get(attn, "o_proj"), get(mlp, "gate_up_proj"), get(mlp, "down_proj"), many_mlp, bf16)

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        if hasattr(mlp, "gate_up_proj") and self.glu is not None:  # fused by the engine, or in the checkpoint
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
            return mlp.down_proj(self.glu(gate, up))
        return mlp(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the step's sampling rows: float32. After a step that ran in bf16 between the
        norms, a decode batch's (packed_linear.BF16_DOT_ROWS) on qtk's bf16 kernel where the lm_head
        has it (its rows rounded to bf16 as every matmul's of that step, float32 sums); else the
        lm_head's float32 products. Rows counted as rows_of does (a step verifying drafts: the plain
        step's)."""
        dot = getattr(self.lm_head, "dot", None)
        if self._step_bf16 and dot is not None and dot.lo <= rows_of(hidden) < dot.hi:
            logits = dot(hidden.contiguous())
        else:
            logits = self.lm_head(hidden).float()
        if self.final_softcap:  # Gemma 2: logits = cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
