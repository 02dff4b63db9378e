"""The DeepSeek-family model: MLA attention + DeepSeekMoE, HF parameter names.

With the V4.1-style options off this is DeepSeek-V3 (checked against transformers).
Parameter names match HF checkpoints, except that routed experts are stacked into
physical slots (`mlp.w13`, `mlp.w2`); the loader converts.
"""
from __future__ import annotations

import torch
from torch import nn

from wideep_kernels.gemv import linear, norm_gemv_applies, norm_gemv_triton
from wideep_kernels.head_gemv import head_gemv, head_gemv_applies, head_gemv_triton
from wideep_kernels.latent import latent_and_query, norm_rope_latent

from .attention import AttentionContext, attend, index_topk_mask
from .config import ModelConfig
from .decode_attention import decode_attention, decode_topk
from .layers import MLP, DerivedWeight, NormInput, RMSNorm, Rotary, defer_norm, fused_linear, fused_weight
from .moe import MoE
from .streams import Branch


class Indexer(nn.Module):
    """Scores the global KV for sparse attention (MQA scoring heads).

    Only KV-source layers own `wk` (the index keys are cached beside the global latent);
    every layer owns its queries and head weights.
    """

    def __init__(self, cfg: ModelConfig, is_source: bool):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False) if is_source else None


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        self.cfg, self.layer, self.rotary = cfg, layer, rotary
        h = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.is_source = layer in cfg.source_layers
        self.source = cfg.source_slot(layer)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.n_heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, bias=False)
        # A layer computes its own latent when it feeds the global KV or keeps a window.
        self.has_latent = self.is_source or cfg.sliding_window is not None
        if self.has_latent:
            self.kv_a_proj_with_mqa = nn.Linear(h, cfg.latent_dim, bias=cfg.attention_bias)
            self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.n_heads * cfg.v_head_dim, h, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg, self.is_source) if cfg.index_topk else None
        self.scale = cfg.softmax_scale  # what the padded path and the decode kernels both read
        self._fused = DerivedWeight(track_writes=False)  # the x projections' concatenated weight, see project()
        self.overlap = False  # EngineConfig.decode_overlap, set by the model runner
        # EngineConfig.index_topk_freq/pattern, set by the model runner: attend to the latest
        # scoring layer's selection (ctx.shared_topk) instead of scoring here
        self.reuse_topk = False

    @property
    def scores(self) -> bool:
        """Whether this layer's indexer scores the global KV and selects its own top-k."""
        return self.indexer is not None and not self.reuse_topk

    def _x_projections(self) -> list[tuple[str, nn.Linear]]:
        """The projections that read the layer input x (all fused into one GEMM)."""
        mods = [("q", self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj)]
        if self.has_latent:
            mods.append(("kv", self.kv_a_proj_with_mqa))
        if self.scores:
            mods += [("idx_q", self.indexer.wq), ("idx_w", self.indexer.weights_proj)]
        if self.indexer is not None:
            if self.indexer.wk is not None:
                mods.append(("idx_k", self.indexer.wk))
        return mods

    def project(self, x: torch.Tensor | NormInput) -> dict[str, torch.Tensor]:
        """Every projection of x in one GEMM instead of up to five (a cached concatenated copy of
        their weights, a few MB per layer); for a NormInput, the norm in the same launch."""
        names, mods = zip(*self._x_projections())
        if isinstance(x, NormInput):
            weight, _ = fused_weight(list(mods), self._fused)
            out = norm_gemv_triton(x.x, x.residual, x.norm.weight, x.norm.eps, weight, x.stream)
            return dict(zip(names, out.split([m.out_features for m in mods], dim=-1)))
        return dict(zip(names, fused_linear(x, list(mods), self._fused)))

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> bool:
        """Whether project() can take this input's norm as a NormInput (one row on a GPU)."""
        if x.dim() != 2 or x.shape[0] != 1:
            return False
        weight, bias = fused_weight([m for _, m in self._x_projections()], self._fused)
        return norm_gemv_applies(x, residual, norm.weight, weight, bias)

    def forward(self, x: torch.Tensor | NormInput, ctx: AttentionContext) -> torch.Tensor:
        cfg = self.cfg
        t = x.x.shape[0] if isinstance(x, NormInput) else x.shape[0]
        device = x.x.device if isinstance(x, NormInput) else x.device
        xp = self.project(x)
        latent = q_low = None
        written = False
        if self.has_latent:
            # [norm(c_kv) | rope(k_rope)] in one launch on GPU (wideep_kernels/latent.py), with the
            # query's low-rank norm and, at decode, a source layer's cache write in the same one
            norm = self.kv_a_layernorm
            if cfg.q_lora_rank is not None:
                write = ctx.direct_write(self.source, xp.get("idx_k")) if self.is_source else None
                latent, q_low = latent_and_query(xp["kv"], norm.weight, norm.eps, *ctx.rope, self.rotary.interleave,
                                                 xp["q"], self.q_a_layernorm.weight, self.q_a_layernorm.eps, write)
                written = write is not None
            else:
                latent = norm_rope_latent(xp["kv"], norm.weight, norm.eps, *ctx.rope, self.rotary.interleave)
        if self.is_source and not written:
            ctx.write_global(self.source, latent, xp.get("idx_k"))

        idx_q = idx_w = None
        if self.scores:
            idx_q = xp["idx_q"].view(t, self.indexer.n_heads, self.indexer.head_dim)
            idx_w = xp["idx_w"]  # head weights, scaled by 1/sqrt(heads) in fp32 where they are used
        topk = None
        if ctx.decode is not None and not self.reuse_topk:
            # The indexer's top-k needs neither the queries below nor the latent; in a captured
            # decode step it runs beside them (engine/streams.py). The keys it reads were written
            # above, before the fork.
            topk = Branch(self.overlap, decode_topk, self, idx_q, idx_w, ctx)

        if cfg.q_lora_rank is None:
            q = xp["q"]
        else:
            q_b = self.q_b_proj
            q = linear(q_low if q_low is not None else self.q_a_layernorm(xp["q"]), q_b.weight, q_b.bias)
        q = q.view(t, self.n_heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rope = self.rotary.apply(q_rope, *ctx.rope)
        w_kv = self.kv_b_proj.weight.view(self.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :cfg.qk_nope_head_dim], w_kv[:, cfg.qk_nope_head_dim:]
        q_lat = head_gemv(q_nope, w_uk)

        if ctx.decode is not None:  # the kernel takes the two query parts as they are
            if topk is not None:
                ctx.shared_topk = topk.join()
            out = decode_attention(self, (q_lat, q_rope), ctx.shared_topk, latent, ctx)  # [T, H, kv_lora]
        else:
            if idx_w is not None:
                idx_w = idx_w.float() * self.indexer.n_heads ** -0.5
            q_full = torch.cat([q_lat, q_rope], dim=-1)  # [T, H, D]
            out = self._attend_padded(q_full[ctx.q_index], idx_q, idx_w, latent, ctx)
        out, w_uv = out.to(q_lat.dtype), w_uv.transpose(1, 2)
        if head_gemv_applies(out, w_uv):
            heads_out = head_gemv_triton(out, w_uv)
        else:
            # The value up-projection writes [T, H, V] in place (the batched GEMM takes the strided
            # output), so o_proj's input needs no copy.
            heads_out = torch.empty(t, self.n_heads, cfg.v_head_dim, dtype=q_lat.dtype, device=device)
            torch.bmm(out.transpose(0, 1), w_uv, out=heads_out.transpose(0, 1))
        return linear(heads_out.view(t, -1), self.o_proj.weight, self.o_proj.bias)

    def _attend_padded(self, q_full: torch.Tensor, idx_q: torch.Tensor | None, idx_w: torch.Tensor | None,
                       latent: torch.Tensor | None, ctx: AttentionContext) -> torch.Tensor:
        """Any batch (prefill chunks, mixed): queries padded to [B, N], masks over [B, N, C]."""
        cfg = self.cfg
        g_keys, idx_keys = ctx.global_keys(self.source)
        g_mask = ctx.g_mask
        if self.scores:
            g_mask = ctx.shared_g_mask = index_topk_mask(idx_q[ctx.q_index], idx_w[ctx.q_index], idx_keys, g_mask,
                                                         cfg.index_topk)
        elif self.indexer is not None:
            g_mask = ctx.shared_g_mask
        if cfg.sliding_window is not None:
            keys = torch.cat([g_keys, ctx.window_keys(self.layer, latent)], dim=1)
            mask = torch.cat([g_mask, ctx.w_mask], dim=-1)
            ctx.write_window(self.layer, latent)
        else:
            keys, mask = g_keys, g_mask
        out = attend(q_full, keys, mask, self.scale, cfg.kv_lora_rank)  # [B, N, H, kv_lora]
        return out.flatten(0, 1)[ctx.q_flat]  # [T, H, kv_lora], in token order


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary, local_phys2log: list[int] | None = None,
                 expert_fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer, rotary)
        self.mlp = (MoE(cfg, local_phys2log, expert_fp8_block) if cfg.is_moe_layer(layer)
                    else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output (the embeddings, with residual None, for the first
        layer). Returns this layer's MLP output and the residual stream before it: the stream is
        x + residual, and each add is folded into the norm that follows it. At batch 1 the norm
        itself is folded into the next module's first kernel where it takes it (defer_norm)."""
        h, residual = defer_norm(self.input_layernorm, x, residual, self.self_attn)
        h, residual = defer_norm(self.post_attention_layernorm, self.self_attn(h, ctx), residual, self.mlp)
        return self.mlp(h), residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device="cpu", local_phys2log: list[list[int]] | None = None,
                 expert_fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.rotary = rotary = Rotary(cfg.qk_rope_head_dim, cfg.rope_base, cfg.rope_interleave,
                                      cfg.max_position_embeddings, device, cfg.rope_yarn)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        moe_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        per_layer = {layer: local_phys2log[k] for k, layer in enumerate(moe_ids)} if local_phys2log else {}
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, per_layer.get(i), expert_fp8_block)
                                    for i in range(cfg.num_hidden_layers))
        for k, layer in enumerate(moe_ids):
            self.layers[layer].mlp.layer_index = k
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """local_phys2log (expert parallelism): per MoE layer, the logical experts of this rank's slots.
    expert_fp8_block: the routed experts allocated as block FP8 (MoE's fp8_block)."""

    def __init__(self, cfg: ModelConfig, device="cpu", local_phys2log: list[list[int]] | None = None,
                 expert_fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekModel(cfg, device, local_phys2log, expert_fp8_block)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the hidden rows; out: a [rows, vocab] fp32 buffer to write them into."""
        logits = linear(hidden, self.lm_head.weight)
        return logits.float() if out is None else out.copy_(logits)

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]
